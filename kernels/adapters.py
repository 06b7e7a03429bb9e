"""The per-shard kernels as one signature: each backend's implementation wrapped so that every
kernel set (kernels/dispatch.py) takes the same arguments as kernels/reference.py.

The TPU kernels take caches in their value dtype and queries in bf16; the XLA and reference
paths take an indexer's `tie` and `fp8` flags through the wrappers here, and caches held in
words (kernels/page_words.py) as values.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cp_runtime.kernels import (cache_write, expert_matmul, indexer, reference, sparse_decode,
                               sparse_prefill)
from cp_runtime.kernels.page_words import from_words, is_words
from cp_runtime.kernels.storage import from_storage

__all__ = ["QUERY_DTYPE", "pallas_attention", "pallas_experts", "pallas_scores", "pallas_write",
           "reads_words", "scored_in_fp8", "tied_after", "values"]


def tied_after(scores_fn: Callable) -> Callable:
    """scores_fn taking `tie` as the TPU kernel does: tied to the scores, returned beside them."""
    @functools.wraps(scores_fn)
    def scores(*args, tie=None, **kwargs):
        out = scores_fn(*args, **kwargs)
        return out if tie is None else jax.lax.optimization_barrier((out, tie))
    return scores


def scored_in_fp8(scores_fn: Callable) -> Callable:
    """scores_fn taking `fp8` as the TPU path does: True scores the queries and keys rounded to
    e4m3, each with its own scale, here on those values widened to f32 (the TPU kernel's fp8
    products are exact; only the f32 sums' order and the scales' rounding differ)."""
    @functools.wraps(scores_fn)
    def scores(q, w, k_cache, local_pages, q_pos, shard, rotation=None, *, fp8=False,
               cache_dtype=None, **kwargs):
        if not fp8:
            return scores_fn(q, w, k_cache, local_pages, q_pos, shard, rotation,
                             cache_dtype=cache_dtype, **kwargs)
        r = indexer.quantized_scores_inputs(q, w, values(k_cache, cache_dtype), local_pages)
        ps = r.k_cache.shape[1]
        scales = jnp.concatenate([r.k_scale.reshape(-1, ps), jnp.ones((1, ps), jnp.float32)])
        keys = r.k_cache.astype(jnp.float32) * scales[..., None]          # [B * M + 1, ps, Di]
        return scores_fn(r.q.astype(jnp.float32), r.w, keys, r.local_pages, q_pos, shard,
                         rotation, **kwargs)
    return scores


def reads_words(attention_fn: Callable) -> Callable:
    """`attention_fn` that also takes its cache in words (kernels/page_words.py), as values."""
    @functools.wraps(attention_fn)
    def attention(q, kv_cache, *args, cache_dtype=None, sel_masks=None, **kwargs):
        if is_words(kv_cache):
            kv_cache = from_words(kv_cache, cache_dtype)
        return attention_fn(q, kv_cache, *args, cache_dtype=cache_dtype, sel_masks=sel_masks,
                            **kwargs)
    return attention


# The Pallas kernels take caches in their value dtype. On a TPU the pool already holds values
# (storage.pool_dtype) and these are no-ops; a CPU pool (interpret mode) holds unsigned
# integers and is reinterpreted around the kernels, which on CPU costs only CPU time.
def values(cache, cache_dtype):
    if is_words(cache):
        return from_words(cache, cache_dtype)
    return cache if cache_dtype is None else from_storage(cache, cache_dtype)


def pallas_write(cache, new, slots, offsets, *, cache_dtype=None, max_tiles=None,
                  interpret: bool):
    out = cache_write.write_kv(values(cache, cache_dtype), new, slots, offsets,
                               max_tiles=max_tiles, interpret=interpret)
    return from_storage(out, cache.dtype)


# The TPU kernels take their queries in bf16: an f32 dot is issued by Mosaic as f32-format MXU
# matmuls, twice the instructions of bf16 ones (docs/notes/2026-12-04-attention-kernels.md).
# The indexer's bf16 queries against its bf16 keys have products exact in f32; the attention
# kernels' bf16 queries meet pages upcast exactly from fp8, and their probabilities are
# rounded to bf16 for PV (kernels/sparse_prefill.py). The rounding is this path's alone: the
# XLA and reference paths keep f32 queries. What it costs, measured against f32
# (tests/kernels/test_kernels.py, tests/kernels/test_kernel_path.py), is recorded beside those
# tests' bounds.
QUERY_DTYPE = jnp.bfloat16


def pallas_scores(q, w, k_cache, local_pages, q_pos, shard, rotation=None, *, tie=None,
                   fp8: bool = False, num_shards: int, key_block_pages: int, cache_dtype=None,
                   interpret: bool):
    kw = dict(num_shards=num_shards, key_block_pages=key_block_pages, interpret=interpret)
    k_cache = values(k_cache, cache_dtype)
    if fp8:
        r = indexer.quantized_scores_inputs(q, w, k_cache, local_pages)
        return indexer.indexer_page_scores(r.q, r.w, r.k_cache, r.local_pages, q_pos, shard,
                                           rotation, tie, r.k_scale, **kw)
    return indexer.indexer_page_scores(q.astype(QUERY_DTYPE), w, k_cache, local_pages, q_pos,
                                       shard, rotation, tie, **kw)


def pallas_attention(q, kv_cache, sel_slots, sel_pages, q_pos, *, value_dim: int, scale: float,
                      query_block: int, cache_dtype=None, sel_masks=None, interpret: bool):
    """Decode kernel for one query per row, the query-block prefill kernel otherwise (token
    masks, `sel_masks`, passed to either). A cache in words (kernels/page_words.py;
    `cache_dtype` the values') goes to the decode kernel as it is, and to the prefill kernel
    as values."""
    q = q.astype(QUERY_DTYPE)
    kw = dict(value_dim=value_dim, scale=scale, interpret=interpret, sel_masks=sel_masks)
    if q.shape[1] == 1 and is_words(kv_cache):
        return sparse_decode.sparse_decode(q, kv_cache, sel_slots, sel_pages, q_pos, **kw,
                                           page_dtype=np.dtype(cache_dtype))
    kv_cache = values(kv_cache, cache_dtype)
    if q.shape[1] == 1:
        return sparse_decode.sparse_decode(q, kv_cache, sel_slots, sel_pages, q_pos, **kw)
    return sparse_prefill.sparse_prefill(q, kv_cache, sel_slots, sel_pages, q_pos, **kw,
                                         query_block=query_block)


def pallas_experts(rows, w, scales, group_sizes, *, up=None, out_dtype=jnp.float32,
                    row_scales=None, row_weights=None, interpret: bool):
    """The fp8 grouped-matmul kernel (gated with `up`); the XLA reference (a ragged dot over
    f32 dequantised weights) where a TPU cannot tile the weights' scale runs: runs narrower
    than 128 lanes, as small test models have and as a 32-way split of 2,048 expert features
    (64 a device) cuts the checkpoints' 128 x 128 blocks."""
    if not interpret and not expert_matmul.supports(w.shape, scales.shape):
        return reference.grouped_matmul(rows, w, scales, group_sizes, up=up,
                                        row_scales=row_scales,
                                        row_weights=row_weights).astype(out_dtype)
    return expert_matmul.grouped_matmul(rows, w, scales, group_sizes, up=up,
                                        out_dtype=out_dtype, row_scales=row_scales,
                                        row_weights=row_weights, interpret=interpret)
