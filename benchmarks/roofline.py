"""This machine's roofline: measured memory bandwidth and matmul FLOP/s, in the same process as the
benchmark that divides by them (benchmarks/throughput.py).

Each figure is the aggregate over the devices given (every device works on its own shard at
once), so it is the right denominator for a step that runs on those devices: on a CPU the virtual
devices share the cores and the measurement says how much the cores deliver together; on a TPU
slice it is the sum over the chips.

    read   GB/s = (bytes of x) / t(sum of x per shard)             (read once, no write)
    copy   GB/s = 2 * (bytes of x) / t(x + 1 per shard)            (read once, write once)
    matmul FLOP/s = 2 * n^3 * devices / t(one f32 [n, n] @ [n, n] per device)

Times are the best of `repeats` calls after a compile-and-warm call (a peak, not a mean: the
denominators of "achieved fraction"). `memory_gb_per_s` is the larger of read and copy.

    cp-runtime bench roofline --shards 16    # writes out/roofline.json
    cp-runtime bench roofline --quick        # 2 timed calls per figure instead of 5
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from cp_runtime.benchmarks.args import BenchmarkParser
from cp_runtime.benchmarks.common import machine, print_table, write_json
from cp_runtime.cli.args import positive_int

__all__ = ["measure_roofline", "default_sizes", "build_parser", "parse_args", "main"]

_AXIS = "roofline"
QUICK = {"repeats": ("5", "2")}


def default_sizes(backend: str, devices: int) -> tuple[int, int]:
    """(bytes of the bandwidth array in MiB, matmul side n) for a backend: small enough for a
    shared 2-core CPU (256 MiB in all, past its caches), large enough to reach peak on a TPU
    (1 GiB and an [8192, 8192] matmul per chip)."""
    if backend == "cpu":
        return 256, 1024
    return 1024 * devices, 8192


def _best_seconds(fn: Callable, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))                                     # compile and warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_roofline(devices: list | None = None, *, mem_mib: int | None = None,
                     matmul_n: int | None = None, repeats: int = 5) -> dict:
    """Measured memory bandwidth (GB/s, 1e9 bytes) and f32 matmul FLOP/s over `devices`.

    Returns {"devices", "mem_bytes", "matmul_n", "read_gb_per_s", "copy_gb_per_s",
    "memory_gb_per_s", "matmul_gflop_per_s"} (all positive).
    """
    devices = list(devices or jax.devices())
    s = len(devices)
    mem_default, n_default = default_sizes(devices[0].platform, s)
    mem_mib, matmul_n = mem_mib or mem_default, matmul_n or n_default
    mesh = jax.make_mesh((s,), (_AXIS,), devices=devices)
    sharded = NamedSharding(mesh, PartitionSpec(_AXIS))
    per_device = max(1, (mem_mib << 20) // (4 * s))                      # f32 elements
    x = jax.jit(lambda: jnp.ones((s, per_device), jnp.float32), out_shardings=sharded)()
    a = jax.jit(lambda: jnp.full((s, matmul_n, matmul_n), 1e-3, jnp.float32),
                out_shardings=sharded)()

    def per_shard(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec(_AXIS),
                                     out_specs=PartitionSpec(_AXIS)))

    read_s = _best_seconds(per_shard(lambda v: v.sum(axis=1)), x, repeats=repeats)
    copy_s = _best_seconds(per_shard(lambda v: v + 1.0), x, repeats=repeats)
    mm_s = _best_seconds(per_shard(lambda m: m @ m), a, repeats=repeats)
    nbytes = x.nbytes
    read, copy = nbytes / read_s / 1e9, 2 * nbytes / copy_s / 1e9
    return {"devices": s, "mem_bytes": nbytes, "matmul_n": matmul_n,
            "read_gb_per_s": read, "copy_gb_per_s": copy, "memory_gb_per_s": max(read, copy),
            "matmul_gflop_per_s": 2 * matmul_n ** 3 * s / mm_s / 1e9}


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
