"""Sparse MLA attention for backends without the Pallas TPU kernels (the CPU path): each block of
queries attends the union of the pages this shard owns among the block's selections, as one
matrix product.

The reference (`reference.sparse_attention`) gathers all N selected pages of every query and
masks the ones the shard does not own: with S shards, S - 1 of every S page gathers are wasted,
and its per-query products are tiny batched matmuls, slow on XLA:CPU. Here, per block of a few
query rows (rows of one sequence or of several):

    union  = the distinct owned slots the block's queries select   at most `capacity` of them
    keys   = the union's pages, gathered once                      [U * ps, D]
    scores = q_block [rows * H, D] x keys^T, masked to the pages each query selected (and its
             causal limit), plus log(multiplicity) for a page a query selected twice
    (o, lse) = the softmax partials of each query, as the reference defines them

With token masks (`sel_masks`, reference.py's module docstring) the multiplicity is per key:
the entries of the query naming the page whose mask has the key's bit, [rows, U, ps] counts
scattered from each entry's bits (never a [rows, N, U] match of entries against the union,
which at N = 2,048 entries, 8 rows and S = 16 (U = 2,050) is 33M elements a block). Entries with an
all-zero mask are dropped before the union (`live_slots`), so they neither fill the capacity
nor send a block to the fallback.

Neighbouring queries select mostly the same pages, so the union stays near N / S pages per query
at worst and shared by the block at best. `capacity` = min(all entries, 2 * entries / S + 2), a
static shape; a block whose union is larger (every query selecting the same shard's pages)
takes the reference for that block through `lax.cond`, so the result never depends on it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.kernels.reference import (NEG_INF, check_attention_args, live_slots,
                                         sparse_attention, token_bits)
from cp_runtime.kernels.storage import cdiv, from_storage

__all__ = ["sparse_attention_owned", "union_capacity", "MAX_BLOCK_ROWS"]

_NONE = jnp.iinfo(jnp.int32).max     # sorts after every slot

# Query rows per block. The union's static capacity, not its actual size, sets a block's work,
# so small blocks waste least: measured on a 2-core x86 CPU (1024 queries, 5 entries each,
# S = 16, page 64), 8 rows took 6.3 ms with random selections and 5.4 ms with neighbours
# sharing pages, against 12.7 and 11.2 ms at 64 rows and 8.3 and 5.5 ms for the per-pair
# formulation this replaced.
MAX_BLOCK_ROWS = 8


def union_capacity(block_rows: int, entries: int, num_shards: int) -> int:
    """Static bound on the distinct owned pages one block of `block_rows` queries attends."""
    total = block_rows * entries
    return min(total, 2 * cdiv(total, num_shards) + 2)


def _union(slots: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """slots i32[R, N] (-1 = not owned) -> (the distinct owned slots ascending, padded with
    _NONE: i32[capacity]; how many there are: i32[])."""
    flat = jnp.sort(jnp.where(slots >= 0, slots, _NONE).reshape(-1))
    first = (flat != jnp.concatenate([jnp.full((1,), -1, flat.dtype), flat[:-1]]))
    first &= flat != _NONE
    count = first.sum()
    # Each first occurrence goes to its rank among the distinct slots; ranks past the capacity
    # are dropped (the caller then takes the reference path).
    rank = jnp.where(first, jnp.cumsum(first) - 1, capacity)
    union = jnp.full((capacity,), _NONE, flat.dtype).at[rank].set(flat, mode="drop")
    return union, count


def _union_counts(slots, pages, union, bits):
    """How the block's queries name its union. slots/pages i32[R, N], union i32[U] (ascending,
    _NONE-padded), bits i32[R, N, K] (each entry's token bits, K = ps; or ones, K = 1, in page
    mode) -> times i32[R, U, K]: per query, union page and token, the entries naming the page
    with the token's bit; page i32[R, U]: the union page's logical page (-1 where the query
    names it nowhere)."""
    r, u = slots.shape[0], union.shape[0]
    at = jnp.minimum(jnp.searchsorted(union, slots), u - 1)                 # [R, N]
    at = jnp.where((slots >= 0) & (union[at] == slots), at, u)              # u: not in union
    row = jnp.arange(r)[:, None]
    times = jnp.zeros((r, u, bits.shape[-1]), jnp.int32).at[row, at].add(bits, mode="drop")
    page = jnp.full((r, u), -1, jnp.int32).at[row, at].max(pages, mode="drop")
    return times, page


def _block_attention(q, kv_cache, slots, pages, pos, union, masks, *, value_dim, scale,
                     value_dtype):
    """One block over its union. q f[R, H, D], slots/pages i32[R, N], pos i32[R],
    union i32[U], masks i32[R, N, W] or None -> o f32[R, H, Dv], lse f32[R, H] (reference
    conventions)."""
    r, h, d = q.shape
    ps = kv_cache.shape[1]
    bits = (jnp.ones((*slots.shape, 1), jnp.int32) if masks is None
            else token_bits(masks, ps).astype(jnp.int32))                   # [R, N, K]
    times, page = _union_counts(slots, pages.astype(jnp.int32), union, bits)  # [R, U, K], [R, U]
    key_pos = page[..., None] * ps + jnp.arange(ps, dtype=jnp.int32)        # [R, U, ps]
    visible = (times > 0) & (key_pos <= pos[:, None, None])                 # [R, U, ps]
    # Zero what no query of the block may see: unused union entries and rows past every
    # query's limit may hold garbage (the sentinel page, unwritten rows).
    seen = visible.any(axis=0)                                              # [U, ps]
    kv = from_storage(kv_cache[jnp.minimum(union, kv_cache.shape[0] - 1)], value_dtype)
    kv = jnp.where(seen[..., None], kv.astype(q.dtype), 0).reshape(-1, d)   # [U * ps, D]
    s = lax.dot_general(q.reshape(r * h, d), kv, (((1,), (1,)), ((), ())),
                        preferred_element_type=jnp.float32).reshape(r, h, -1) * scale
    bonus = jnp.log(jnp.maximum(times, 1).astype(jnp.float32))              # key reached twice
    s = s + jnp.broadcast_to(bonus, visible.shape).reshape(r, 1, -1)
    s = jnp.where(visible.reshape(r, 1, -1), s, NEG_INF)                    # [R, H, U * ps]
    m = s.max(-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    denom = p.sum(-1)
    v = kv[:, :value_dim].astype(jnp.float32)
    o = lax.dot_general(p.reshape(r * h, -1), v, (((1,), (0,)), ((), ()))).reshape(r, h, -1)
    safe = jnp.where(denom > 0, denom, 1.0)
    return o / safe[..., None], jnp.where(denom > 0, jnp.log(safe) + m_safe, NEG_INF)


@functools.partial(jax.jit, static_argnames=("value_dim", "scale", "query_block", "cache_dtype",
                                             "num_shards"))
def sparse_attention_owned(q: jax.Array, kv_cache: jax.Array, sel_slots: jax.Array,
                           sel_pages: jax.Array, q_pos: jax.Array, *, value_dim: int,
                           scale: float, query_block: int = 64, cache_dtype=None,
                           num_shards: int = 1, sel_masks: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array]:
    """Same contract as `reference.sparse_attention` (shapes there, `sel_masks` i32[B, Q, N, W]
    included), given that a slot holds one page: every entry of a query that names a slot
    names the same logical page (a pool page holds one page of a sequence; forks share it at
    the same place). `num_shards` only sizes the static union capacity. The B x Q query rows go
    min(`query_block`, MAX_BLOCK_ROWS) at a time."""
    check_attention_args(q, kv_cache, sel_slots, sel_pages, q_pos, value_dim, sel_masks)
    sel_slots = live_slots(sel_slots, sel_masks)
    b, nq, h, d = q.shape
    n = sel_slots.shape[-1]
    rows = b * nq
    rb = max(1, min(query_block, MAX_BLOCK_ROWS, rows))
    num_blocks = cdiv(rows, rb)
    capacity = union_capacity(rb, n, num_shards)
    value_dtype = kv_cache.dtype if cache_dtype is None else cache_dtype

    def blocks(x, fill):  # [B, Q, ...] -> [blocks, rb, ...]
        x = x.reshape(rows, *x.shape[2:])
        x = jnp.pad(x, [(0, num_blocks * rb - rows)] + [(0, 0)] * (x.ndim - 1),
                    constant_values=fill)
        return x.reshape(num_blocks, rb, *x.shape[1:])

    def one_block(xs):
        qq, slots, pages, pos, *masks = xs
        masks = masks[0] if masks else None
        union, count = _union(slots, capacity)

        def over_union(_):
            return _block_attention(qq, kv_cache, slots, pages, pos, union, masks,
                                    value_dim=value_dim, scale=scale, value_dtype=value_dtype)

        def reference(_):
            o, lse = sparse_attention(qq[None], kv_cache, slots[None], pages[None], pos[None],
                                      value_dim=value_dim, scale=scale, query_block=rb,
                                      cache_dtype=cache_dtype,
                                      sel_masks=None if masks is None else masks[None])
            return o[0], lse[0]

        if capacity >= rb * n:
            return over_union(None)
        return lax.cond(count <= capacity, over_union, reference, None)

    xs = (blocks(q, 0), blocks(sel_slots, -1), blocks(sel_pages, 0), blocks(q_pos, -1))
    if sel_masks is not None:
        xs += (blocks(sel_masks, 0),)
    o, lse = lax.map(one_block, xs)
    o = o.reshape(num_blocks * rb, h, value_dim)[:rows].reshape(b, nq, h, value_dim)
    return o, lse.reshape(num_blocks * rb, h)[:rows].reshape(b, nq, h)
