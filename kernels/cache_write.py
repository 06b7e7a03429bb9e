"""Paged cache write: the Pallas TPU kernel of `reference.write_kv`, in place.

The rows are cast to the cache dtype once, at entry (`storage.saturating_cast`, the reference's
cast: out-of-range values clip to the dtype's largest finite value, never NaN; the result is
bit-exact), then each row is DMA'd HBM -> HBM straight into `cache[slot, offset]`; the
cache is aliased input -> output, so under a jit that donates it nothing else is copied. Up to
ROWS_PER_STEP row DMAs are in flight at once. Rows go to the pool layout `[P + 1, ps, D]`, not the
packed view: a row write moves one row's bytes either way, and the packed view matters for reading
whole pages into vregs. On a TPU a 1-byte row is a quarter of each packed 32-bit row; whether
Mosaic accepts such a sub-word row DMA has not been checked on hardware yet. Rows aimed at the
sentinel page land there, as in the reference; (slot, offset) pairs must be distinct elsewhere,
since concurrent DMAs to one row have no order.

Grid:   (ceil(N / ROWS_PER_STEP),), arbitrary.
Blocks: slots, offsets i32[N] scalar prefetch (SMEM); new T[N, D] and cache T[P + 1, ps, D] stay
        in HBM (pl.ANY).
VMEM:   none (DMA semaphores only). SMEM: 2 * N * 4 bytes.
Per call: bytes = N * D * (2 * c) + 2 * N * 4 (read each row, write it), flops = 0 (the cast of
        `new` is an XLA op before the kernel: N * D * (f + c) bytes more, f = its input itemsize).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels.storage import cdiv, saturating_cast
from cp_runtime.kernels.packing import interpret_params
from cp_runtime.kernels.vmem import vmem_limit_bytes

__all__ = ["ROWS_PER_STEP", "write_kv", "cost"]

# Row DMAs in flight per grid step: a decode batch's rows go out together instead of one DMA
# round trip each. A guess, not yet tuned on a TPU.
ROWS_PER_STEP = 8


def _write_kernel(slots_ref, offsets_ref,  # [N], [N] SMEM (scalar prefetch)
                  new_hbm,                 # [N, D] HBM
                  cache_in,                # [P + 1, ps, D] HBM, aliased to cache_out
                  cache_out,               # [P + 1, ps, D] HBM
                  sems,                    # DMA[ROWS_PER_STEP]
                  *, num_rows: int):
    del cache_in  # same buffer as cache_out
    rows = range(sems.shape[0])
    first = pl.program_id(0) * len(rows)

    def copy(r):
        row = first + r
        return pltpu.make_async_copy(new_hbm.at[pl.ds(row, 1)],
                                     cache_out.at[slots_ref[row], pl.ds(offsets_ref[row], 1)],
                                     sems.at[r])

    for r in rows:
        pl.when(first + r < num_rows)(lambda r=r: copy(r).start())
    for r in rows:
        pl.when(first + r < num_rows)(lambda r=r: copy(r).wait())


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(cache: jax.Array, new: jax.Array, slots: jax.Array, offsets: jax.Array, *,
             interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.write_kv`; same arguments and result.

    cache:   T[P + 1, ps, D]  one shard's cache of one layer (aliased to the result)
    new:     f[N, D]          rows to write, any float dtype (cast to T here)
    slots:   i32[N]           physical page of each row (the sentinel P for rows to discard)
    offsets: i32[N]           offset of each row inside its page
    returns: T[P + 1, ps, D]
    """
    if new.ndim != 2 or new.shape[-1] != cache.shape[-1]:
        raise ValueError(f"new rows {new.shape} do not match cache rows {cache.shape}")
    n = new.shape[0]
    if n == 0:
        return cache
    rows = min(ROWS_PER_STEP, n)
    kernel = functools.partial(_write_kernel, num_rows=n)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(cdiv(n, rows),),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA((rows,))],
        ),
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        # Operand 3 (after the two prefetched tables and `new`) is the cache.
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=vmem_limit_bytes(cost(cache, new)["vmem_bytes"])),
        interpret=interpret_params(interpret),
        name="write_kv",
    )(slots.astype(jnp.int32), offsets.astype(jnp.int32), saturating_cast(new, cache.dtype),
      cache)


def cost(cache, new, slots=None, offsets=None) -> dict:
    """Grid, blocks, VMEM bytes, HBM bytes and flops of one call (kernel only, not the cast).

    Takes the kernel's arguments or anything with `.shape`/`.dtype` (jax.ShapeDtypeStruct).
    """
    del slots, offsets
    n, d = new.shape
    c = np.dtype(cache.dtype).itemsize
    rows = max(1, min(ROWS_PER_STEP, n))
    return {
        "grid": (cdiv(n, rows),),
        "blocks": {"row": (1, d)},
        "vmem_bytes": 0,
        "bytes": n * d * 2 * c + 2 * n * 4,
        "flops": 0,
    }
