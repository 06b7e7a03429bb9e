"""The Pallas kernels at a model's per-shard shapes, as compile cases for one TPU device.

Shapes per shard: the latent cache `[P + 1, ps, D_lat]` in the cache dtype, queries with every
head (the step gathers q heads before the sparse attention), `N = index_topk / ps + 1` pages per
query, the indexer's bf16 key cache `[P + 1, ps, D_idx]` and its heads. The pool is sized past
VMEM (POOL_BYTES), as a real one is, so XLA never stages it whole in VMEM.

    write    decode rows (N = batch) and a prefill chunk (with the step's tile bound)
    decode   batches of one query per row
    prefill  chunks of 1 .. many query blocks (partial last blocks too)
    masked   decode and prefill with token masks (token-level selection): N = index_topk
             entries a query, each with its W = cdiv(ps, 32) mask words
    indexer  the decode query and a prefill chunk against the bf16 key cache
    experts  the routed experts' grouped matmul from fp8 blocks, gate and down projections of
             one device's slice of every expert (inner / S features), at decode steps' and a
             prefill chunk's rows (tokens x experts per token)
    linear   a linear layer from fp8 blocks: one device's o_proj (every hidden row, its
             heads' columns), at decode steps' tokens (the model sends it at most 256) and
             a prefill chunk's
    router   a MoE layer's routing (the router's matmul, the group limit, the top k), whole
             on every device, at decode steps' tokens
    latent   kv_b's per-head products from fp8 blocks at one device's heads: the queries
             through W_uk and the exchanged partials' merge through W_uv, at decode rows
    whole_heads  the same products for every head of a device's own rows of a prefill chunk
             (the head-split weights gathered whole): W_uk where the model's q heads are
             whole lane tiles, and W_uv with o_proj, at 8K and 16K chunks' rows
    shared   a MoE layer's shared experts (one device's inner / S features) added to the
             routed sum, for every row of half a 32K prefill chunk, in fp8
    top_k    the page selection's ranks: a shard's own pages of a 1M context by position and
             the S * K gathered candidates by page, for a decode row and half a 32K chunk

(The experts' visit plan, a scalar-core kernel, compiles inside the experts' cases.)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype
from cp_runtime.kernels import (cache_write, expert_matmul, indexer, latent_heads, page_top_k,
                                router, scaled_linear, shared_expert, sparse_decode,
                                sparse_prefill, whole_heads)
from cp_runtime.kernels.reference import mask_words
from cp_runtime.kernels.storage import cdiv
from cp_runtime.kernels.vmem import LANES
from cp_runtime.model.expert_router import routing_keywords

__all__ = ["KernelCase", "POOL_BYTES", "expert_cases", "kernel_cases", "latent_cases",
           "linear_cases", "router_cases", "shared_expert_cases", "whole_heads_cases",
           "top_k_cases"]

POOL_BYTES = 256 << 20          # per kernel case: well past a TensorCore's 64 MiB of VMEM
CONTEXT = 1 << 20               # tokens of the session whose pages the readers walk
NUM_SHARDS = 16


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """`fn(*args)` is one kernel call; `cost` is its cost() (flops, bytes, VMEM); `donate`:
    the argument the kernel updates in place (the cache write's cache), donated as the step
    donates the pool, so the compiled figures show no copy of it."""

    name: str
    kernel: str
    fn: Callable
    args: tuple
    cost: dict
    donate: tuple[int, ...] = ()

    def jitted(self):
        return jax.jit(self.fn, donate_argnums=self.donate)


def _structs(device, *shapes_and_dtypes) -> tuple:
    sharding = SingleDeviceSharding(device)
    return tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                 for shape, dtype in shapes_and_dtypes)


def _pages(page_size: int, row_bytes: int) -> int:
    return cdiv(POOL_BYTES, page_size * row_bytes)


def write_cases(model: ModelConfig, kv_dtype: str, page_size: int, rows: tuple[int, ...],
                device) -> list[KernelCase]:
    dtype = latent_cache_dtype(kv_dtype)
    d = model.latent_dim
    pages = _pages(page_size, d * jnp.dtype(dtype).itemsize)
    out = []
    for n, queries in rows:
        cache_shape = (pages + 1, page_size, d)
        bound = cache_write.tiles_bound(n // queries, queries,
                                        cache_write.write_tile_rows(cache_shape, dtype))
        args = _structs(device, (cache_shape, dtype), ((n, d), jnp.bfloat16), ((n,), jnp.int32),
                        ((n,), jnp.int32))

        def fn(cache, new, slots, offsets, bound=bound):
            return cache_write.write_kv(cache, new, slots, offsets, max_tiles=bound)

        out.append(KernelCase(f"write {n // queries}x{queries}", "cache_write", fn, args,
                              cache_write.cost(*args, max_tiles=bound), donate=(0,)))
    return out


def _attention_cases(model: ModelConfig, kv_dtype: str, page_size: int,
                     shapes: tuple[tuple[int, int], ...], module, name: str,
                     device, masked: bool = False) -> list[KernelCase]:
    """Cases of the attention kernel `module.<name>` (with `module.cost`), one per (rows B,
    queries Q) in `shapes`; `masked`: token mode, index_topk entries a query with their masks
    i32[B, Q, N, W], in place of page mode's index_topk / ps + 1 pages."""
    call = getattr(module, name)
    dtype = latent_cache_dtype(kv_dtype)
    h, d = model.num_attention_heads, model.latent_dim
    n = model.index_topk if masked else model.index_topk // page_size + 1
    pages = _pages(page_size, d * jnp.dtype(dtype).itemsize)
    statics = dict(value_dim=model.kv_lora_rank, scale=model.softmax_scale)
    out = []
    for b, q in shapes:
        args = _structs(device, ((b, q, h, d), jnp.bfloat16), ((pages + 1, page_size, d), dtype),
                        ((b, q, n), jnp.int32), ((b, q, n), jnp.int32), ((b, q), jnp.int32),
                        *([((b, q, n, mask_words(page_size)), jnp.int32)] if masked else []))

        def fn(*a):
            return call(*a[:5], **statics, sel_masks=a[5] if masked else None)

        label = (f"decode B={b}" if module is sparse_decode else f"prefill Q={q}"
                 ) + (" masked" if masked else "")
        out.append(KernelCase(label, name, fn, args,
                              module.cost(*args[:5], value_dim=model.kv_lora_rank,
                                          sel_masks=args[5] if masked else None)))
    return out


def decode_cases(model: ModelConfig, kv_dtype: str, page_size: int, batches: tuple[int, ...],
                 device, masked: bool = False) -> list[KernelCase]:
    return _attention_cases(model, kv_dtype, page_size, tuple((b, 1) for b in batches),
                            sparse_decode, "sparse_decode", device, masked)


def prefill_cases(model: ModelConfig, kv_dtype: str, page_size: int, chunks: tuple[int, ...],
                  device, masked: bool = False) -> list[KernelCase]:
    return _attention_cases(model, kv_dtype, page_size, tuple((1, q) for q in chunks),
                            sparse_prefill, "sparse_prefill", device, masked)


def indexer_cases(model: ModelConfig, kv_dtype: str, page_size: int, chunks: tuple[int, ...],
                  key_block_pages: int, device) -> list[KernelCase]:
    dtype = indexer_cache_dtype(kv_dtype)
    hi, di = model.index_n_heads, model.index_head_dim
    pages = _pages(page_size, di * jnp.dtype(dtype).itemsize)
    local = cdiv(cdiv(CONTEXT, page_size), NUM_SHARDS)
    out = []
    for q in chunks:
        args = _structs(device, ((1, q, hi, di), jnp.bfloat16), ((1, q, hi), jnp.float32),
                        ((pages + 1, page_size, di), dtype), ((1, local), jnp.int32),
                        ((1, q), jnp.int32), ((), jnp.int32))
        statics = dict(num_shards=NUM_SHARDS, key_block_pages=key_block_pages)

        def fn(*a, statics=statics):
            return indexer.indexer_page_scores(*a, **statics)

        out.append(KernelCase(f"indexer Q={q}", "indexer", fn, args,
                              indexer.cost(*args, **statics)))
        if q > 1:                # a chunk's scores in fp8 (Strategy.indexer_scores)
            out.append(_fp8_indexer_case(q, hi, di, local, page_size, statics, device))
    return out


def _fp8_indexer_case(q: int, hi: int, di: int, local: int, page_size: int, statics: dict,
                      device) -> KernelCase:
    """The indexer kernel as a chunk's fp8 scoring calls it: e4m3 queries and the row's pages
    rounded to e4m3 beside their keys' scales (`indexer.quantized_scores_inputs`)."""
    e4m3 = jnp.float8_e4m3fn
    args = _structs(device, ((1, q, hi, di), e4m3), ((1, q, hi), jnp.float32),
                    ((local + 1, page_size, di), e4m3), ((1, local), jnp.int32),
                    ((1, q), jnp.int32), ((), jnp.int32),
                    ((1, local, page_size), jnp.float32))

    def fn(q, w, k, pages, pos, shard, k_scale):
        return indexer.indexer_page_scores(q, w, k, pages, pos, shard, k_scale=k_scale,
                                           **statics)

    return KernelCase(f"indexer fp8 Q={q}", "indexer", fn, args,
                      indexer.cost(*args[:6], k_scale=args[6], **statics))


def _gated_experts(rows, w, scales, group_sizes, w_up, scales_up, row_weights):
    return expert_matmul.grouped_matmul(rows, w, scales, group_sizes, up=(w_up, scales_up),
                                        row_weights=row_weights, out_dtype=jnp.bfloat16)


def _down_experts(rows, w, scales, group_sizes):
    return expert_matmul.grouped_matmul(rows, w, scales, group_sizes, out_dtype=jnp.bfloat16)


def expert_cases(model: ModelConfig, tokens: tuple[int, ...], device) -> list[KernelCase]:
    """The experts' kernel for steps of `tokens` tokens (each row one (token, expert) pair),
    fp8 weights in 128 x 128 blocks, as the public checkpoints hold them: gate and up in one
    call, as the model runs them (each row's product times its routing weight, in bf16), and
    down (with bf16 outputs, as the model sums them)."""
    e, hid = model.n_routed_experts, model.hidden_size
    inner = cdiv(model.moe_intermediate_size, NUM_SHARDS)
    out = []
    for t in tokens:
        rows = t * model.num_experts_per_tok
        for proj, (k, m) in (("gate_up", (hid, inner)), ("down", (inner, hid))):
            weight = (((e, k, m), jnp.float8_e4m3fn),
                      ((e, cdiv(k, 128), cdiv(m, 128)), jnp.float32))
            gated = proj == "gate_up"
            args = _structs(device, ((rows, k), jnp.bfloat16), *weight, ((e,), jnp.int32),
                            *((*weight, ((rows, 1), jnp.float32)) if gated else ()))
            fn = _gated_experts if gated else _down_experts
            out.append(KernelCase(f"experts {proj} T={t}", "experts", fn, args,
                                  expert_matmul.cost(rows, (e, k, m), args[2].shape,
                                                     weights=2 if gated else 1,
                                                     out_itemsize=2, row_weights=gated)))
    return out


def linear_cases(model: ModelConfig, tokens: tuple[int, ...], device) -> list[KernelCase]:
    """The fp8 linear kernel at one device's o_proj: [hidden, heads x v_head / S], the
    checkpoints' 128 x 128 blocks."""
    n, k = model.hidden_size, cdiv(model.num_attention_heads * model.v_head_dim, NUM_SHARDS)
    scales = (cdiv(n, 128), cdiv(k, 128))
    return [KernelCase(f"linear o_proj T={t}", "linear", scaled_linear.scaled_linear,
                       _structs(device, ((t, k), jnp.bfloat16), ((n, k), jnp.float8_e4m3fn),
                                (scales, jnp.float32)),
                       scaled_linear.cost(t, (n, k), scales))
            for t in tokens]


def router_cases(model: ModelConfig, tokens: tuple[int, ...], device) -> list[KernelCase]:
    """The routing kernel at the model's router (whole on every device), for steps of
    `tokens` tokens (the model sends it at most 64)."""
    gate = (model.n_routed_experts, model.hidden_size)

    def fn(x, g, b):
        return router.route(x, g, b, **routing_keywords(model))

    return [KernelCase(f"router T={t}", "router", fn,
                       _structs(device, ((t, model.hidden_size), jnp.float32),
                                (gate, jnp.bfloat16), ((gate[0],), jnp.float32)),
                       router.cost(t, gate, model.num_experts_per_tok))
            for t in tokens]


def latent_cases(model: ModelConfig, rows: tuple[int, ...], device) -> list[KernelCase]:
    """kv_b's per-head kernels at one device's heads (H / S of them, fp8 in 128 x 128 blocks):
    the queries through W_uk and the merge through W_uv, for steps of `rows` rows (the model
    sends them at most 64)."""
    heads, nope = cdiv(model.num_attention_heads, NUM_SHARDS), model.qk_nope_head_dim
    dv, v = model.kv_lora_rank, model.v_head_dim
    kv_b = (heads * (nope + v), dv)
    scales = (cdiv(kv_b[0], 128), cdiv(dv, 128))
    weights = ((kv_b, jnp.float8_e4m3fn), (scales, jnp.float32))
    out = []
    for r in rows:
        queries, received = (heads, r, model.qk_head_dim), (NUM_SHARDS, heads, r, dv + 1)
        out += [
            KernelCase(f"absorb R={r}", "latent",
                       lambda q, w, s: latent_heads.absorb_queries(q, w, s, nope=nope),
                       _structs(device, (queries, jnp.float32), *weights),
                       latent_heads.absorb_cost(queries, kv_b, scales, nope)),
            KernelCase(f"merge R={r}", "latent",
                       lambda x, w, s: latent_heads.merge_values(x, w, s, nope=nope),
                       _structs(device, (received, jnp.float32), *weights),
                       latent_heads.cost(received, kv_b, scales, v))]
    return out


def whole_heads_cases(model: ModelConfig, rows: tuple[int, ...], device) -> list[KernelCase]:
    """kernels/whole_heads.py at every head (kv_b and o_proj whole, fp8 in 128 x 128 blocks),
    for a device's `rows` rows: W_uk where the kernel takes the model's q heads (and the
    query rows, W_uk with the rope part rotated beside, where it takes them so), and W_uv
    with o_proj."""
    heads, nope = model.num_attention_heads, model.qk_nope_head_dim
    dv, v, dq, hidden = model.kv_lora_rank, model.v_head_dim, model.qk_head_dim, model.hidden_size
    kv_b, o_proj = (heads * (nope + v), dv), (hidden, heads * v)
    kv_b_s, o_proj_s = ((cdiv(a, 128), cdiv(b, 128)) for a, b in (kv_b, o_proj))
    kv = ((kv_b, jnp.float8_e4m3fn), (kv_b_s, jnp.float32))
    out = []
    for r in rows:
        if whole_heads.supports_absorb(r, heads, nope, dq, kv_b, kv_b_s):
            out.append(KernelCase(
                f"absorb every head R={r}", "whole_heads",
                lambda q, w, s: whole_heads.absorb_queries(q, w, s, heads=heads, nope=nope),
                _structs(device, ((r, heads * dq), jnp.float32), *kv),
                whole_heads.absorb_cost(r, heads, nope, v, dq, dv, kv_b_s[0] * kv_b_s[1])))
        if whole_heads.supports_absorb(r, heads, nope, dq, kv_b, kv_b_s, rope=True):
            out.append(KernelCase(
                f"query rows every head R={r}", "whole_heads",
                lambda q, w, s, f: whole_heads.absorb_queries(q, w, s, heads=heads, nope=nope,
                                                              rope=f),
                _structs(device, ((r, heads * dq), jnp.float32), *kv,
                         ((r, 2 * LANES), jnp.float32)),
                whole_heads.absorb_cost(r, heads, nope, v, dq, dv, kv_b_s[0] * kv_b_s[1],
                                        rope=True)))
        out.append(KernelCase(
            f"output every head R={r}", "whole_heads",
            lambda o, w, s, wo, so: whole_heads.project_output(o, w, s, wo, so, nope=nope),
            _structs(device, ((r, heads, dv), jnp.float32), *kv,
                     (o_proj, jnp.float8_e4m3fn), (o_proj_s, jnp.float32)),
            whole_heads.output_cost(r, heads, nope, v, dv, hidden, kv_b_s[0] * kv_b_s[1],
                                    o_proj_s[0] * o_proj_s[1])))
    return out


def shared_expert_cases(model: ModelConfig, rows: tuple[int, ...], device) -> list[KernelCase]:
    """The shared experts' kernel at one device's slice of their features (fp8 in 128 x 128
    blocks), for `rows` fp8 rows of a prefill chunk's MLP; none for a model without them."""
    hidden = model.hidden_size
    inner = cdiv(model.moe_intermediate_size * model.n_shared_experts, NUM_SHARDS)
    gate, down = (inner, hidden), (hidden, inner)
    gate_s, down_s = ((cdiv(a, 128), cdiv(b, 128)) for a, b in (gate, down))
    weights = ((gate, jnp.float8_e4m3fn), (gate_s, jnp.float32)) * 2 + (
        (down, jnp.float8_e4m3fn), (down_s, jnp.float32))
    return [KernelCase(f"shared experts T={t}", "shared",
                       shared_expert.shared_expert,
                       _structs(device, ((t, hidden), jnp.float8_e4m3fn), ((t, 1), jnp.float32),
                                ((t, hidden), jnp.bfloat16), *weights),
                       shared_expert.cost(t, gate, gate_s, down, down_s))
            for t in rows if model.n_shared_experts]


def top_k_cases(model: ModelConfig, page_size: int, queries: tuple[int, ...], device
                ) -> list[KernelCase]:
    """The selection's ranks at CONTEXT: a shard's own pages by position (k of M), the S * k
    gathered candidates by page, and the S gathered lists halved by pairs first (the TPU's
    form at an even S), for `queries` queries (a decode row, half a chunk)."""
    k = model.index_topk // page_size
    own = cdiv(CONTEXT, page_size * NUM_SHARDS) + 1        # a rotated sequence's spare page
    out = []
    for q in queries:
        out.append(KernelCase(f"top-k own pages M={own} Q={q}", "top_k",
                              lambda s, k=k: page_top_k.top_pages(s, k=k),
                              _structs(device, ((own, q), jnp.float32)),
                              page_top_k.cost(own, q, k, has_pages=False)))
        gathered = NUM_SHARDS * k
        out.append(KernelCase(f"top-k gathered M={gathered} Q={q}", "top_k",
                              lambda s, p, k=k: page_top_k.top_pages(s, p, k=k),
                              _structs(device, ((gathered, q), jnp.float32),
                                       ((gathered, q), jnp.int32)),
                              page_top_k.cost(gathered, q, k, has_pages=True)))
        out.append(KernelCase(f"top-k pairs G={NUM_SHARDS} Q={q}", "top_k",
                              lambda lists, k=k: page_top_k.top_pages_of_pairs(lists, k=k),
                              _structs(device, ((NUM_SHARDS, 2, k, q), jnp.float32)),
                              page_top_k.pairs_cost(NUM_SHARDS, q, k)))
    return out


def kernel_cases(model: ModelConfig, kv_dtype: str, page_size: int, device, *,
                 decode_batches=(1, 5, 64), prefill_chunks=(1, 200, 8192),
                 masked_decode_batches=(1, 64), masked_prefill_chunks=(200, 8192),
                 write_rows=((64, 1), (8192, 8192)), indexer_chunks=(1, 8192),
                 expert_tokens=(1, 32, 8192), linear_tokens=(1, 32, 256, 8192),
                 router_tokens=(1, 64), latent_rows=(1, 64), whole_head_rows=(512, 1024),
                 shared_rows=(16384,), top_k_queries=(1, 16384),
                 key_block_pages: int = RuntimeConfig().key_block_pages) -> list[KernelCase]:
    """Every kernel's cases for one model, cache dtype and page size (defaults: the sweep of
    `cp-runtime compile --kernels`)."""
    return (write_cases(model, kv_dtype, page_size, write_rows, device)
            + decode_cases(model, kv_dtype, page_size, decode_batches, device)
            + prefill_cases(model, kv_dtype, page_size, prefill_chunks, device)
            + decode_cases(model, kv_dtype, page_size, masked_decode_batches, device,
                           masked=True)
            + prefill_cases(model, kv_dtype, page_size, masked_prefill_chunks, device,
                            masked=True)
            + indexer_cases(model, kv_dtype, page_size, indexer_chunks, key_block_pages,
                            device)
            + expert_cases(model, expert_tokens, device)
            + linear_cases(model, linear_tokens, device)
            + (router_cases(model, router_tokens, device) if model.n_routed_experts else [])
            + latent_cases(model, latent_rows, device)
            + whole_heads_cases(model, whole_head_rows, device)
            + shared_expert_cases(model, shared_rows, device)
            + top_k_cases(model, page_size, top_k_queries, device))
