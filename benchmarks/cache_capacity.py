"""Cache capacity per model config and cache dtype: bytes per token, tokens per GiB, the ratio to
bf16, and the tokens that fit on a TPU slice after each model's weights and an activation
reserve. One device model with `cp-runtime capacity`: the same slice, weights and reserve, so
glm-5.2's fp8 row is the fp8 figure of `cp-runtime capacity --model glm-5.2`.

    cp-runtime bench capacity                          # tpu7x-16: 16 devices x 96 GiB
    cp-runtime bench capacity --topology tpu7x-32 --models glm-5.2,deepseek-v3.2
    cp-runtime bench capacity --devices 16 --hbm-gib 96 --weights-gib 48   # a fixed weight share

Every figure comes from `cp_runtime.cache.capacity` (the single source the scheduler and the pool
also use): `bytes_per_token` = latent rows of every layer + indexer keys of every `full` layer, and
`slice_report` for what fits: per device, HBM minus the model's weight shard (from its config's
tensors and `--weight-dtype`, split as `--weights` says, `auto` as the runtime resolves it) minus
the reserve (10% of HBM unless `--reserve-gib`), over every device of the slice. `--weights-gib`
replaces the computed weights by a fixed share (and no reserve unless `--reserve-gib`). For
GLM-5.2 this reproduces bf16 105,216 B/token, fp8 55,296 B/token, 1.90x. f32 is listed for
reference (the exactness tests' dtype).

The chart (capacity.png) shows the full-size models (a billion parameters or more: glm-5.2,
deepseek-v3.2) in one panel and the toy test models (tiny, small, ...), whose weights are
nothing beside a device, in another.
"""

from __future__ import annotations

import argparse
import math
import pathlib

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.plots import bar_chart
from cp_runtime.benchmarks._shared.results import print_table, write_json
from cp_runtime.cache.capacity import (DEFAULT_TOPOLOGY, GIB, TOPOLOGIES, bytes_per_token,
                                       slice_report)
from cp_runtime.cli.args import comma_list, finite_positive_float, positive_int
from cp_runtime.config import ModelConfig, load_model_config, model_names
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype

__all__ = ["DTYPES", "FULL_SIZE_PARAMS", "capacity_rows", "is_full_size", "build_parser",
           "parse_args", "main"]

DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2", "f32")
FULL_SIZE_PARAMS = 10 ** 9        # the chart's line between full-size and toy models
GROUPS = {True: "full-size models (1B+ parameters)", False: "toy test models (under 1B)"}


def is_full_size(model: ModelConfig) -> bool:
    """A billion parameters or more (glm-5.2, deepseek-v3.2), as opposed to the toy test
    configs (tiny, small, recall, ...)."""
    from cp_runtime.weights.params import param_shapes       # imports jax; keep the module light

    return sum(math.prod(s) for s in param_shapes(model).values()) >= FULL_SIZE_PARAMS


def capacity_rows(models: list[str], dtypes: list[str], **slice_args) -> list[dict]:
    """One row per (model, dtype): bytes per token, tokens per GiB, ratio vs bf16, the weights
    and KV GiB per device and the tokens that fit on the slice (`slice_args`: slice_report's
    keywords)."""
    rows = []
    for name in models:
        model = load_model_config(name)
        group = GROUPS[is_full_size(model)]
        for dtype in dtypes:
            r = slice_report(model, dtype, **slice_args)
            rows.append({
                "model": name,
                "group": group,
                "dtype": dtype,
                "latent": latent_cache_dtype(dtype).name,
                "indexer": indexer_cache_dtype(dtype).name,
                "bytes_per_token": r.bytes_per_token,
                "tokens_per_gib": GIB // bytes_per_token(model, dtype),
                "ratio_vs_bf16": f"{r.ratio_vs_bf16_2dp}x",
                "weight_dtype": r.weight_dtype,
                "weights_gib": r.weights_gib_per_device,
                "reserve_gib": r.reserve_gib_per_device,
                "kv_gib": r.kv_gib_per_device,
                "weights_fit": r.weights_fit,
                "slice_tokens": r.tokens_that_fit,
                "slice_tokens_M": r.tokens_that_fit / 1e6,
            })
    return rows


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("capacity", "Cache bytes per token, tokens per GiB and tokens that fit on "
                                    "a slice after each model's weights and a reserve (the "
                                    "device model of `cp-runtime capacity`), per model config "
                                    "and dtype.",
                        quick="accepted for `bench all --quick`; a no-op: this is arithmetic, "
                              "well under a second",
                        check=_check)
    p.add_argument("--models", type=comma_list(str, choices=model_names()),
                   default=",".join(model_names()), metavar="NAME[,NAME...]",
                   help="model configs (configs/models/NAME.toml) to compare")
    p.add_argument("--topology", choices=list(TOPOLOGIES), default=None,
                   help="a known slice (TPU v7x: 96 GiB per device, 2 devices per chip); "
                        f"default {DEFAULT_TOPOLOGY} unless --devices and --hbm-gib are given")
    p.add_argument("--devices", type=positive_int, default=None, metavar="N",
                   help="devices holding weights and cache (with --hbm-gib, for any slice)")
    p.add_argument("--hbm-gib", type=finite_positive_float, default=None, metavar="GIB",
                   help="HBM per device in GiB (with --devices)")
    p.add_argument("--reserve-gib", type=finite_positive_float, default=None, metavar="GIB",
                   help="GiB per device kept for activations (default: 10%% of HBM)")
    p.add_argument("--weights-gib", type=finite_positive_float, default=None, metavar="GIB",
                   help="override: GiB per device taken by weights and activations together, "
                        "the same for every model (no weights computed, no reserve unless "
                        "--reserve-gib)")
    p.add_shared(kv_cache_dtypes=",".join(DTYPES), weight_dtype=True, weights=True,
                 out="out/capacity", progress=True)
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    """The slice resolved (`args.devices`, `args.hbm_gib`, `args.topology`: None for a custom
    slice), with room left on a device."""
    if (args.devices is None) != (args.hbm_gib is None):
        parser.error("--devices and --hbm-gib go together")
    if args.topology is not None and args.devices is not None:
        parser.error("give --topology, or --devices with --hbm-gib, not both")
    if args.devices is None:
        topo = TOPOLOGIES[args.topology or DEFAULT_TOPOLOGY]
        args.topology, args.devices, args.hbm_gib = topo.name, topo.devices, topo.hbm_gib
    taken = (args.weights_gib or 0.0) + (args.reserve_gib or 0.0)
    if taken >= args.hbm_gib:
        parser.error(f"--weights-gib {args.weights_gib or 0:g} with --reserve-gib "
                     f"{args.reserve_gib or 0:g}: leaves no room in the {args.hbm_gib:g} GiB "
                     "of a device (--hbm-gib)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the slice resolved, then `--out`
    created."""
    return build_parser().parse_args(argv)


def _where(args) -> str:
    slice_ = ((f"{args.topology}, " if args.topology else "")
              + f"{args.devices} devices x {args.hbm_gib:g} GiB")
    if args.weights_gib is not None:
        return f"{slice_}, {args.weights_gib:g} GiB each for weights"
    reserve = (f"{args.reserve_gib:g} GiB" if args.reserve_gib is not None else "10%")
    return (f"{slice_}, each model's weights (--weight-dtype {args.weight_dtype}) and a "
            f"{reserve} reserve per device")


def _chart(path: pathlib.Path, rows: list[dict], dtypes: list[str], where: str) -> pathlib.Path:
    panels = []
    for group in GROUPS.values():
        models = list(dict.fromkeys(r["model"] for r in rows if r["group"] == group))
        if models:
            panels.append((group, models, {d: [r["slice_tokens_M"] for r in rows
                                               if r["group"] == group and r["dtype"] == d]
                                           for d in dtypes}))
    # Linear axes: each panel has its own, and within a group the sizes are comparable.
    return bar_chart(path, panels, ylabel="tokens that fit (millions)",
                     title=f"cache tokens on {where}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtypes = args.kv_cache_dtypes
    slice_ = ({"topology": args.topology} if args.topology else
              {"devices": args.devices, "hbm_gib": args.hbm_gib})
    rows = capacity_rows(args.models, dtypes, **slice_, weight_dtype=args.weight_dtype,
                         weights=args.weights, reserve_gib=args.reserve_gib,
                         weights_gib=args.weights_gib)
    where = _where(args)
    print_table(rows, ["model", "dtype", "latent", "indexer", "bytes_per_token", "tokens_per_gib",
                       "ratio_vs_bf16", "weights_gib", "kv_gib", "slice_tokens_M"],
                title=f"cache capacity (slice: {where}; weights and KV in GiB per device)")
    out = args.out
    json_path = write_json(out / "capacity.json",
                           {"topology": args.topology, "devices": args.devices,
                            "hbm_gib": args.hbm_gib, "weight_dtype": args.weight_dtype,
                            "weights": args.weights, "reserve_gib": args.reserve_gib,
                            "weights_gib": args.weights_gib, "rows": rows})
    png_path = _chart(out / "capacity.png", rows, dtypes, where)
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
