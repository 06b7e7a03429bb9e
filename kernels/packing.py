"""TPU page layout and page movement shared by the Pallas kernels.

Page layout. A pool buffer is `T[P + 1, ps, D]` in its value dtype on a TPU (fp8, bf16 or f32;
cp_runtime.kernels.storage chooses the storage form per backend). XLA:TPU stores it in tiles of
8 sublanes of 32-bit words by 128 lanes: a tile holds 8 rows of f32, 16 of bf16 or 32 of fp8
(`tile_rows`), the narrow rows packed `pk = 4 / itemsize` to a word (`packing`). The kernels DMA
whole pages `cache.at[slot]` (`[ps, D]`) into VMEM buffers of the same shape and dtype, so a page
arrives already in the packed order a vreg load wants, and nothing reshapes the pool: on a TPU a
reshape that moves the tiled dimension (such as a view `[P + 1, ps // pk, pk, D]`) is a copy of
the whole buffer, once per layer per step. The cache write moves whole tiles for the same reason
(kernels/cache_write.py).

`page_size % 16 == 0`: a bf16 tile is 16 rows, so a page is a whole number of bf16 tiles; an
fp8 page of 16 rows is half a tile (XLA pads it), which `cp-runtime compile` reports in the
pool's argument bytes.

Page ring. `page_ring` drives a loop over a dynamic number of items (pages, or blocks of pages)
whose data reach VMEM through `num_buffers` scratch buffers: while item j is computed, the DMAs of
items j + 1 .. j + num_buffers - 1 are in flight.

Interpret mode on a multi-device CPU mesh. XLA:CPU runs each device of a multi-device program on
a thread of one client pool of `max(nproc, CPU devices)` threads (nproc: $PJRT_NPROC, else $NPROC,
else the schedulable cores) and runs host -> device copies over 100 KiB on that same pool. TPU
interpret mode keeps every device inside a kernel until all have reached a `threading.Barrier`,
and each of its host callbacks first copies its operands (whole kernel inputs, for buffer
allocation) onto a CPU device. When the mesh takes every pool thread (S = 16 on 16 CPU devices
with nproc <= 16), a device blocked on a large copy waits for a pool thread that never frees: a
deadlock with the process idle (jax 0.10.2, 2 cores: S = 2 on 2 devices and S = 16 on 16 devices
both hang once an operand passes 100 KiB; PJRT_NPROC = S + 1 runs them). One spare thread is
not always enough (XLA:CPU may also run a device's independent ops on the pool beside its
kernels): a 16-shard prefill in interpret mode (tests/kernels/test_kernel_path.py) aborted, devices
waiting in a kernel's barrier, in 3 of 4 runs under a second process's load with S + 1 threads,
and in none of 6 with 2 S + 1. So the pool takes `interpret_pool_threads(S)` = 2 S + 1
threads, and `interpret_params` refuses a smaller one instead of risking the hang; the pool is
sized before JAX creates its CPU client (tests/conftest.py, cp_runtime.parallel.devices,
cluster/worker.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = [
    "PAGE_ALIGN",
    "packing",
    "check_page_size",
    "tile_rows",
    "interpret_params",
    "interpret_pool_threads",
    "cpu_client_threads",
    "page_ring",
]

# Rows per bf16 (16, 128) tile; every page size must be a multiple of it.
PAGE_ALIGN = 16


def packing(dtype) -> int:
    """Rows per 32-bit word: 4 for 1-byte dtypes, 2 for 2-byte, 1 for 4-byte."""
    itemsize = np.dtype(dtype).itemsize
    if itemsize not in (1, 2, 4):
        raise ValueError(f"cache dtype {np.dtype(dtype)} ({itemsize=}) has no TPU packing")
    return 4 // itemsize


def check_page_size(page_size: int) -> None:
    if page_size % PAGE_ALIGN:
        raise ValueError(f"{page_size=} must be a multiple of {PAGE_ALIGN}")


def tile_rows(dtype) -> int:
    """Rows of `dtype` in one HBM tile on a TPU: 8 sublanes x `packing(dtype)`."""
    return 8 * packing(dtype)


def interpret_pool_threads(devices: int) -> int:
    """Threads XLA's CPU client pool needs for interpret-mode kernels on `devices` devices at
    once: one each, and as many again for what XLA runs beside them (module docstring)."""
    return 2 * devices + 1


def cpu_client_threads() -> int:
    """Threads of XLA's CPU client pool, as it sizes them (module docstring); read at trace time,
    so it assumes the environment has not changed since the client was created."""
    for name in ("PJRT_NPROC", "NPROC"):
        value = os.environ.get(name, "")
        if value.isdigit():
            nproc = int(value)
            break
    else:
        affinity = getattr(os, "sched_getaffinity", None)     # Linux; XLA counts the same cores
        nproc = len(affinity(0)) if affinity else os.cpu_count()
    return max(nproc or 1, len(jax.devices("cpu")))


def interpret_params(interpret: bool):
    """The `interpret=` argument of `pl.pallas_call`: TPU interpret mode (runs on CPU) or off.

    Called while tracing the kernel; inside a `shard_map` over S CPU devices it raises
    RuntimeError unless XLA's CPU client pool has `interpret_pool_threads(S)` threads (module
    docstring).
    """
    if not interpret:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1 and jax.default_backend() == "cpu":
        threads, needed = cpu_client_threads(), interpret_pool_threads(mesh.size)
        if threads < needed:
            raise RuntimeError(
                f"TPU interpret mode on {mesh.size} CPU devices at once can deadlock: XLA's CPU "
                f"client has {threads} threads and needs {needed}; set PJRT_NPROC={needed} (or "
                f"more) before JAX creates its CPU client")
    return pltpu.InterpretParams()


def page_ring(count: jax.Array, num_buffers: int,
              copies: Callable[[jax.Array, jax.Array], Sequence],
              step: Callable[[jax.Array, jax.Array], None]) -> None:
    """Run `step(j, buffer)` for j in [0, count), each after its DMAs `copies(j, buffer)` landed.

    count:       i32[]  number of items (dynamic; 0 runs nothing)
    copies:      (item, buffer) -> async copy descriptors that bring the item into that buffer
    step:        (item, buffer) -> None; computes on the buffer
    num_buffers: ring depth (>= 2); item j uses buffer j % num_buffers

    Item j + num_buffers - 1 goes into the buffer item j - 1 used, which `step` is done with
    because steps run in order.
    """
    assert num_buffers >= 2, num_buffers

    def start(item):
        for copy in copies(item, item % num_buffers):
            copy.start()

    for k in range(num_buffers - 1):
        pl.when(k < count)(lambda k=k: start(k))

    def body(j, carry):
        ahead = j + num_buffers - 1
        pl.when(ahead < count)(lambda: start(ahead))
        buffer = j % num_buffers
        for copy in copies(j, buffer):
            copy.wait()
        step(j, buffer)
        return carry

    lax.fori_loop(0, count, body, jnp.int32(0))
