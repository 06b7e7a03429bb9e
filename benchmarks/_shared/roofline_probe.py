"""This machine's roofline: measured memory bandwidth and matmul FLOP/s, in the same process as the
benchmark that divides by them (benchmarks/throughput.py, decode.py, profile.py; on its own:
`cp-runtime bench roofline`, benchmarks/machine_roofline.py).

Each figure is the aggregate over the devices given (every device works on its own shard at
once), so it is the right denominator for a step that runs on those devices: on a CPU the virtual
devices share the cores and the measurement says how much the cores deliver together; on a TPU
slice it is the sum over the chips.

    read   GB/s = (bytes of x) / t(sum of x per shard)             (read once, no write)
    copy   GB/s = 2 * (bytes of x) / t(x + 1 per shard)            (read once, write once)
    matmul FLOP/s = 2 * n^3 * devices / t(one f32 [n, n] @ [n, n] per device)

Times are the best of `repeats` calls after a compile-and-warm call (a peak, not a mean: the
denominators of "achieved fraction"). `memory_gb_per_s` is the larger of read and copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["measure_roofline", "default_sizes"]

_AXIS = "roofline"


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
