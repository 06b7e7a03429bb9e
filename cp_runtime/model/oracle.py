"""Dense oracle: the whole sequence at once, no cache, the DSA selection applied as a mask.

Every faster path is checked against this. It materialises [T, T] score matrices, so it is for
short sequences only. With `kv_cache_dtype` given, latent rows and indexer keys are rounded
through the cache dtypes exactly as the paged path stores them, so the paged path must match it
to accumulation-order error; without it the oracle is pure f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cp_runtime.cache.layout import cdiv
from cp_runtime.config import ModelConfig
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype
from cp_runtime.model.indexer_inputs import IndexerInputs
from cp_runtime.model.layers import forward
from cp_runtime.model.ops import logits
from cp_runtime.parallel.selection import earlier_pages_mask, rank_pages
from cp_runtime.weights.params import Params, model_layout

__all__ = ["token_scores", "page_scores", "selection_mask", "token_selection_mask",
           "dense_sparse_attention",
           "make_oracle_attend", "oracle_logits"]


def token_scores(index: IndexerInputs) -> jax.Array:
    """I(t, s) = sum_h w_h(t) ReLU(q_h(t) . k(s)), causal (-inf for s > t): f32[T, T]."""
    logit = jnp.einsum("thd,sd->ths", index.q.astype(jnp.float32), index.k.astype(jnp.float32))
    scores = jnp.einsum("ths,th->ts", jax.nn.relu(logit), index.w.astype(jnp.float32))
    t = scores.shape[0]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    return jnp.where(causal, scores, -jnp.inf)


def page_scores(scores: jax.Array, page_size: int) -> jax.Array:
    """P(t, p) = max over tokens of page p of I(t, s): f32[T, T] -> f32[T, ceil(T / ps)]."""
    t = scores.shape[0]
    n = cdiv(t, page_size)
    padded = jnp.pad(scores, ((0, 0), (0, n * page_size - t)), constant_values=-jnp.inf)
    return padded.reshape(t, n, page_size).max(-1)


def selection_mask(scores: jax.Array, page_size: int, k: int) -> jax.Array:
    """Which tokens each query attends: own page (causal) + top-k earlier pages. bool[T, T]."""
    t = scores.shape[0]
    pscores = page_scores(scores, page_size)                        # [T, n]
    pages = jnp.broadcast_to(jnp.arange(pscores.shape[1], dtype=jnp.int32), pscores.shape)
    pos = jnp.arange(t, dtype=jnp.int32)
    eligible = earlier_pages_mask(pages, pos, page_size)
    _, top = rank_pages(jnp.where(eligible, pscores, -jnp.inf), pages, k)   # [T, k]
    chosen = (pages[:, :, None] == top[:, None, :]).any(-1)        # [T, n]
    chosen |= pages == (pos // page_size)[:, None]
    key_page = jnp.arange(t) // page_size
    return chosen[:, key_page] & (jnp.arange(t)[None, :] <= pos[:, None])


def token_selection_mask(scores: jax.Array, k: int) -> jax.Array:
    """Which tokens each query attends in token mode: its k highest-scoring tokens at or before
    it under (score desc, position asc), all of them where there are at most k. bool[T, T]."""
    t = scores.shape[0]
    ranked = jnp.where(scores == 0, 0.0, scores)        # -0.0 and 0.0 are one score
    top, index = jax.lax.top_k(ranked, min(k, t))       # equal scores: lower position first
    chosen = jnp.zeros((t, t), bool).at[jnp.arange(t)[:, None], index].set(top > -jnp.inf)
    return chosen


def dense_sparse_attention(q: jax.Array, kv: jax.Array, mask: jax.Array, *, value_dim: int,
                           scale: float) -> jax.Array:
    """q f[T, H, D], kv f[T, D], mask bool[T, T] -> o f32[T, H, value_dim]."""
    s = jnp.einsum("thd,sd->ths", q, kv.astype(q.dtype),
                   preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.where(mask[:, None, :], s, -jnp.inf), axis=-1)
    return jnp.einsum("ths,sv->thv", p, kv[:, :value_dim].astype(jnp.float32))


def _round_trip(x: jax.Array, dtype) -> jax.Array:
    return x if dtype is None else x.astype(dtype).astype(x.dtype)


def make_oracle_attend(cfg: ModelConfig, page_size: int, kv_cache_dtype: str | None,
                       selection: str = "token"):
    """The oracle's `attend` callback; its state is the current selection mask bool[T, T].
    selection: "token" or "page" (RuntimeConfig.selection)."""
    latent_dtype = indexer_dtype = None
    if kv_cache_dtype is not None:
        latent_dtype = latent_cache_dtype(kv_cache_dtype)
        indexer_dtype = indexer_cache_dtype(kv_cache_dtype)
    k = cfg.index_topk // page_size

    def attend(layer, mask, q_row, kv_row, index, project):
        if index is not None:
            index = IndexerInputs(q=index.q, w=index.w, k=_round_trip(index.k, indexer_dtype))
            scores = token_scores(index)
            mask = (token_selection_mask(scores, cfg.index_topk) if selection == "token"
                    else selection_mask(scores, page_size, k))
        o = dense_sparse_attention(q_row, _round_trip(kv_row, latent_dtype), mask,
                                   value_dim=cfg.kv_lora_rank, scale=cfg.softmax_scale)
        return project(o), mask

    return attend


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "kv_cache_dtype", "selection"))
def oracle_logits(params: Params, tokens: jax.Array, *, cfg: ModelConfig, page_size: int,
                  kv_cache_dtype: str | None = None, selection: str = "token") -> jax.Array:
    """Logits f32[T, V] of one sequence tokens i32[T] (positions 0..T-1); weights in HF or
    model layout, whole."""
    params = model_layout(params, cfg)
    attend = make_oracle_attend(cfg, page_size, kv_cache_dtype, selection)
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    hidden, _ = forward(params, cfg, tokens, pos, attend, None)
    return logits(params, hidden)
