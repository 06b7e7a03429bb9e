"""Sparse MLA attention for backends without the Pallas TPU kernels (the CPU path), with work
proportional to the selected pages this shard owns.

The reference (`reference.sparse_attention`) gathers all N selected pages of every query and
masks the ones the shard does not own. With S shards a shard owns about N / S of them, so on a
CPU running S virtual devices, S - 1 of every S page gathers are wasted (measured: prefill at
S = 16 ran 6x slower than at S = 1). Here the owned (query, page) pairs are compacted first:

    pairs  = nonzero(sel_slots >= 0)                        at most `capacity` of them
    (o_p, lse_p) = attention of pair p's query over its page (causal mask)
    lse_q  = logsumexp_{p of q} lse_p;   o_q = sum_{p of q} exp(lse_p - lse_q) o_p

`capacity` = min(all pairs, 2 * all pairs / S + queries), a static shape. A step where one shard
owns more pairs than that (every query selecting the same shard's pages) takes the exact
reference path instead, through `lax.cond`, so the result never depends on the capacity.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.kernels.reference import NEG_INF, check_attention_args, sparse_attention
from cp_runtime.kernels.storage import cdiv, from_storage

__all__ = ["sparse_attention_owned", "pair_capacity"]


def pair_capacity(num_queries: int, entries: int, num_shards: int) -> int:
    """Static bound on the (query, page) pairs one shard attends in a step."""
    total = num_queries * entries
    return min(total, 2 * cdiv(total, num_shards) + num_queries)


def _page_partials(q, kv_cache, slots, pages, pos, *, value_dim, scale, value_dtype):
    """One page per row. q f[C, H, D], slots/pages/pos i32[C] -> o f32[C, H, Dv], lse f32[C, H]."""
    ps = kv_cache.shape[1]
    kv = from_storage(kv_cache[jnp.maximum(slots, 0)], value_dtype).astype(q.dtype)  # [C,ps,D]
    key_pos = pages[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)                   # [C, ps]
    visible = (slots[:, None] >= 0) & (key_pos <= pos[:, None])
    kv = jnp.where(visible[..., None], kv, 0)
    s = jnp.einsum("chd,csd->chs", q, kv, preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible[:, None], s, NEG_INF)                                       # [C,H,ps]
    m = s.max(-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    denom = p.sum(-1)
    o = jnp.einsum("chs,csv->chv", p, kv[..., :value_dim].astype(jnp.float32))
    safe = jnp.where(denom > 0, denom, 1.0)
    return o / safe[..., None], jnp.where(denom > 0, jnp.log(safe) + m_safe, NEG_INF)


def _merge_pairs(o, lse, segment, num_segments):
    """Merge partials of pairs by query: o f32[C, H, Dv], lse f32[C, H], segment i32[C]."""
    m = jax.ops.segment_max(lse, segment, num_segments=num_segments)           # [Sg, H]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe[segment])                                         # [C, H]
    total = jax.ops.segment_sum(w, segment, num_segments=num_segments)
    acc = jax.ops.segment_sum(w[..., None] * o, segment, num_segments=num_segments)
    safe = jnp.where(total > 0, total, 1.0)
    return acc / safe[..., None], jnp.where(total > 0, jnp.log(safe) + m_safe, NEG_INF)


@functools.partial(jax.jit, static_argnames=("value_dim", "scale", "query_block", "cache_dtype",
                                             "num_shards"))
def sparse_attention_owned(q: jax.Array, kv_cache: jax.Array, sel_slots: jax.Array,
                           sel_pages: jax.Array, q_pos: jax.Array, *, value_dim: int,
                           scale: float, query_block: int = 64, cache_dtype=None,
                           num_shards: int = 1) -> tuple[jax.Array, jax.Array]:
    """Same contract as `reference.sparse_attention` (shapes there); `num_shards` only sizes
    the static pair capacity. Pairs are processed `query_block` at a time to bound memory."""
    check_attention_args(q, kv_cache, sel_slots, sel_pages, q_pos, value_dim)
    b, nq, h, d = q.shape
    n = sel_slots.shape[-1]
    total = b * nq * n
    value_dtype = kv_cache.dtype if cache_dtype is None else cache_dtype
    block = max(1, min(query_block, total))
    cap = cdiv(pair_capacity(b * nq, n, num_shards), block) * block
    owned = sel_slots.reshape(-1) >= 0

    def compact(_):
        idx = jnp.nonzero(owned, size=cap, fill_value=total)[0]                # [cap]
        valid = idx < total
        idx = jnp.minimum(idx, total - 1)
        query = idx // n                                                        # [cap]
        slots = jnp.where(valid, sel_slots.reshape(-1)[idx], -1)
        pages = sel_pages.reshape(-1)[idx]
        pos = q_pos.reshape(-1)[query]
        qq = q.reshape(b * nq, h, d)[query]                                     # [cap, H, D]

        def one_block(xs):
            qb, sb, pb, posb = xs
            return _page_partials(qb, kv_cache, sb, pb, posb, value_dim=value_dim, scale=scale,
                                  value_dtype=value_dtype)

        def blocks(x):  # [cap, ...] -> [cap / block, block, ...]
            return x.reshape(cap // block, block, *x.shape[1:])

        o, lse = lax.map(one_block, (blocks(qq), blocks(slots), blocks(pages), blocks(pos)))
        o, lse = o.reshape(cap, h, value_dim), lse.reshape(cap, h)
        segment = jnp.where(valid, query, b * nq)          # unused pairs: a spare segment
        o, lse = _merge_pairs(o, lse, segment, b * nq + 1)
        return o[: b * nq].reshape(b, nq, h, value_dim), lse[: b * nq].reshape(b, nq, h)

    def everything(_):
        return sparse_attention(q, kv_cache, sel_slots, sel_pages, q_pos, value_dim=value_dim,
                                scale=scale, query_block=query_block, cache_dtype=cache_dtype)

    if cap >= total:
        return compact(None)
    return lax.cond(owned.sum() <= cap, compact, everything, None)
