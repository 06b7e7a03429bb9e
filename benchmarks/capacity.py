"""Cache capacity per model config and cache dtype: bytes per token, tokens per GiB, the ratio to
bf16, and the tokens that fit on a TPU slice after weights.

    cp-runtime bench capacity                          # 16 x v7x (192 GiB), no weights
    cp-runtime bench capacity --weights-gib 48 --models glm-5.2 --kv-cache-dtypes bf16,fp8_e4m3

Every figure comes from `cp_runtime.capacity` (the single source the scheduler and the pool also
use): `bytes_per_token` = latent rows of every layer + indexer keys of every `full` layer, and
`capacity_report` for what fits. For GLM-5.2 this reproduces bf16 105,216 B/token, fp8 55,296
B/token, 1.90x. f32 is listed for reference (the exactness tests' dtype).
"""

from __future__ import annotations

import argparse
import pathlib

from cp_runtime.benchmarks.common import print_table, write_json
from cp_runtime.benchmarks.plots import bar_chart
from cp_runtime.capacity import capacity_report
from cp_runtime.cli_args import (HelpFormatter, add_kv_cache_dtypes, add_out, check_out_dir,
                                 comma_list, finite_nonnegative_float, finite_positive_float,
                                 positive_int)
from cp_runtime.config import load_model_config, model_names
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype

__all__ = ["DTYPES", "capacity_rows", "build_parser", "parse_args", "main"]

DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2", "f32")


def capacity_rows(models: list[str], dtypes: list[str], *, devices: int, hbm_gib: float,
                  weights_gib: float) -> list[dict]:
    """One row per (model, dtype): bytes per token, tokens per GiB, ratio vs bf16, slice tokens."""
    rows = []
    for name in models:
        model = load_model_config(name)
        for dtype in dtypes:
            one_gib = capacity_report(model, dtype, devices=1, hbm_gib=1.0, weights_gib=0.0)
            slice_ = capacity_report(model, dtype, devices=devices, hbm_gib=hbm_gib,
                                     weights_gib=weights_gib)
            rows.append({
                "model": name,
                "dtype": dtype,
                "latent": latent_cache_dtype(dtype).name,
                "indexer": indexer_cache_dtype(dtype).name,
                "bytes_per_token": slice_.bytes_per_token,
                "tokens_per_gib": one_gib.tokens_that_fit,
                "ratio_vs_bf16": f"{slice_.ratio_vs_bf16_2dp}x",
                "slice_tokens": slice_.tokens_that_fit,
                "slice_tokens_M": slice_.tokens_that_fit / 1e6,
            })
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cp-runtime bench capacity", formatter_class=HelpFormatter,
                                description="Cache bytes per token, tokens per GiB and tokens "
                                            "that fit on a slice, per model config and dtype.")
    p.add_argument("--models", type=comma_list(str, choices=model_names()),
                   default=",".join(model_names()), metavar="NAME[,NAME...]",
                   help="model configs (configs/models/NAME.toml) to compare")
    add_kv_cache_dtypes(p, ",".join(DTYPES))
    p.add_argument("--devices", type=positive_int, default=16, help="devices holding the cache")
    p.add_argument("--hbm-gib", type=finite_positive_float, default=192.0,
                   help="HBM per device in GiB (TPU v7x: 192)")
    p.add_argument("--weights-gib", type=finite_nonnegative_float, default=0.0,
                   help="GiB per device taken by weights and activations")
    add_out(p, "out/capacity")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with `--out` created."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.weights_gib >= args.hbm_gib:
        parser.error(f"--weights-gib {args.weights_gib:g}: leaves no room in --hbm-gib "
                     f"{args.hbm_gib:g}")
    check_out_dir(parser, args.out)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models, dtypes = args.models, args.kv_cache_dtypes
    rows = capacity_rows(models, dtypes, devices=args.devices, hbm_gib=args.hbm_gib,
                         weights_gib=args.weights_gib)
    where = (f"{args.devices} devices x {args.hbm_gib:g} GiB, {args.weights_gib:g} GiB each "
             "for weights")
    print_table(rows, ["model", "dtype", "latent", "indexer", "bytes_per_token", "tokens_per_gib",
                       "ratio_vs_bf16", "slice_tokens_M"],
                title=f"cache capacity (slice: {where})")
    out = pathlib.Path(args.out)
    json_path = write_json(out / "capacity.json",
                           {"devices": args.devices, "hbm_gib": args.hbm_gib,
                            "weights_gib": args.weights_gib, "rows": rows})
    png_path = bar_chart(out / "capacity.png", models,
                         {d: [r["slice_tokens"] for r in rows if r["dtype"] == d]
                          for d in dtypes},
                         ylabel="tokens that fit", log=True,
                         title=f"cache tokens on {where}")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
