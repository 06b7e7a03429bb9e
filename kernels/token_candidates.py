"""DSA indexer token candidates: one shard's best k tokens per query, for token-level selection.

    I(t, s) = sum_h w_h(t) * ReLU(q_h(t) . k(s))        for s <= t on this shard

Per sequence and tile of queries, the shard's keys are scored `key_block_pages` pages at a time
(`xla_indexer.tile_token_scores`, the page scores' products before their page max), and each
block's scores join a running list of the k best so far, ranked again (`lax.top_k`). Memory is
one tile's logits [qt * Hi, nb * ps] and lists [qt, k + nb * ps], never [Q, all keys].

The order is exact and total, score descending then position ascending: `lax.top_k` puts equal
scores lower index first, the running list stands before the block, every position in the list
precedes every position of the block (local pages ascend with logical position), and by
induction the list's ties already stand in position order. So the shards' lists rank to the
same k tokens a single device would (cp_runtime.parallel.selection.global_top_pages, which
ranks positions as it ranks pages). Zeros are made +0.0 first: -0.0 and 0.0 are one score.

Cost. Every key is scored once per query, as in page selection; what is added is the rank of
k + nb * ps candidates per block and query, which XLA lowers to a sort (on a TPU, priced at
nothing by its cost model). This is the XLA path on every backend: a TPU kernel that keeps the
scores in VMEM and selects in place (as the page scores' kernel does) is not built yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.kernels.reference import NEG_INF
from cp_runtime.kernels.storage import cdiv, from_storage
from cp_runtime.kernels.xla_indexer import QUERY_ROWS, tile_token_scores

__all__ = ["NO_TOKEN", "indexer_token_candidates"]

NO_TOKEN = -1


@functools.partial(jax.jit, static_argnames=("num_shards", "k", "key_block_pages",
                                             "cache_dtype"))
def indexer_token_candidates(q: jax.Array, w: jax.Array, k_cache: jax.Array,
                             local_pages: jax.Array, q_pos: jax.Array, shard: jax.Array,
                             rotation: jax.Array | None = None, *, num_shards: int, k: int,
                             key_block_pages: int, cache_dtype=None
                             ) -> tuple[jax.Array, jax.Array]:
    """This shard's k best tokens for each query, ranked (score desc, position asc).

    q, w, k_cache, local_pages, q_pos, shard, rotation: as `reference.indexer_page_scores`
    returns: scores f32[B, Q, k] (-inf where fewer than k tokens are visible) and logical
             token positions i32[B, Q, k] (NO_TOKEN there)
    """
    b, m = local_pages.shape
    nq, hi, _ = q.shape[1:]
    ps = k_cache.shape[1]
    value_dtype = k_cache.dtype if cache_dtype is None else cache_dtype
    nb = min(key_block_pages, m)
    k_blocks = cdiv(m, nb)
    qt = max(1, min(nq, QUERY_ROWS // hi))
    qt = cdiv(nq, cdiv(nq, qt))                  # even tiles: the last pads little
    q_tiles = cdiv(nq, qt)
    rotation = jnp.zeros((b,), jnp.int32) if rotation is None else rotation.astype(jnp.int32)
    # Padded queries see nothing (position -1); padded pages are the sentinel, masked by
    # `in_table` (their positions may fall before a query's).
    qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, q_tiles * qt - nq), (0, 0), (0, 0)))
    wf = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, q_tiles * qt - nq), (0, 0)))
    pos = jnp.pad(q_pos, ((0, 0), (0, q_tiles * qt - nq)), constant_values=-1)
    pages = jnp.pad(local_pages, ((0, 0), (0, k_blocks * nb - m)),
                    constant_values=k_cache.shape[0] - 1)
    local = jnp.arange(k_blocks * nb, dtype=jnp.int32)

    def sequence(xs):
        q_seq, w_seq, pos_seq, pages_seq, rot = xs          # [Qp, Hi, Di] ... [Mp], []
        logical = local * num_shards + shard - rot           # [Mp]
        key_pos = (logical * ps)[:, None] + jnp.arange(ps, dtype=jnp.int32)   # [Mp, ps]
        key_pos = jnp.where((local < m)[:, None], key_pos, -1)                 # not in table

        def query_tile(i):
            sl = functools.partial(lax.dynamic_slice_in_dim, start_index=i * qt, slice_size=qt)
            tq, tw, tpos = sl(q_seq), sl(w_seq), sl(pos_seq)

            def key_block(best, j):
                blk = lax.dynamic_slice_in_dim(pages_seq, j * nb, nb)
                keys = from_storage(k_cache[blk], value_dtype).astype(jnp.float32)
                kpos = lax.dynamic_slice_in_dim(key_pos, j * nb, nb)          # [nb, ps]
                scores = tile_token_scores(tq, tw, keys, kpos, tpos)           # [qt, nb * ps]
                return _merge(best, scores, kpos.reshape(1, -1), k), None

            start = (jnp.full((qt, k), NEG_INF, jnp.float32),
                     jnp.full((qt, k), NO_TOKEN, jnp.int32))
            best, _ = lax.scan(key_block, start, jnp.arange(k_blocks))
            return best

        top, where = lax.map(query_tile, jnp.arange(q_tiles))     # [tiles, qt, k] x2
        return top.reshape(-1, k), where.reshape(-1, k)

    top, where = lax.map(sequence, (qf, wf, pos, pages, rotation))  # [B, Qp, k] x2
    top, where = top[:, :nq], where[:, :nq]
    return top, jnp.where(top > NEG_INF, where, NO_TOKEN)


def _merge(best: tuple[jax.Array, jax.Array], scores: jax.Array, key_pos: jax.Array, k: int
           ) -> tuple[jax.Array, jax.Array]:
    """The k best of a ranked list (f32/i32[qt, k]) and a block's scores f32[qt, n] at
    positions i32[1, n] after every position of the list (module docstring: why the order
    stays exact)."""
    best_scores, best_pos = best
    scores = jnp.where(scores == 0, 0.0, scores)
    joined = jnp.concatenate([best_scores, scores], axis=-1)
    where = jnp.concatenate([best_pos, jnp.broadcast_to(key_pos, scores.shape)], axis=-1)
    top, index = lax.top_k(joined, k)
    return top, jnp.take_along_axis(where, index, axis=-1)
