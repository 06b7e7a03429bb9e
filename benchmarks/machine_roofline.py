"""`cp-runtime bench roofline`: this machine's measured memory bandwidth and matmul FLOP/s, on
their own (the measurement and its formulas: benchmarks/_shared/roofline_probe.py, which
throughput, decode and profile run in their own process).

    cp-runtime bench roofline --shards 16    # writes out/roofline.json
    cp-runtime bench roofline --quick        # 2 timed calls per figure instead of 5
"""

from __future__ import annotations

import argparse

import jax

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.benchmarks._shared.roofline_probe import measure_roofline
from cp_runtime.cli.args import positive_int

__all__ = ["build_parser", "parse_args", "main"]

QUICK = {"repeats": ("5", "2")}


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("roofline", "Measured memory bandwidth and f32 matmul FLOP/s.",
                        quick="fewer timed calls", quick_values=QUICK)
    p.add_argument("--mem-mib", type=positive_int, default=None,
                   help="size of the bandwidth array, all devices together (unset: by backend)")
    p.add_argument("--matmul-n", type=positive_int, default=None,
                   help="matmul side per device (unset: by backend)")
    p.add_argument("--repeats", type=positive_int, help="timed calls per figure, the best reported")
    p.add_shared(shards=16, out="out", progress=True)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for `--shards` set up, then
    `--out` created."""
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure_roofline(jax.devices()[: args.shards], mem_mib=args.mem_mib,
                              matmul_n=args.matmul_n, repeats=args.repeats)
    print_table([result], ["devices", "mem_bytes", "read_gb_per_s", "copy_gb_per_s",
                           "matmul_n", "matmul_gflop_per_s"],
                title=f"roofline on {machine()['processor']}, backend {machine()['backend']}")
    write_json(args.out / "roofline.json", {"roofline": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
