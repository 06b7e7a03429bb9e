"""Multi-head latent attention's per-head maths: the query rows the attention takes, and its
output projected to hidden space.

  a = W_kva x;  c = RMSNorm(a[:kv_lora]);  k_pe = RoPE(a[kv_lora:])
  q = W_qb RMSNorm(W_qa x) -> q_nope, q_pe = RoPE(.);  q_lat = q_nope . W_uk  (absorbed)
  cached row  [c | k_pe]  and query  [q_lat | q_pe], each part zero-padded to 128 lanes, so one
  dot gives q_lat.c + q_pe.k_pe.  o = W_o (W_uv o_lat).

W_uk and W_uv are kv_b's two parts per head. The cached rows and q come from the rows
(cp_runtime.model.attention_inputs); where a kernel reads kv_b or o_proj as fp8 blocks is
kernels/dispatch.py's choice (`MODEL_KERNELS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cp_runtime.config import ModelConfig
from cp_runtime.kernels.dispatch import MODEL_KERNELS
from cp_runtime.model.ops import (dequantised, linear, matmul, pad_last, rope, rope_cos_sin,
                                  rope_frequencies, rope_mscale, weight)
from cp_runtime.parallel.merge import merge_received
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.params import Params

__all__ = ["KV_B", "O_PROJ", "ProjectFn", "OutputProjection", "query_rows", "absorbed_queries",
           "kv_b_heads", "mla_output", "merged_values"]

KV_B = "self_attn.kv_b_proj.weight"
O_PROJ = "self_attn.o_proj.weight"

# project(o_lat f32[..., H', kv_lora] of this device's heads) -> f[..., hidden] (`mla_output`;
# `OutputProjection` also takes exchanged partials)
ProjectFn = Callable[[jax.Array], jax.Array]


def query_rows(p: Params, cfg: ModelConfig, q: jax.Array, pos: jax.Array) -> jax.Array:
    """q f32[..., H', nope + rope] at positions pos i32[...] -> the attention's query rows
    f32[..., H', D_lat]: [q_nope . W_uk, padded | rope(q_pe), padded]. A device's every head
    of its rows may take one kernel for all of it (`ModelKernels.query_rows`)."""
    nope = cfg.qk_nope_head_dim
    pos = jnp.broadcast_to(pos, q.shape[:-2])
    freqs, mscale = rope_frequencies(cfg), rope_mscale(cfg)

    def joined(q: jax.Array) -> jax.Array:
        q_pe = rope(q[..., nope:], pos, freqs, interleaved=cfg.mla_rope_interleaved,
                    mscale=mscale)
        return jnp.concatenate([pad_last(absorbed_queries(p, cfg, q), cfg.latent_nope_pad),
                                pad_last(q_pe, cfg.latent_rope_pad)], -1)

    return MODEL_KERNELS.query_rows(
        cfg, q, p[KV_B], p.get(KV_B + SCALE_SUFFIX), pos,
        angles=lambda pos: rope_cos_sin(pos, freqs, mscale), without_kernel=joined)


def absorbed_queries(p: Params, cfg: ModelConfig, q: jax.Array) -> jax.Array:
    """q f32[..., H', nope + rope] -> q_nope . W_uk f32[..., H', kv_lora] (bf16-rounded, as
    `matmul`'s), where a kernel may dequantise kv_b in VMEM (`ModelKernels.absorbed_queries`)."""
    nope = cfg.qk_nope_head_dim
    w = p[KV_B]
    rows, heads, dq = int(np.prod(q.shape[:-2])), *q.shape[-2:]

    def kernel_in_xla(q: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
        w_uk = dequantised(w, s).reshape(heads, -1, w.shape[-1])[:, :nope]
        q = q.reshape(rows, heads, dq)
        return jnp.einsum("rhn,hnc->hrc", q[..., :nope].astype(jnp.bfloat16), w_uk)

    return MODEL_KERNELS.absorbed_queries(
        cfg, q, w, p.get(KV_B + SCALE_SUFFIX), xla=kernel_in_xla,
        without_kernel=lambda: matmul("...hn,hnc->...hc", q[..., :nope],
                                      kv_b_heads(p, cfg)[:, :nope]))


def kv_b_heads(p: Params, cfg: ModelConfig) -> jax.Array:
    """W_kv_b as [H (this device's heads), nope + v, kv_lora]."""
    return weight(p, KV_B).reshape(-1, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)


def mla_output(p: Params, cfg: ModelConfig, o_lat: jax.Array) -> jax.Array:
    """o_lat f[..., H, kv_lora] of the heads whose W_uv and o_proj columns this device holds
    (all, or its own) -> f[..., hidden]: the whole output, or this device's partial sum.
    W_uv per head then o_proj (`linear`), or both in one kernel where
    `ModelKernels.mla_output` takes them (a device's own rows of a prefill chunk, every
    head)."""
    blocks = [x for name in (KV_B, O_PROJ) for x in (p[name], p.get(name + SCALE_SUFFIX))]
    return MODEL_KERNELS.mla_output(cfg, o_lat, blocks,
                                    lambda o_lat: _values_then_o_proj(p, cfg, o_lat))


def _values_then_o_proj(p: Params, cfg: ModelConfig, o_lat: jax.Array) -> jax.Array:
    """`mla_output` in XLA: W_uv per head, then o_proj (`linear`)."""
    w_uv = kv_b_heads(p, cfg)[:, cfg.qk_nope_head_dim:]                   # [H, v, kv_lora]
    o = matmul("...hc,hvc->...hv", o_lat, w_uv)
    return linear(p, O_PROJ, o.reshape(*o.shape[:-2], -1))


def merged_values(received: jax.Array, w: jax.Array, s: jax.Array, cfg: ModelConfig
                  ) -> jax.Array:
    """XLA's form of kernels/latent_heads.py: received f32[S, H', R, Dv + 1] -> bf16[R, H' v]
    (merge.merge_received, then `mla_output`'s W_uv matmul)."""
    merged = merge_received(received)                                     # [R, H', Dv]
    w_uv = dequantised(w, s).reshape(-1, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                     cfg.kv_lora_rank)[:, cfg.qk_nope_head_dim:]
    o = matmul("...hc,hvc->...hv", merged, w_uv)
    return o.reshape(o.shape[0], -1).astype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class OutputProjection:
    """One layer's `mla_output`, the `project` an attention callback gets. Called on merged
    latent outputs; `of_exchanged` takes the partials a `head_exchange` merge received
    (cp_runtime.parallel.merge.exchange_heads) and merges them on the way, in one kernel with
    W_uv where `ModelKernels.exchanged_output` takes them."""

    p: Params
    cfg: ModelConfig

    def __call__(self, o_lat: jax.Array) -> jax.Array:
        return mla_output(self.p, self.cfg, o_lat)

    def of_exchanged(self, received: jax.Array) -> jax.Array:
        """received f32[S, H', ..., Dv + 1] -> f[..., hidden] (this device's partial sum)."""
        return MODEL_KERNELS.exchanged_output(
            self.cfg, received, self.p[KV_B], self.p.get(KV_B + SCALE_SUFFIX),
            xla=lambda received, w, s: merged_values(received, w, s, self.cfg),
            o_proj=lambda o: linear(self.p, O_PROJ, o),
            without_kernel=lambda: self(merge_received(received)))
