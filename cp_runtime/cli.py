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
              "roofline", "million", "all")


def _add_capacity(sub) -> None:
    p = sub.add_parser("capacity", help="bytes per token and tokens that fit, per cache dtype",
                       description="Cache bytes per token (latent + indexer, all layers) for bf16 "
                                   "and the chosen dtype, and how many tokens fit in the "
                                   "devices' HBM after weights.")
    p.add_argument("--model", default="glm-5.2", help=f"model config: {', '.join(model_names())}")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3", choices=list(KV_CACHE_DTYPES),
                   help="latent cache dtype (the indexer cache stays bf16 for fp8)")
    p.add_argument("--devices", type=int, default=16, help="devices holding the cache")
    p.add_argument("--hbm-gib", type=float, default=192.0,
                   help="HBM per device in GiB (TPU v7x: 192)")
    p.add_argument("--weights-gib", type=float, default=0.0,
                   help="GiB per device taken by weights and activations")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run_capacity(args) -> int:
    report = capacity_report(load_model_config(args.model), args.kv_cache_dtype,
                             devices=args.devices, hbm_gib=args.hbm_gib,
                             weights_gib=args.weights_gib)
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
        return 0
    print(f"model {report.model}, {report.devices} devices x {report.hbm_gib_per_device} GiB, "
          f"weights {report.weights_gib_per_device} GiB each")
    print(f"{'cache dtype':<12} {'bytes/token':>12} {'tokens that fit':>16}")
    print(f"{'bf16':<12} {report.bytes_per_token_bf16:>12,} {report.tokens_that_fit_bf16:>16,}")
    print(f"{report.kv_cache_dtype:<12} {report.bytes_per_token:>12,} "
          f"{report.tokens_that_fit:>16,}")
    print(f"ratio bf16 / {report.kv_cache_dtype}: {report.ratio_vs_bf16:.2f}x")
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
