"""A shard's part of the DSA selection: the indexer's scores over the pages this shard owns,
its candidates, and the global top-K ranked over the cp axis (runtime field `selection`:
whole pages, or tokens).

`attend` is the step's `ShardAttention` (cp_runtime.model.attention): its kernels, page
geometry (tables, rotation, positions) and runtime fields.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from cp_runtime.model.indexer_inputs import IndexerInputs
from cp_runtime.model.scopes import phase
from cp_runtime.parallel.selection import (attended_pages, global_top_pages, local_candidates,
                                           token_entries)

__all__ = ["select", "select_tokens", "select_beside_gathers", "attended_entries"]


def select(attend, icache: jax.Array, index: IndexerInputs, tie=None):
    """The selection i32[B, Q, K] from the indexer's cache icache of this shard; with `tie`
    (arrays, kernels/indexer.py), (selection, tie) where tie waited on the indexer kernel."""
    if attend.token_selection:
        return select_tokens(attend, icache, index, tie)
    k = attend.model.index_topk // attend.page_size
    with phase("indexer"):
        scores = attend.kernels.indexer_page_scores(
            index.q, index.scoring_weights(), icache, attend.local_table, attend.pos,
            attend.shard, attend.rotation, num_shards=attend.num_shards,
            key_block_pages=attend.runtime.key_block_pages,
            cache_dtype=attend.pool.indexer_dtype, tie=tie, fp8=attend.fp8_scores)
    if tie is not None:
        scores, tie = scores
    with phase("selection"):
        cand_scores, cand_pages = local_candidates(
            scores, attend.pos, attend.shard, attend.rotation, num_shards=attend.num_shards,
            page_size=attend.page_size, k=k)
        selection = global_top_pages(cand_scores, cand_pages, k=k,
                                     axis_name=attend.axis_name,
                                     gathers=attend.strategy.gathers)
    return selection if tie is None else (selection, tie)


def select_tokens(attend, icache: jax.Array, index: IndexerInputs, tie=None):
    """`select` in token selection: each shard's best index_topk tokens, ranked over the
    shards as pages are (kernels/token_candidates.py says why that is exact). Where
    index_topk reaches every token of the rows' tables, every visible token is selected:
    each shard's list is all of its tokens, gathered without a rank (a list of index_topk
    would hold [Q, S * index_topk] candidates where the tables hold fewer tokens)."""
    local_tokens = attend.local_table.shape[1] * attend.page_size
    every = attend.model.index_topk >= local_tokens * attend.num_shards
    k = local_tokens if every else attend.model.index_topk
    with phase("indexer"):
        found = attend.kernels.indexer_token_candidates(
            index.q, index.scoring_weights(), icache, attend.local_table, attend.pos,
            attend.shard, attend.rotation, num_shards=attend.num_shards, k=k,
            key_block_pages=attend.runtime.key_block_pages,
            cache_dtype=attend.pool.indexer_dtype, tie=tie, fp8=attend.fp8_scores)
    if tie is not None:
        found, tie = found
    scores, tokens = found
    if attend.num_shards > 1:
        with phase("selection"):
            tokens = (lax.all_gather(tokens, attend.axis_name, axis=2, tiled=True) if every
                      else global_top_pages(scores, tokens, k=k, axis_name=attend.axis_name,
                                            gathers=attend.strategy.gathers))
    return tokens if tie is None else (tokens, tie)


def select_beside_gathers(attend, icache: jax.Array, index: IndexerInputs, state):
    """`select`, its indexer kernel beside the gathers of `state.tie_ahead` (state: the
    step's `ShardState`) -> (selection, state without them to tie)."""
    if not state.tie_ahead:
        return select(attend, icache, index), state
    ahead = dict(state.ahead)
    tied = {layer: ahead[layer] for layer in state.tie_ahead}
    selection, tied = select(attend, icache, index, tie=tied)
    ahead.update(tied)
    return selection, dataclasses.replace(state, ahead=tuple(ahead.items()), tie_ahead=())


def attended_entries(attend, selection: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """What each query attends: pages i32[B, Q, N] and, in token selection, the mask of
    their selected tokens i32[B, Q, N, W] (None: whole pages up to the query)."""
    if not attend.token_selection:
        return attended_pages(selection, attend.pos, attend.page_size), None
    with phase("selection"):
        return token_entries(selection, attend.page_size, attend.entries)
