"""Paged cache write: the Pallas TPU kernel of `reference.write_kv`, in place, by whole tiles.

Why tiles. On a TPU an HBM array `T[P + 1, ps, D]` is stored in (rows, 128)-lane tiles whose
height is 8 sublanes of 32-bit words: 8 rows for f32, 16 for bf16, 32 for fp8 (`tile_rows`), and
narrow dtypes interleave consecutive rows inside each word. One token's row is therefore not a
contiguous run of bytes, and Mosaic refuses a DMA that starts inside a tile. So the kernel never
moves a row: it moves the tiles the rows land in.

How. The rows are cast to the cache dtype once, at entry (`storage.saturating_cast`, the
reference's cast: out-of-range values clip to the dtype's largest finite value, never NaN), then
grouped in XLA by destination tile (`group_rows`): each distinct (slot, tile) gets one block
`T[tr, D]` holding its new rows at their offsets, plus a row mask. Per group the kernel DMAs the
cache tile into VMEM, takes the new rows where the mask is set, and DMAs the tile back; the cache
is aliased input -> output, so under a jit that donates it nothing else is read or written. A
tile fully covered by new rows (the inside of a prefill chunk) is not read first.

Rows aimed at the sentinel page are dropped: the sentinel only absorbs non-owners' writes, no
reader uses its contents, and so the kernel never spends a DMA on it (the reference does write it;
the two agree on every other page). (slot, offset) pairs must be distinct elsewhere.

Bound on tiles. A call holds at most `max_tiles` distinct tiles (static; default N, one per row):
a step's B rows of Q consecutive positions touch at most B * (ceil((Q - 1) / tr) + 1)
(`tiles_bound`), which keeps a prefill chunk's grouped rows near the size of the rows themselves.
A shard writing only the pages it owns of such rows touches about 1/S of that
(`owned_tiles_bound`), and the grouping then gathers only that many rows: a 16K-row
half chunk's own write on 16 shards groups 1,088 rows, not 16,416. A call that touches more tiles
than `max_tiles` loses the excess rows, so callers pass the bound of their row structure, never a
guess.

Grid:   (G = max_tiles,), arbitrary (groups past the call's count are skipped).
Blocks: group slot, tile and fill i32[G] scalar prefetch (SMEM); new rows T[tr, D] and row mask
        i32[tr, 1] VMEM per group; cache T[P + 1, ps, D] stays in HBM (pl.ANY).
VMEM:   tr = min(ps, tile_rows), c = cache itemsize
          tile      tr * D * c
          inputs    2 * (tr * D * c + tr * 4)          (pipeline double buffers)
          temps     tr * D * 4 * 3                     (f32 views of the blend)
SMEM:   3 * G * 4 bytes.
Per call (upper bound: every group a partial tile): bytes = G * tr * (3 * D * c + 4),
        flops = 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.packing import tile_rows
from cp_runtime.kernels.storage import cdiv, saturating_cast
from cp_runtime.kernels.vmem import tiled_bytes

__all__ = ["write_kv", "group_rows", "tiles_bound", "owned_tiles_bound", "write_tile_rows",
           "cost"]

_NO_TILE = np.iinfo(np.int32).max   # sorts after every real tile key


def write_tile_rows(cache_shape, cache_dtype) -> int:
    """Rows per tile the kernel moves: the dtype's HBM tile height, or the page when smaller."""
    return min(cache_shape[1], tile_rows(cache_dtype))


def tiles_bound(num_rows: int, queries_per_row: int, tile: int) -> int:
    """Distinct tiles that `num_rows` rows of `queries_per_row` consecutive positions can touch."""
    return num_rows * (cdiv(queries_per_row - 1, tile) + 1)


def owned_tiles_bound(num_rows: int, queries_per_row: int, page_size: int, num_shards: int,
                      tile: int) -> int:
    """Distinct tiles one shard's pages can take from `num_rows` rows of `queries_per_row`
    consecutive positions, when pages go round-robin over `num_shards` shards
    (cp_runtime.cache.layout): a row spans at most cdiv(Q - 1, ps) + 1 pages, a shard owns at
    most every S-th of them, and a page holds ps // tile tiles. Never above `tiles_bound`."""
    spanned = cdiv(queries_per_row - 1, page_size) + 1
    owned = num_rows * cdiv(spanned, num_shards) * (page_size // tile)
    return min(owned, tiles_bound(num_rows, queries_per_row, tile))


def group_rows(new: jax.Array, slots: jax.Array, offsets: jax.Array, *, sentinel: int,
               tile: int, tiles_per_page: int, max_tiles: int):
    """Group rows by destination tile (XLA, outside the kernel).

    new: T[N, D] (already in the cache dtype); slots, offsets: i32[N]
    returns: rows T[G, tile, D] (row r of group g goes to offset tile * t_g + r of slot s_g),
             mask i32[G, tile, 1] (1 where a new row lands), group slot i32[G], group tile
             index t_g i32[G], fill i32[G] (rows written per group), count i32[] (groups used)

    Only the first G * tile rows in tile order can land in the G groups kept, so only those
    are gathered: a shard's own write of a prefill chunk (`owned_tiles_bound`) moves its own
    rows, not the chunk's.
    """
    d = new.shape[1]
    live = slots != sentinel
    tile_of = offsets // tile
    key = jnp.where(live, slots * tiles_per_page + tile_of, _NO_TILE)
    order = jnp.argsort(key, stable=True)[:max_tiles * tile]
    skey = key[order]
    first = (skey != jnp.roll(skey, 1)).at[0].set(True) & (skey != _NO_TILE)
    group = jnp.cumsum(first.astype(jnp.int32)) - 1                  # group of each sorted row
    count = first.sum(dtype=jnp.int32)
    # Rows of dropped or overflowing groups aim at group G, past the end: the scatters drop
    # them, so nothing is built only to be sliced off.
    target = jnp.where((skey != _NO_TILE) & (group < max_tiles), group, max_tiles)
    within = offsets[order] % tile
    rows = jnp.zeros((max_tiles, tile, d), new.dtype).at[target, within].set(new[order],
                                                                            mode="drop")
    mask = jnp.zeros((max_tiles, tile, 1), jnp.int32).at[target, within].set(1, mode="drop")
    gslot = jnp.full((max_tiles,), sentinel, jnp.int32).at[target].set(slots[order], mode="drop")
    gtile = jnp.zeros((max_tiles,), jnp.int32).at[target].set(tile_of[order], mode="drop")
    fill = mask[:, :, 0].sum(axis=1, dtype=jnp.int32)
    return rows, mask, gslot, gtile, fill, jnp.minimum(count, max_tiles)


def _write_kernel(gslot_ref, gtile_ref, fill_ref, count_ref,   # [G], [G], [G], [1] SMEM
                  rows_ref,                                    # [tr, D] VMEM
                  mask_ref,                                    # [tr, 1] VMEM
                  cache_in,                                    # [P + 1, ps, D] HBM (aliased)
                  cache_out,                                   # [P + 1, ps, D] HBM
                  tile_ref,                                    # [tr, D] VMEM
                  sems):                                       # DMA[2]
    del cache_in  # same buffer as cache_out
    g = pl.program_id(0)
    tr = tile_ref.shape[0]

    @pl.when(g < count_ref[0])
    def _():
        start = pl.multiple_of(gtile_ref[g] * tr, tr)
        dst = cache_out.at[gslot_ref[g], pl.ds(start, tr)]

        @pl.when(fill_ref[g] == tr)
        def _():                                   # the whole tile is new: no read needed
            tile_ref[...] = rows_ref[...]

        @pl.when(fill_ref[g] < tr)
        def _():
            read = pltpu.make_async_copy(dst, tile_ref, sems.at[0])
            read.start()
            read.wait()
            old = tile_ref[...].astype(jnp.float32)
            new = rows_ref[...].astype(jnp.float32)
            tile_ref[...] = jnp.where(mask_ref[...] > 0, new, old).astype(tile_ref.dtype)

        write = pltpu.make_async_copy(tile_ref, dst, sems.at[1])
        write.start()
        write.wait()


@functools.partial(jax.jit, static_argnames=("max_tiles", "interpret"))
def write_kv(cache: jax.Array, new: jax.Array, slots: jax.Array, offsets: jax.Array, *,
             max_tiles: int | None = None, interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.write_kv`; same arguments and result except the sentinel page,
    which it leaves alone (module docstring).

    cache:     T[P + 1, ps, D]  one shard's cache of one layer (aliased to the result)
    new:       f[N, D]          rows to write, any float dtype (cast to T here)
    slots:     i32[N]           physical page of each row (the sentinel P for rows to discard)
    offsets:   i32[N]           offset of each row inside its page
    max_tiles: distinct tiles the rows may touch (default N; see `tiles_bound`)
    returns:   T[P + 1, ps, D]
    """
    if new.ndim != 2 or new.shape[-1] != cache.shape[-1]:
        raise ValueError(f"new rows {new.shape} do not match cache rows {cache.shape}")
    n, d = new.shape
    if n == 0:
        return cache
    tile = write_tile_rows(cache.shape, cache.dtype)
    groups = min(n, max_tiles or n)
    rows, mask, gslot, gtile, fill, count = group_rows(
        saturating_cast(new, cache.dtype), slots.astype(jnp.int32), offsets.astype(jnp.int32),
        sentinel=cache.shape[0] - 1, tile=tile, tiles_per_page=cache.shape[1] // tile,
        max_tiles=groups)
    shape = jax.ShapeDtypeStruct(cache.shape, cache.dtype)
    figures = cost(cache, new, max_tiles=groups)
    return pl.pallas_call(
        _write_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(groups,),
            in_specs=[pl.BlockSpec((None, tile, d), lambda g, *_: (g, 0, 0)),
                      pl.BlockSpec((None, tile, 1), lambda g, *_: (g, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((tile, d), cache.dtype),
                            pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=shape,
        # Operand 6 (after the four prefetched tables, the rows and the mask) is the cache.
        input_output_aliases={6: 0},
        **call_options("write_kv", figures, ("arbitrary",), interpret),
    )(gslot, gtile, fill, count.reshape(1), rows, mask, cache)


def cost(cache, new, slots=None, offsets=None, *, max_tiles: int | None = None) -> dict:
    """Grid, blocks, VMEM bytes, HBM bytes and flops of one call (kernel only, not the grouping).

    Takes the kernel's arguments or anything with `.shape`/`.dtype` (jax.ShapeDtypeStruct).
    """
    del slots, offsets
    n, d = new.shape
    c = np.dtype(cache.dtype).itemsize
    tile = write_tile_rows(cache.shape, cache.dtype)
    groups = max(1, min(n, max_tiles or n))
    return {
        "grid": (groups,),
        "blocks": {"tile": (tile, d)},
        "vmem_bytes": (tiled_bytes((tile, d), c)
                       + 2 * (tiled_bytes((tile, d), c) + tiled_bytes((tile, 1), 4))
                       + 3 * tiled_bytes((tile, d), 4)),
        # Read the new rows' tile and the cache tile, write the tile back.
        "bytes": groups * tile * (3 * d * c + 4) + 3 * groups * 4,
        "flops": 0,
    }
