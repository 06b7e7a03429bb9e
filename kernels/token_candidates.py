"""DSA indexer token candidates: one shard's best k tokens per query, for token-level selection.

    I(t, s) = sum_h w_h(t) * ReLU(q_h(t) . k(s))        for s <= t on this shard

Per tile of queries, each sequence's keys on the shard are scored `key_block_pages` pages at a
time (`xla_indexer.tile_token_scores`, the page scores' products before their page max) into one
row of scores per query, [B, qt, every key of the shard], which one `lax.top_k` ranks. Memory
is a tile's logits [B, qt * Hi, nb * ps] and its scores [B, qt, M * ps], never [Q, all keys].

The order is exact and total, score descending then position ascending: `lax.top_k` puts equal
scores lower index first, and a row's keys stand in position order (local pages ascend with
logical position). So the shards' lists rank to the same k tokens a single device would
(cp_runtime.parallel.selection.global_top_pages, which ranks positions as it ranks pages).
Zeros are made +0.0 first: -0.0 and 0.0 are one score.

Cost. Every key is scored once per query, as in page selection; what is added is one rank of a
row of M * ps scores per query. One rank of the whole row, not a running list of the k best
merged with each block (the first design): on a TPU v5e, at k = 2,048 over 128K keys, one
`lax.top_k` of 512 rows took 104 ms where the running merge over 512-key blocks took 2.77 s
(docs/notes/2026-12-08-whole-row-top-k.md).
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

    def sequence_scores(q_seq, w_seq, pos_seq, pages_seq, rot, i):
        """One sequence's query tile i: scores f32[qt, Mp * ps] and key positions i32[Mp * ps]
        (ascending; -1 past the table)."""
        logical = local * num_shards + shard - rot           # [Mp]
        key_pos = (logical * ps)[:, None] + jnp.arange(ps, dtype=jnp.int32)   # [Mp, ps]
        key_pos = jnp.where((local < m)[:, None], key_pos, -1)                 # not in table
        sl = functools.partial(lax.dynamic_slice_in_dim, start_index=i * qt, slice_size=qt)
        tq, tw, tpos = sl(q_seq), sl(w_seq), sl(pos_seq)

        def key_block(_, j):
            blk = lax.dynamic_slice_in_dim(pages_seq, j * nb, nb)
            keys = from_storage(k_cache[blk], value_dtype).astype(jnp.float32)
            kpos = lax.dynamic_slice_in_dim(key_pos, j * nb, nb)              # [nb, ps]
            return None, tile_token_scores(tq, tw, keys, kpos, tpos)         # [qt, nb * ps]

        _, blocks = lax.scan(key_block, None, jnp.arange(k_blocks))      # [kb, qt, nb * ps]
        return blocks.transpose(1, 0, 2).reshape(qt, -1), key_pos.reshape(-1)

    def query_tile(i):
        # Every sequence's rows ranked in one `lax.top_k`: on a TPU a rank of one short row
        # costs about what a rank of eight does (docs/notes/2026-12-08-whole-row-top-k.md).
        scores, key_pos = jax.vmap(sequence_scores, in_axes=(0, 0, 0, 0, 0, None))(
            qf, wf, pos, pages, rotation, i)                     # [B, qt, Mp * ps], [B, Mp * ps]
        return _rank(scores, key_pos, k)

    top, where = lax.map(query_tile, jnp.arange(q_tiles))       # [tiles, B, qt, k] x2
    top, where = (x.transpose(1, 0, 2, 3).reshape(b, -1, k)[:, :nq] for x in (top, where))
    return top, jnp.where(top > NEG_INF, where, NO_TOKEN)


def _rank(scores: jax.Array, key_pos: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k best of each row of scores f32[B, qt, n] whose keys stand at positions i32[B, n]
    (ascending), as (scores f32[B, qt, k], positions i32[B, qt, k]); rows of fewer than k keys
    are padded with NEG_INF at NO_TOKEN."""
    scores = jnp.where(scores == 0, 0.0, scores)
    n = scores.shape[-1]
    if n < k:
        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, k - n)), constant_values=NEG_INF)
        key_pos = jnp.pad(key_pos, ((0, 0), (0, k - n)), constant_values=NO_TOKEN)
    top, index = lax.top_k(scores, k)
    return top, jnp.take_along_axis(key_pos[:, None, :], index, axis=-1)
