"""The least work a step must do, as flops and bytes (`Work`): what this design must do per step
(dense layers on every shard, cache reads and scores only for tokens a query may see, each page
read once per step), not what the reference kernels do with padding and masks. Elementwise work
(norms, RoPE, softmax) and collectives are not counted.

The numerators of the roofline fractions of `cp-runtime bench throughput` (throughput.py),
`bench profile` (its phases, _shared/profile_work.py) and `bench chip` (its floors,
_shared/chip_measure.py), and the weight counts of the hand model (hand_model/tpu_designs.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cp_runtime.cache.capacity import bytes_per_token
from cp_runtime.cache.layout import cdiv
from cp_runtime.config import ModelConfig
from cp_runtime.dtypes import dtype_bytes, indexer_cache_dtype, latent_cache_dtype

__all__ = ["Work", "attention_weights", "indexer_weights", "matmul_weights", "projection_work",
           "indexer_work", "attention_work", "cache_write_work", "decode_step_work",
           "prefill_work"]


@dataclasses.dataclass(frozen=True)
class Work:
    """Floating-point operations and bytes moved to or from memory."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, factor: float) -> "Work":
        return Work(self.flops * factor, self.bytes * factor)


def attention_weights(model: ModelConfig) -> int:
    """Matmul weight elements of one layer's MLA attention:
    q_lora*hid + H*(nope+rope)*q_lora + (kv_lora+rope)*hid + H*(nope+v)*kv_lora (W_uk and W_uv,
    absorbed) + hid*H*v."""
    hid, h = model.hidden_size, model.num_attention_heads
    return (model.q_lora_rank * hid + h * model.qk_head_dim * model.q_lora_rank
            + (model.kv_lora_rank + model.qk_rope_head_dim) * hid
            + h * (model.qk_nope_head_dim + model.v_head_dim) * model.kv_lora_rank
            + hid * h * model.v_head_dim)


def indexer_weights(model: ModelConfig) -> int:
    """Matmul weight elements of one `full` layer's indexer: Hi*Di*q_lora + Di*hid + Hi*hid."""
    hi, di, hid = model.index_n_heads, model.index_head_dim, model.hidden_size
    return hi * di * model.q_lora_rank + di * hid + hi * hid


def matmul_weights(model: ModelConfig, *, experts: int | None = None) -> int:
    """Matmul weight elements one token's forward uses, all layers, lm_head excluded:

        attention  q_lora*hid + H*(nope+rope)*q_lora + (kv_lora+rope)*hid
                   + H*(nope+v)*kv_lora (W_uk and W_uv, absorbed) + hid*H*v
        indexer    Hi*Di*q_lora + Di*hid + Hi*hid               (full layers)
        MLP        3*inter*hid (dense) or E*hid + (k + shared)*3*moe_inter*hid (MoE)

    `experts` replaces k (the routed experts per token), e.g. to count the weights a whole chunk
    reads.
    """
    hid = model.hidden_size
    attention, indexer = attention_weights(model), indexer_weights(model)
    routed = model.num_experts_per_tok if experts is None else experts
    total = 0
    for layer in range(model.num_hidden_layers):
        total += attention + (indexer if model.indexer_types[layer] == "full" else 0)
        if model.is_moe_layer(layer):
            total += (model.n_routed_experts * hid
                      + (routed + model.n_shared_experts) * 3 * model.moe_intermediate_size * hid)
        else:
            total += 3 * model.intermediate_size * hid
    return total


def projection_work(model: ModelConfig, tokens: int, *, logit_rows: int, param_bytes: int,
                    replicas: int) -> Work:
    """The dense layers of one step over `tokens` tokens, on each of `replicas` shards:

        flops = replicas * (tokens * (2 * W_tok + 2 * Di^2 * (Hi + 1) * F) + logit_rows * 2*V*hid)
        bytes = replicas * param_bytes * (W_step + V*hid [if logit_rows] + tokens*hid [embedding])

    W_tok = matmul_weights(model) (active experts), F = full layers (the Hadamard rotations of
    q and k are Di x Di matmuls), W_step = the weights the step reads once: every routed expert
    that some token of the step may use, min(E, tokens * k).
    """
    hid, di, hi = model.hidden_size, model.index_head_dim, model.index_n_heads
    hadamard = 2 * di * di * (hi + 1) * model.num_full_layers if model.index_hadamard else 0
    flops = (tokens * (2 * matmul_weights(model) + hadamard)
             + logit_rows * 2 * model.vocab_size * hid)
    experts = min(model.n_routed_experts, tokens * model.num_experts_per_tok)
    weights = (matmul_weights(model, experts=experts)
               + (model.vocab_size * hid if logit_rows else 0) + tokens * hid)
    return Work(flops, weights * param_bytes).scaled(replicas)


def indexer_work(model: ModelConfig, pairs: int, keys_read: int, *, kv_cache_dtype: str) -> Work:
    """DSA indexer scores over the `full` layers (F of them):

        flops = F * pairs * Hi * (2*Di + 3)      (q.k per head, ReLU, head weight, head sum)
        bytes = F * keys_read * Di * c_idx       (indexer key cache, c_idx its itemsize)
    """
    c = dtype_bytes(indexer_cache_dtype(kv_cache_dtype))
    f, hi, di = model.num_full_layers, model.index_n_heads, model.index_head_dim
    return Work(f * pairs * hi * (2 * di + 3), f * keys_read * di * c)


def attention_work(model: ModelConfig, pairs: int, pages_read: int, *, page_size: int,
                   kv_cache_dtype: str) -> Work:
    """Absorbed MLA over the selected keys, every layer (L of them):

        flops = L * pairs * 2 * H * (D_lat + kv_lora)    (score over the cached row [c | k_pe] as
                                                          stored, padded; value over c)
        bytes = L * pages_read * ps * D_lat * c_lat      (whole latent pages, c_lat its itemsize)
    """
    c = dtype_bytes(latent_cache_dtype(kv_cache_dtype))
    n, h, d = model.num_hidden_layers, model.num_attention_heads, model.latent_dim
    return Work(n * pairs * 2 * h * (d + model.kv_lora_rank), n * pages_read * page_size * d * c)


def cache_write_work(model: ModelConfig, tokens: int, *, kv_cache_dtype: str) -> Work:
    """bytes = tokens * bytes_per_token (latent rows of every layer, indexer keys of every full
    layer: cp_runtime.cache.capacity, the same figure the pool is sized by); no flops."""
    return Work(0, tokens * bytes_per_token(model, kv_cache_dtype))


def decode_step_work(model: ModelConfig, *, context: int, page_size: int, kv_cache_dtype: str,
                     shards: int, param_bytes: int) -> Work:
    """One decode step of one sequence with `context` tokens cached (the new token at position
    t = context, on page p = t // ps, K = index_topk // ps):

        indexer    pairs = keys read = p * ps                      (every earlier page's keys)
        attention  pages = 1 + min(K, p);  pairs = min(K, p) * ps + t % ps + 1
        plus projection_work(1 token, 1 logit row) and cache_write_work(1 token)
    """
    t, ps = context, page_size
    p, k = t // ps, model.index_topk // ps
    sel = min(k, p)
    return (projection_work(model, 1, logit_rows=1, param_bytes=param_bytes, replicas=shards)
            + indexer_work(model, p * ps, p * ps, kv_cache_dtype=kv_cache_dtype)
            + attention_work(model, sel * ps + t % ps + 1, 1 + sel, page_size=ps,
                             kv_cache_dtype=kv_cache_dtype)
            + cache_write_work(model, 1, kv_cache_dtype=kv_cache_dtype))


def prefill_work(model: ModelConfig, *, length: int, chunk: int, page_size: int,
                 kv_cache_dtype: str, shards: int, param_bytes: int) -> Work:
    """A chunked prefill of `length` tokens, `chunk` per step. Query t (page t // ps) scores the
    keys of its earlier pages and attends min(K, t // ps) pages plus its own page up to t:

        indexer pairs   = sum_t (t // ps) * ps
        attention pairs = sum_t min(K, t // ps) * ps + t % ps + 1

    A step over [s, e) reads the indexer keys before its last query's page once,
    ((e - 1) // ps) * ps, and each latent page at most once: at most min(ceil(e / ps),
    own + (e - s) * K) pages, own = ceil(e / ps) - s // ps (an upper bound: the union of the
    chunk's selections). Each step runs projection_work over its tokens with one logit row.
    """
    ps, k = page_size, model.index_topk // page_size
    t = np.arange(length, dtype=np.int64)
    index_pairs = int(((t // ps) * ps).sum())
    attend_pairs = int((np.minimum(k, t // ps) * ps + t % ps + 1).sum())
    keys_read = pages_read = 0
    work = Work()
    for s in range(0, length, chunk):
        e = min(s + chunk, length)
        keys_read += ((e - 1) // ps) * ps
        pages_read += min(cdiv(e, ps), cdiv(e, ps) - s // ps + (e - s) * k)
        work += projection_work(model, e - s, logit_rows=1, param_bytes=param_bytes,
                                replicas=shards)
    return (work + indexer_work(model, index_pairs, keys_read, kv_cache_dtype=kv_cache_dtype)
            + attention_work(model, attend_pairs, pages_read, page_size=ps,
                             kv_cache_dtype=kv_cache_dtype)
            + cache_write_work(model, length, kv_cache_dtype=kv_cache_dtype))
