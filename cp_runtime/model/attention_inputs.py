"""What a layer's attention takes from the rows: the cached row and q of MLA, the indexer's
key, head weights and query heads, and the head-split weights a device gathers whole to make
every head of its own rows.

Weights are in the model layout, whole or split over a mesh axis (cp_runtime.weights.sharding):
the down projections (q_a, kv_a, the indexer's wk and weights_proj) are whole on every device,
so their outputs need no gather (`projected_features`); q's heads and the indexer's stay this
device's, and the attention gathers them where it needs them (cp_runtime.model.attention), or,
where each device attends every head of its own rows (`WeightShards.whole_heads`), the
head-split weights come whole to the device (`attention_weights`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cp_runtime.config import ModelConfig
from cp_runtime.model.indexer_inputs import (INDEXER_Q_WEIGHT, IndexerInputs, indexer_keys,
                                      indexer_queries, indexer_weights)
from cp_runtime.model.mla import KV_B, O_PROJ, query_rows
from cp_runtime.model.ops import linear, pad_last, rms_norm, rope, rope_frequencies, rope_mscale
from cp_runtime.model.scopes import phase
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.params import Params
from cp_runtime.weights.sharding import split_of
from cp_runtime.weights.shards import WeightShards

__all__ = ["projected_features", "row_features", "mla_inputs", "indexer_inputs",
           "own_rows_attention_inputs", "QUERY_SPLIT_WEIGHTS", "OUTPUT_SPLIT_WEIGHT",
           "HEAD_SPLIT_WEIGHTS", "attention_weights", "query_weights", "gathered_query_weights",
           "output_weights"]

# The attention's weights split by head (cp_runtime.weights.sharding), which a device that
# attends every head of its own rows (`WeightShards.whole_heads`) gathers whole: those that
# make its q (and take it into the latent space), and the one that takes its heads to hidden
# space. A layer with its own indexer gathers the indexer's query weight (INDEXER_Q_WEIGHT)
# with q_b and kv_b, so a device makes every indexer head of its own rows too.
QUERY_SPLIT_WEIGHTS = ("self_attn.q_b_proj.weight", KV_B)
OUTPUT_SPLIT_WEIGHT = O_PROJ
HEAD_SPLIT_WEIGHTS = (*QUERY_SPLIT_WEIGHTS, OUTPUT_SPLIT_WEIGHT)


def projected_features(p: Params, cfg: ModelConfig, h: jax.Array, *, indexer: bool
                       ) -> dict[str, jax.Array]:
    """The down projections of h[..., hidden], whole on every device (cp_runtime.weights.sharding:
    no gather): q_a [..., q_lora], kv_a [..., kv_lora + rope] and, for a layer with its own
    indexer, the indexer's key [..., Di] and head weights [..., Hi]."""
    names = {"q_a": "self_attn.q_a_proj.weight", "kv_a": "self_attn.kv_a_proj_with_mqa.weight"}
    if indexer:
        names |= {"index_k": "self_attn.indexer.wk.weight",
                  "index_w": "self_attn.indexer.weights_proj.weight"}
    return {part: linear(p, name, h) for part, name in names.items()}


def row_features(p: Params, cfg: ModelConfig, h: jax.Array, pos: jax.Array, *,
                 indexer: bool) -> dict[str, jax.Array]:
    """What each token's row gives the attention by itself, from the weights every device
    holds whole (`projected_features`, then per-row norms and rope): h[..., hidden], pos
    i32[...] -> q_lora f[..., R], kv_row f[..., D_lat] (the cached row) and, for a layer with
    its own indexer, index_k f[..., Di] (its cached key) and index_w f[..., Hi] (its head
    weights, scaled). Nothing here mixes rows, so a device can compute its own rows' and
    gather them (`WeightShards.gather_rows`)."""
    features = projected_features(p, cfg, h, indexer=indexer)
    # MLA's inner norms take their own eps (1e-6 in DeepSeek's and transformers' code), not
    # rms_norm_eps (cp_runtime.config.ModelConfig.mla_norm_eps).
    q_lora = rms_norm(features["q_a"], p["self_attn.q_a_layernorm.weight"], cfg.mla_norm_eps)
    freqs, mscale = rope_frequencies(cfg), rope_mscale(cfg)
    a = features["kv_a"]                                                   # [..., kv_lora+rope]
    c = rms_norm(a[..., : cfg.kv_lora_rank], p["self_attn.kv_a_layernorm.weight"],
                 cfg.mla_norm_eps)
    k_pe = rope(a[..., cfg.kv_lora_rank:], pos, freqs, interleaved=cfg.mla_rope_interleaved,
                mscale=mscale)
    kv_row = jnp.concatenate([pad_last(c, cfg.latent_nope_pad),
                              pad_last(k_pe, cfg.latent_rope_pad)], -1)
    out = {"q_lora": q_lora, "kv_row": kv_row}
    if indexer:
        out["index_k"] = indexer_keys(p, cfg, features["index_k"], pos)
        out["index_w"] = indexer_weights(cfg, features["index_w"])
    return out


def mla_inputs(p: Params, cfg: ModelConfig, h: jax.Array | None, pos: jax.Array,
               rows: dict[str, jax.Array] | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h[..., hidden], pos i32[...] -> (q f[..., H', D_lat], kv_row f[..., D_lat],
    q_lora f[..., R]).

    q holds the heads whose weights this device holds: all H, or its H' = ceil(H / S) with
    split weights (the attention gathers them where it needs every head). `rows`: h's
    `row_features`, when the caller has them already (h is then not read)."""
    if rows is None:
        rows = row_features(p, cfg, h, pos, indexer=False)
    q = linear(p, "self_attn.q_b_proj.weight", rows["q_lora"])
    q = q.reshape(*q.shape[:-1], -1, cfg.qk_head_dim)            # [..., H (local), nope+rope]
    return query_rows(p, cfg, q, pos), rows["kv_row"], rows["q_lora"]


def indexer_inputs(p: Params, cfg: ModelConfig, h: jax.Array | None, q_lora: jax.Array,
                   pos: jax.Array, ws: WeightShards = WeightShards(),
                   rows: dict[str, jax.Array] | None = None) -> IndexerInputs:
    """The DSA indexer's query heads, head weights and key for each token. Every device scores
    its own pages with every head; with split weights q holds this device's heads only, and
    the attention gathers them (`IndexerInputs.gathered`). `rows`: h's `row_features` with
    the indexer's, when the caller has them already (h is then not read)."""
    if rows is None:
        rows = row_features(p, cfg, h, pos, indexer=True)
    return IndexerInputs(q=indexer_queries(p, cfg, q_lora, pos), w=rows["index_w"],
                         k=rows["index_k"], heads=cfg.index_n_heads if ws.split else None)


def own_rows_attention_inputs(p: Params, cfg: ModelConfig, rows: dict[str, jax.Array],
                              pos: jax.Array, ws: WeightShards, own_indexer: bool):
    """A layer's attention inputs where each device attends every head of its own rows from
    the head-split weights gathered whole (p, `attention_weights`): rows, its rows'
    `row_features` f[R / S, ...] -> (q f[R / S, H, D_lat] of its rows, kv_row f[B, Q, D_lat]
    of every row, the indexer's inputs or None). Every row's cached row (and, for the
    indexer, key and weights) is still gathered: the cache and the selection need them. The
    indexer's q heads are made for the device's own rows too, every head, and gathered by
    row (`IndexerInputs.rows`), so q_lora never leaves its device."""
    with phase("attention_inputs"):
        own_pos = ws.own_rows(pos)
        q_row, _, q_lora = mla_inputs(p, cfg, None, own_pos, rows)
        every = ws.gather_rows_of({k: v for k, v in rows.items() if k != "q_lora"}, pos.shape)
        index = None
        if own_indexer:
            index = IndexerInputs(q=indexer_queries(p, cfg, q_lora, own_pos),
                                  w=every["index_w"], k=every["index_k"], rows=pos.shape)
    return q_row, every["kv_row"], index


def attention_weights(p: Params, cfg: ModelConfig, layer: int, ws: WeightShards) -> Params:
    """Layer `layer`'s weights p as its attention takes them: where each device attends every
    head of its own rows (`WeightShards.whole_heads`), the head-split ones gathered whole
    (`query_weights`, `output_weights`)."""
    return output_weights(query_weights(p, cfg, layer, ws), cfg, ws)


def query_weights(p: Params, cfg: ModelConfig, layer: int, ws: WeightShards) -> Params:
    """p with the head-split weights that make q gathered whole where each device attends
    every head of its own rows: q_b, kv_b and, in a layer with its own indexer, wq_b
    (`own_rows_attention_inputs`); with their scales."""
    if not ws.whole_heads:
        return p
    with phase("q_gather"):
        return ws.gather_weights(p, _split_axes(p, cfg, gathered_query_weights(cfg, layer)),
                                 SCALE_SUFFIX)


def gathered_query_weights(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The weights `query_weights` gathers in layer `layer` (their scales beside)."""
    own_indexer = cfg.indexer_types[layer] == "full"
    return QUERY_SPLIT_WEIGHTS + ((INDEXER_Q_WEIGHT,) if own_indexer else ())


def output_weights(p: Params, cfg: ModelConfig, ws: WeightShards) -> Params:
    """p with o_proj, which takes the heads to hidden space, gathered whole where each device
    attends every head of its own rows; with its scales."""
    if not ws.whole_heads:
        return p
    with phase("merge"):
        return ws.gather_weights(p, _split_axes(p, cfg, (OUTPUT_SPLIT_WEIGHT,)), SCALE_SUFFIX)


def _split_axes(p: Params, cfg: ModelConfig, names: tuple[str, ...]) -> dict[str, int]:
    return {name: split_of(name, p[name].shape, cfg).axis for name in names}
