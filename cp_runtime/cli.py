"""The `cp-runtime` command line.

    cp-runtime capacity --model glm-5.2 --kv-cache-dtype fp8_e4m3 --json
    cp-runtime demo                 run the quick needle sweep on 16 local CPU shards
    cp-runtime bench NAME [...]     run a benchmark (niah, capacity, kernel_error, ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from cp_runtime.capacity import capacity_report
from cp_runtime.config import ConfigError, load_model_config, model_names
from cp_runtime.dtypes import KV_CACHE_DTYPES

__all__ = ["main", "build_parser"]

BENCHMARKS = ("niah", "capacity", "kernel_error", "selection", "throughput", "kernels", "merge",
              "roofline", "million", "tpu_model", "all")


def _add_capacity(sub) -> None:
    from cp_runtime.capacity import TOPOLOGIES, WEIGHT_DTYPES
    from cp_runtime.cli_args import finite_positive_float, positive_int

    p = sub.add_parser("capacity", help="bytes per token and tokens that fit, per cache dtype",
                       description="Per device of a deployment: HBM, the weights' shard (from "
                                   "the config's tensors and weight dtype), a reserve for "
                                   "activations, the KV bytes left, and the tokens that fit "
                                   "at bf16 and fp8 (cache bytes per token: latent + indexer, "
                                   "all layers). See cp_runtime.capacity for the rules.")
    p.add_argument("--model", default="glm-5.2", help=f"model config: {', '.join(model_names())}")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=list(KV_CACHE_DTYPES),
                   help="latent cache dtype (the indexer cache stays bf16 for fp8)")
    p.add_argument("--topology", choices=list(TOPOLOGIES), default=None,
                   help="a known slice (TPU v7x: 96 GiB per device, 2 devices per chip); "
                        "default tpu7x-16 unless --devices and --hbm-gib are given")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="devices holding weights and cache (with --hbm-gib, for any slice)")
    p.add_argument("--hbm-gib", type=finite_positive_float, default=None,
                   help="HBM per device in GiB (with --devices)")
    p.add_argument("--weight-dtype", choices=list(WEIGHT_DTYPES), default="fp8",
                   help="fp8: block-scaled matmul weights as the public fp8 checkpoints store "
                        "them (norms, embeddings bf16); bf16: every weight bf16")
    p.add_argument("--reserve-gib", type=finite_positive_float, default=None,
                   help="GiB per device kept for activations (default: 10%% of HBM)")
    p.add_argument("--weights-gib", type=finite_positive_float, default=None,
                   help="override: GiB per device taken by weights and activations together "
                        "(no weights computed, no reserve unless --reserve-gib)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run_capacity(args) -> int:
    from cp_runtime.capacity import TOPOLOGIES, deployment_report

    model = load_model_config(args.model)
    if (args.devices is None) != (args.hbm_gib is None):
        raise ValueError("--devices and --hbm-gib go together")
    if args.topology is not None and args.devices is not None:
        raise ValueError("give --topology, or --devices with --hbm-gib, not both")
    topo = None if args.devices is not None else TOPOLOGIES[args.topology or "tpu7x-16"]
    devices, hbm = (topo.devices, topo.hbm_gib) if topo else (args.devices, args.hbm_gib)
    if args.weights_gib is not None:
        report = capacity_report(model, args.kv_cache_dtype, devices=devices, hbm_gib=hbm,
                                 weights_gib=args.weights_gib, reserve_gib=args.reserve_gib or 0.0,
                                 topology=topo and topo.name)
    else:
        report = deployment_report(model, args.kv_cache_dtype, devices=devices, hbm_gib=hbm,
                                   weight_dtype=args.weight_dtype, reserve_gib=args.reserve_gib,
                                   topology=topo and topo.name)
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
        return 0
    r = report
    print(f"model {r.model} on {r.topology or 'a custom slice'}: {r.devices} devices x "
          f"{r.hbm_gib_per_device:g} GiB HBM")
    print(f"per device: weights {r.weights_gib_per_device:.2f} GiB"
          + (f" ({r.weight_dtype})" if r.weight_dtype else "")
          + f", reserve {r.reserve_gib_per_device:.2f} GiB, KV {r.kv_gib_per_device:.2f} GiB"
          + ("" if r.weights_fit else "  (weights and reserve exceed HBM: nothing fits)"))
    print(f"{'cache dtype':<12} {'bytes/token':>12} {'tokens that fit':>16}")
    print(f"{'bf16':<12} {r.bytes_per_token_bf16:>12,} {r.tokens_that_fit_bf16:>16,}")
    print(f"{'fp8':<12} {r.bytes_per_token_fp8:>12,} {r.tokens_that_fit_fp8:>16,}")
    if r.kv_cache_dtype not in ("bf16", "fp8_e4m3", "fp8_e5m2"):
        print(f"{r.kv_cache_dtype:<12} {r.bytes_per_token:>12,} {r.tokens_that_fit:>16,}")
    print(f"ratio bf16 / {r.kv_cache_dtype}: {r.ratio_vs_bf16:.2f}x")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cp-runtime",
        description="Long-context serving runtime for DeepSeek Sparse Attention models: a paged "
                    "fp8 MLA cache sharded by position over a context-parallel mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_capacity(sub)
    demo = sub.add_parser("demo", help="quick needle-in-a-haystack sweep on 16 local CPU shards")
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="extra arguments for benchmarks.niah")
    bench = sub.add_parser("bench", help="run a benchmark of the long-context suite")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark "
                       "(see cp-runtime bench NAME --help)")
    return parser


def _run_benchmark(name: str, argv: list[str]) -> int:
    module = __import__(f"cp_runtime.benchmarks.{name}", fromlist=["main"])  # benchmarks load on demand
    return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "capacity":
            return _run_capacity(args)
        if args.command == "demo":
            return _run_benchmark("niah", ["--quick", *args.rest])
        return _run_benchmark("report" if args.name == "all" else args.name, args.rest)
    except (ConfigError, ValueError) as e:
        print(f"cp-runtime: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
