"""The decoder's elementwise and dense operations: norms, rotary embedding, the Hadamard
rotation, weights and linears, the embedding and the logits.

  RMSNorm    x / sqrt(mean(x^2) + eps) * w, in f32, back in x's dtype
  RoPE       both MLA and the indexer use the same frequencies: theta^(-2i/d), or their YaRN
             correction when the config has `rope_scaling` (as DeepSeek-V3.2, whose MLA and
             indexer share one table)
  linear     x[..., in] . W[out, in] in W's dtype, widened to f32; a block-scaled (fp8)
             weight dequantised inside the computation, or read as fp8 blocks by a kernel
             where kernels/dispatch.py (`MODEL_KERNELS`) says one pays

Weights are in the model layout (cp_runtime.weights.params.model_layout), whole or split over
a mesh axis; `embed` and `logits` take the `WeightShards` that says which.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cp_runtime.config import ModelConfig
from cp_runtime.kernels import reference
from cp_runtime.kernels.dispatch import MODEL_KERNELS
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.params import Params
from cp_runtime.weights.shards import WeightShards

__all__ = ["rms_norm", "layer_norm", "rope_frequencies", "rope_mscale", "rope_cos_sin", "rope",
           "hadamard", "weight", "dequantised", "matmul", "xla_linear", "linear", "pad_last",
           "embed", "logits"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * weight).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * weight + bias


def _yarn_ramp(cfg: ModelConfig) -> np.ndarray:
    """f32[d/2]: 0 for the pairs that keep their frequency, 1 for those divided by the factor.

    Pair i turns L theta^(-2i/d) / 2pi times over the original context of L tokens, so it turns
    r times at i = d ln(L / (2 pi r)) / (2 ln theta). Pairs up to the one for beta_fast turns
    (floored) keep their frequency, pairs from the one for beta_slow turns (ceiled) on are
    divided by the factor, and a linear ramp blends those between (DeepSeek-V3's reference).
    With `truncate` false (transformers' YaRN option) the ends stay where they fall."""
    rs, d = cfg.rope_scaling, cfg.qk_rope_head_dim

    def correction_dim(turns: float) -> float:
        return (d * np.log(rs.original_max_position_embeddings / (turns * 2 * np.pi))
                / (2 * np.log(cfg.rope_theta)))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = int(np.floor(low)), int(np.ceil(high))
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001            # a step, not a division by zero
    ramp = (np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    return np.clip(ramp, 0, 1).astype(np.float32)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies f32[d/2] (d = qk_rope_head_dim) of the MLA and indexer rope.

    Plain: theta^(-2i/d). YaRN (factor > 1): freq * (1 - ramp) + freq / factor * ramp, so the
    high-frequency dims (ramp 0) keep theta^(-2i/d) exactly and the lowest (ramp 1) are that
    divided by the factor. A factor of 1 returns the plain table, bit for bit."""
    d = cfg.qk_rope_head_dim
    inv_freq = cfg.rope_theta ** (-np.arange(0, d, 2, dtype=np.float32) / d)     # [d/2]
    rs = cfg.rope_scaling
    if rs is None or rs.factor == 1:
        return inv_freq
    keep = 1 - _yarn_ramp(cfg)          # blended as DeepSeek's reference does, to the last ulp
    return (inv_freq / np.float32(rs.factor) * (1 - keep) + inv_freq * keep).astype(np.float32)


def rope_mscale(cfg: ModelConfig) -> float:
    """The factor on the rope's cos and sin: YaRN's `rope_mscale`, 1 without rope scaling."""
    return 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.rope_mscale


def rope_cos_sin(pos: jax.Array, inv_freq: np.ndarray, mscale: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
    """The rotary angles' cos and sin f32[..., d/2] at positions pos[...], times mscale."""
    ang = pos.astype(jnp.float32)[..., None] * inv_freq                  # [..., d/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos, sin


def rope(x: jax.Array, pos: jax.Array, inv_freq: np.ndarray, *, interleaved: bool,
         mscale: float = 1.0) -> jax.Array:
    """Rotary embedding of x[..., d] at integer positions pos[...] (x has extra head dims between)
    with inverse frequencies inv_freq f32[d/2] (`rope_frequencies`).

    interleaved: rotate pairs (x[2i], x[2i+1]) (MLA); otherwise the halves (x[i], x[i + d/2])
    (neox style, the DSA indexer). mscale multiplies cos and sin (YaRN; skipped when 1).
    """
    d = x.shape[-1]
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"inv_freq has shape {inv_freq.shape}, rope of {d} dims needs "
                         f"({d // 2},)")
    cos, sin = (a.reshape(a.shape[:pos.ndim] + (1,) * (x.ndim - pos.ndim - 1) + a.shape[-1:])
                for a in rope_cos_sin(pos, inv_freq, mscale))
    # Each value times its angle's cos, plus its partner (the other of its pair, or of its
    # halves) times -sin (first of the two) or +sin: the partner is the pair (or halves)
    # reversed, so the rotation is one elementwise pass; strided slices and a stack of the
    # results were three or four small ops in XLA:TPU. The same products and sums.
    axis = -1 if interleaved else -2
    parts = x.reshape(*x.shape[:-1], *((d // 2, 2) if interleaved else (2, d // 2)))
    partner = jnp.flip(parts, axis)
    cos, sin = jnp.expand_dims(cos, axis), jnp.stack([-sin, sin], axis)
    return (parts * cos + partner * sin).reshape(x.shape).astype(x.dtype)


def _hadamard_matrix(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def hadamard(x: jax.Array) -> jax.Array:
    """Orthonormal Hadamard rotation of the last axis (a power of two)."""
    return x @ jnp.asarray(_hadamard_matrix(x.shape[-1]), x.dtype)


def weight(p: Params, name: str) -> jax.Array:
    """Tensor `name` ready for a matmul: as held (bf16, f32), or an fp8 weight dequantised by
    its block scales `name + SCALE_SUFFIX` (cp_runtime.weights.format) into bf16, here inside
    the computation: the device only ever holds the fp8 values and the scales.
    w [..., a, b] f8, s [..., a / ga, b / gb] f32 -> bf16 [..., a, b]."""
    w, s = p[name], p.get(name + SCALE_SUFFIX)
    return w if s is None else dequantised(w, s)


def dequantised(w: jax.Array, s: jax.Array) -> jax.Array:
    """A block-scaled weight w f8[..., a, b] with its scales s f32[..., a / ga, b / gb] in
    bf16: each value times its block's scale."""
    return reference.dequantize(w, s).astype(jnp.bfloat16)


def matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(spec, x, w) in W's dtype, widened to f32: bf16 weights run a bf16 matmul (the
    MXU accumulates in f32 and rounds the result to bf16, as bf16 serving does everywhere;
    XLA:CPU has no bf16 x bf16 -> f32 dot inside fusions), f32 weights an f32 one. The
    residual stream, norms and attention stay f32."""
    return jnp.einsum(spec, x.astype(w.dtype), w).astype(jnp.float32)


def xla_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., in] @ W[out, in].T (HF layout) -> f32, in XLA (`matmul`)."""
    return matmul("...i,oi->...o", x, w)


def linear(p: Params, name: str, x: jax.Array) -> jax.Array:
    """x[..., in] through the weight `name` [out, in] -> f32[..., out]: `weight()` then a
    matmul (`xla_linear`), or, where kernels/dispatch.py's `ModelKernels.linear` takes it, the
    block-scaled weight read as fp8 blocks by a kernel (the same sum kept in f32 rather than
    rounded to bf16)."""
    def in_xla(x: jax.Array, w: jax.Array, s: jax.Array | None) -> jax.Array:
        return xla_linear(x, w if s is None else dequantised(w, s))

    return MODEL_KERNELS.linear(x, p[name], p.get(name + SCALE_SUFFIX), in_xla)


def pad_last(x: jax.Array, width: int) -> jax.Array:
    """x[..., n] zero-padded to x[..., width]."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def embed(params: Params, tokens: jax.Array, ws: WeightShards = WeightShards()) -> jax.Array:
    """tokens i32[...] -> f[..., hidden]. Split by vocabulary: each device looks up the tokens
    in its rows (zeros for the rest) and a psum joins them, exactly (into this device's rows
    f[R / S, hidden] where the rows are split: `WeightShards.rows_split`)."""
    table = params["model.embed_tokens.weight"]                           # [V (local), hidden]
    if not ws.split:
        return table[tokens].astype(jnp.float32)
    local = tokens - ws.first(table.shape[0])
    inside = (local >= 0) & (local < table.shape[0])
    rows = table[jnp.clip(local, 0, table.shape[0] - 1)].astype(jnp.float32)
    return ws.psum_rows(jnp.where(inside[..., None], rows, 0))


def logits(params: Params, hidden: jax.Array, ws: WeightShards = WeightShards(),
           vocab_size: int | None = None) -> jax.Array:
    """hidden f[..., hidden] -> f32[..., V]; split by vocabulary, each device's logits are
    gathered and `vocab_size` (required then) cuts the padded rows' logits off."""
    head = weight(params, "lm_head.weight" if "lm_head.weight" in params
                  else "model.embed_tokens.weight")
    out = xla_linear(hidden, head)
    if not ws.split:
        return out
    if vocab_size is None:
        raise ValueError("logits of a vocabulary split over devices need vocab_size")
    return ws.gather(out, -1, vocab_size)
