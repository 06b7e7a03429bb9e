"""The DSA-MLA decoder's math, independent of where attention reads its keys from.

Per layer (shapes for T tokens, any leading dims `...`):
  MLA    a = W_kva x;  c = RMSNorm(a[:kv_lora]);  k_pe = RoPE(a[kv_lora:])
         q = W_qb RMSNorm(W_qa x) -> q_nope, q_pe = RoPE(.);  q_lat = q_nope . W_uk  (absorbed)
         cached row  [c | k_pe]  and query  [q_lat | q_pe], each part zero-padded to 128 lanes,
         so one dot gives q_lat.c + q_pe.k_pe.  o = W_o (W_uv o_lat).
  DSA    q_i = Hadamard(RoPE(W_iq q_lora));  k_i = Hadamard(RoPE(LayerNorm(W_ik x)))
         w = W_w x * Hi^-0.5 * Di^-0.5;  I(t, s) = sum_h w_h(t) ReLU(q_i,h(t) . k_i(s))
  RoPE   both use the same frequencies: theta^(-2i/d), or their YaRN correction when the config
         has `rope_scaling` (as DeepSeek-V3.2, whose MLA and indexer share one table).
  MoE    sigmoid scores s, biased b = s + e_score_correction_bias; groups limit the choice
         (keep topk_group of n_group groups by the sum of their two best b), top-k of b among
         them; weights s over the chosen, normalised (norm_topk_prob), times routed_scaling.

`forward` runs the layer stack with an attention callback, so the dense oracle and the paged,
context-parallel path share every line except attention itself.

Weights are in the model layout (cp_runtime.weights.params.model_layout), whole or split over a mesh
axis (cp_runtime.weights.sharding); a `WeightShards` says which, and each function gathers or sums
what its split needs, so the same lines run in both modes:
  the down projections (q_a, kv_a, the indexer's wk and weights_proj) and the router are whole
  on every device (their outputs need no gather); the lm head's logits are computed on this
  device's rows and all-gathered (q's heads and the indexer's stay this device's: the
  attention gathers them where it needs them, cp_runtime.model.attention); the embedding, the
  dense MLP (row-parallel down), the routed experts (each device holds a slice of every
  expert's inner features: gate/up column parallel, down row parallel) and o_proj give
  partial sums.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cp_runtime.config import ModelConfig
from cp_runtime.kernels import (latent_heads, reference, router, scaled_linear, shared_expert,
                                whole_heads)
from cp_runtime.kernels import fp8_rows
from cp_runtime.kernels.fp8_rows import Fp8Rows
from cp_runtime.kernels.vmem import LANES
from cp_runtime.model import expert_groups
from cp_runtime.model.scopes import layer_scope, phase
from cp_runtime.parallel.merge import merge_received
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.sharding import split_of
from cp_runtime.weights.params import Params, layer_params
from cp_runtime.weights.shards import WeightShards

__all__ = [
    "IndexerInputs",
    "MlpInput",
    "OutputProjection",
    "dequantised_whole",
    "forward",
    "hadamard",
    "indexer_inputs",
    "layer_norm",
    "linear",
    "logits",
    "mla_inputs",
    "mla_output",
    "mlp",
    "projected_features",
    "row_features",
    "rms_norm",
    "rope",
    "rope_frequencies",
    "route",
    "route_topk",
    "routing",
    "embed",
    "EXPERTS",
    "expert_rows",
    "weight",
]


@dataclasses.dataclass(frozen=True)
class IndexerInputs:
    """q f32[..., Hi', Di], w f32[..., Hi], k f32[..., Di] of one `full` layer. q holds the
    heads whose weights this device holds: every head (heads None), or with split weights its
    Hi' = ceil(Hi / S) of `heads` in all, which the attention gathers (`gathered`, or with
    the q heads in one collective: cp_runtime.model.attention). With `rows` (the step's
    [B, Q]), q holds every head of this device's own rows, f32[R / S, Hi, Di], made from
    wq_b gathered whole (`attention_weights`), and `gathered` gathers them by row. `rounded`,
    q holds e4m3 values and q_scale f32[..., Hi'] each head's scale."""

    q: jax.Array
    w: jax.Array
    k: jax.Array
    heads: int | None = None
    q_scale: jax.Array | None = None
    rows: tuple[int, ...] | None = None

    def rounded(self) -> "IndexerInputs":
        """q's heads rounded to e4m3, one f32 scale a head (kernels/fp8_rows.py), as a chunk's
        fp8 scoring takes them (RuntimeConfig.indexer_scores): rounded where they are made,
        each device its own heads, they cross the interconnect a byte a value."""
        if self.q_scale is not None:
            return self
        heads = fp8_rows.quantize(self.q)
        return dataclasses.replace(self, q=heads.values, q_scale=heads.scales[..., 0])

    def gathered(self, ws: WeightShards) -> "IndexerInputs":
        """These inputs with every head of q (and of its scales, where rounded), for every
        row."""
        if self.rows is not None:
            # Gathered along the rows, their leading axis: each device's block arrives
            # whole, in the layout the kernel reads (gathered along the heads, XLA:TPU
            # copied the fp8 heads into it in a pass of its own).
            scale = None if self.q_scale is None else ws.gather_rows(self.q_scale, self.rows)
            return dataclasses.replace(self, q=ws.gather_rows(self.q, self.rows),
                                       q_scale=scale, rows=None)
        if self.heads is None:
            return self
        scale = None if self.q_scale is None else ws.gather(self.q_scale, -1, self.heads)
        return dataclasses.replace(self, q=ws.gather(self.q, -2, self.heads), q_scale=scale,
                                   heads=None)

    def scoring_weights(self) -> jax.Array:
        """f32[..., Hi]: w, times each head's scale where q is rounded: ReLU(s q . k) is
        s ReLU(q . k) for s > 0, so the scores of the e4m3 values with these weights are
        those of the heads they stand for."""
        w = self.w.astype(jnp.float32)
        return w if self.q_scale is None else w * self.q_scale


jax.tree_util.register_dataclass(IndexerInputs, data_fields=["q", "w", "k", "q_scale"],
                                 meta_fields=["heads", "rows"])


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


def _rope_mscale(cfg: ModelConfig) -> float:
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
    return w if s is None else _dequantised(w, s)


def _dequantised(w: jax.Array, s: jax.Array) -> jax.Array:
    return reference.dequantize(w, s).astype(jnp.bfloat16)


def _matmul(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(spec, x, w) in W's dtype, widened to f32: bf16 weights run a bf16 matmul (the
    MXU accumulates in f32 and rounds the result to bf16, as bf16 serving does everywhere;
    XLA:CPU has no bf16 x bf16 -> f32 dot inside fusions), f32 weights an f32 one. The
    residual stream, norms and attention stay f32."""
    return jnp.einsum(spec, x.astype(w.dtype), w).astype(jnp.float32)


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x[..., in] @ W[out, in].T (HF layout) -> f32."""
    return _matmul("...i,oi->...o", x, w)


# Steps of at most this many tokens run block-scaled linears through the Pallas kernel on a
# TPU (`linear`). Longer ones keep XLA's fusion, which folds the norm before a matmul and the
# cast after it into the matmul; through the kernel those became passes of their own (its
# inputs' casts, its f32 outputs) and a prefill chunk compiled slower
# (docs/notes/2026-12-03-decode-step.md,
# "Decode's fp8 linears from VMEM, and a router on every device").
LINEAR_KERNEL_MAX_ROWS = 256
# A weight of at least this many elements takes the kernel at any number of rows: the
# head-split weights a device gathers whole to attend every head of its own rows (GLM-5.2's
# q_b, 25M, and o_proj, 100M), whose scales XLA broadcast to f32 and wrote to HBM at every
# row count compiled, and q_a (12.6M) and the indexer's wq_b (8.4M), whose scales XLA
# broadcast the same way. Smaller weights keep XLA's fusion of the norm before and the cast
# after, which routing every linear through the kernel lost
# (docs/notes/2026-12-02-prefill-layout.md, "The gathered weights read as fp8 blocks"; the 8M
# threshold: docs/notes/2026-12-06-indexer.md, "Three passes XLA added beside the kernels").
LINEAR_KERNEL_MIN_ELEMENTS = 8 << 20


def dequantised_whole(cfg: ModelConfig, name: str, w_shape: tuple[int, ...],
                      s_shape: tuple[int, ...], rows: int) -> bool:
    """Whether a step of `rows` rows on a TPU has XLA dequantise the block-scaled head-split
    weight `name`, whole (w_shape, s_shape), in the passes of `weight()` (its scales
    broadcast to f32, then cast) rather than a kernel read its fp8 blocks: kv_b where the
    per-head kernels (kernels/whole_heads.py) do not take it, a linear's weight where
    `linear`'s kernel does not."""
    if name.endswith("self_attn.kv_b_proj.weight"):
        nope = cfg.qk_nope_head_dim
        heads = w_shape[0] // (nope + cfg.v_head_dim)
        if rows <= LATENT_KERNEL_MAX_ROWS:
            return not latent_heads.supports(w_shape, s_shape)
        return not whole_heads.supports_absorb(rows, heads, nope, cfg.qk_head_dim, w_shape,
                                               s_shape)
    return not _linear_kernel_takes(w_shape, s_shape, rows)


def _linear_kernel_takes(w_shape: tuple[int, ...], s_shape: tuple[int, ...], rows: int) -> bool:
    """Whether `linear` on a TPU runs a block-scaled weight through its kernel."""
    few_rows = rows <= LINEAR_KERNEL_MAX_ROWS
    large = int(np.prod(w_shape)) >= LINEAR_KERNEL_MIN_ELEMENTS
    return (few_rows or large) and scaled_linear.supports(w_shape, s_shape)


def linear(p: Params, name: str, x: jax.Array) -> jax.Array:
    """x[..., in] through the weight `name` [out, in] -> f32[..., out]. On a TPU, a step of
    few tokens (LINEAR_KERNEL_MAX_ROWS), or a large weight (LINEAR_KERNEL_MIN_ELEMENTS), takes
    a block-scaled weight whose scale runs are whole lane tiles through the Pallas kernel
    (cp_runtime.kernels.scaled_linear), which dequantises each block in VMEM: XLA's fused
    form of `weight()` wrote the scales, broadcast to the weight's shape in f32, to HBM
    whenever they did not fit VMEM beside the layer's other buffers (o_proj in GLM-5.2's MoE
    layers: 6 GB of a decode step's HBM traffic). Elsewhere, and for other weights, `weight()`
    then a matmul; the kernel's output is the same sum kept in f32 rather than rounded to
    bf16."""
    w, s = p[name], p.get(name + SCALE_SUFFIX)
    if s is None or not _linear_kernel_takes(w.shape, s.shape, int(np.prod(x.shape[:-1]))):
        return _linear(x, weight(p, name))
    return jax.lax.platform_dependent(
        x, w, s, tpu=scaled_linear.scaled_linear,
        default=lambda x, w, s: _linear(x, _dequantised(w, s)))


def _pad_last(x: jax.Array, width: int) -> jax.Array:
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
    freqs, mscale = rope_frequencies(cfg), _rope_mscale(cfg)
    a = features["kv_a"]                                                   # [..., kv_lora+rope]
    c = rms_norm(a[..., : cfg.kv_lora_rank], p["self_attn.kv_a_layernorm.weight"],
                 cfg.mla_norm_eps)
    k_pe = rope(a[..., cfg.kv_lora_rank:], pos, freqs, interleaved=cfg.mla_rope_interleaved,
                mscale=mscale)
    kv_row = jnp.concatenate([_pad_last(c, cfg.latent_nope_pad),
                              _pad_last(k_pe, cfg.latent_rope_pad)], -1)
    out = {"q_lora": q_lora, "kv_row": kv_row}
    if indexer:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        k = layer_norm(features["index_k"], p["self_attn.indexer.k_norm.weight"],
                       p["self_attn.indexer.k_norm.bias"], 1e-6)
        k = _indexer_rope(k, pos, cfg)
        out["index_k"] = hadamard(k) if cfg.index_hadamard else k
        out["index_w"] = features["index_w"] * (hi ** -0.5 * di ** -0.5)
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
    return _query_rows(p, cfg, q, pos), rows["kv_row"], rows["q_lora"]


def _query_rows(p: Params, cfg: ModelConfig, q: jax.Array, pos: jax.Array) -> jax.Array:
    """q f32[..., H', nope + rope] at positions pos i32[...] -> the attention's query rows
    f32[..., H', D_lat]: [q_nope . W_uk, padded | rope(q_pe), padded].

    On a TPU, where every head of a device's rows goes through kernels/whole_heads.py, its
    absorb kernel writes the rows whole, each head's rope part rotated in VMEM from its own
    q block and written beside its product (XLA:TPU laid the heads out again and joined the
    rope part in passes of its own, and sliced, rotated and padded the rope part in more,
    which at 1,024 rows a device also wrote two copies); the rope part is then rounded to
    bf16 there, as the attention kernels' bf16 queries take it anyway. It writes them as the
    sparse kernel reads them, heads in sublanes, so [..., H', D_lat] is a view of its output
    (docs/notes/2026-12-06-32k-chunks.md, "Query rows in the attention's layout"). It takes
    every head of a device's rows (whole groups of 16); a device's own heads of every row,
    where q_b is split, take `joined`."""
    nope, name = cfg.qk_nope_head_dim, "self_attn.kv_b_proj.weight"
    w, s = p[name], p.get(name + SCALE_SUFFIX)
    rows, heads, dq = int(np.prod(q.shape[:-2])), *q.shape[-2:]
    pos = jnp.broadcast_to(pos, q.shape[:-2])
    freqs, mscale = rope_frequencies(cfg), _rope_mscale(cfg)

    def joined(q: jax.Array) -> jax.Array:
        q_pe = rope(q[..., nope:], pos, freqs, interleaved=cfg.mla_rope_interleaved,
                    mscale=mscale)
        return jnp.concatenate([_pad_last(_absorbed_queries(p, cfg, q), cfg.latent_nope_pad),
                                _pad_last(q_pe, cfg.latent_rope_pad)], -1)

    fused = (s is not None and rows > LATENT_KERNEL_MAX_ROWS
             and cfg.kv_lora_rank == cfg.latent_nope_pad and cfg.latent_rope_pad == LANES
             and whole_heads.supports_absorb(rows, heads, nope, dq, w.shape, s.shape, True))
    if not fused:
        return joined(q)

    def kernel(q, w, s, pos):
        factors = whole_heads.rope_factors(*rope_cos_sin(pos.reshape(rows), freqs, mscale),
                                           nope=nope, interleaved=cfg.mla_rope_interleaved)
        out = whole_heads.absorb_queries(q, w, s, heads=heads, nope=nope, rope=factors,
                                         interleaved=cfg.mla_rope_interleaved)
        return out.reshape(*pos.shape, heads, -1).astype(jnp.float32)

    def xla(q, w, s, pos):
        return joined(q.reshape(*pos.shape, heads, dq))

    return jax.lax.platform_dependent(q.reshape(rows, heads * dq), w, s, pos, tpu=kernel,
                                      default=xla)


# Steps of at most this many rows run kv_b's per-head products (W_uk on the queries; the
# merge with W_uv) in the kernels of cp_runtime.kernels.latent_heads on a TPU. The merge's VMEM
# holds one head's partials from every shard, [S, R, Dv + 1] f32, twice: 2.6 MB each at
# S = 16, R = 64.
LATENT_KERNEL_MAX_ROWS = 64


def _latent_kernels_take(w: jax.Array, s: jax.Array | None, rows: int) -> bool:
    """Whether a step of `rows` rows runs kv_b (w, scales s) through latent_heads on a TPU."""
    return (s is not None and rows <= LATENT_KERNEL_MAX_ROWS
            and latent_heads.supports(w.shape, s.shape))


def _absorbed_queries(p: Params, cfg: ModelConfig, q: jax.Array) -> jax.Array:
    """q f32[..., H', nope + rope] -> q_nope . W_uk f32[..., H', kv_lora] (bf16-rounded, as
    `_matmul`'s). On a TPU, a step of few rows takes kernels/latent_heads.py, which
    dequantises kv_b in VMEM (XLA wrote a bf16 copy of it and broadcast its scales first),
    and one of more rows, every head of a device's own rows, kernels/whole_heads.py, which
    dequantises it a head at a time."""
    nope = cfg.qk_nope_head_dim
    name = "self_attn.kv_b_proj.weight"
    w, s = p[name], p.get(name + SCALE_SUFFIX)
    rows, heads, dq = int(np.prod(q.shape[:-2])), *q.shape[-2:]

    def xla(q, w, s):
        w_uk = _dequantised(w, s).reshape(heads, -1, w.shape[-1])[:, :nope]
        q = q.reshape(rows, heads, dq)
        return jnp.einsum("rhn,hnc->hrc", q[..., :nope].astype(jnp.bfloat16), w_uk)

    def few_rows(q, w, s):
        heads_first = jnp.moveaxis(q.reshape(rows, heads, dq), 0, 1)     # [H', R, Dq]
        return latent_heads.absorb_queries(heads_first, w, s, nope=nope)

    if _latent_kernels_take(w, s, rows):
        tpu = few_rows
    elif s is not None and whole_heads.supports_absorb(rows, heads, nope, dq, w.shape, s.shape):
        tpu = functools.partial(whole_heads.absorb_queries, heads=heads, nope=nope)
    else:
        return _matmul("...hn,hnc->...hc", q[..., :nope], _kv_b(p, cfg)[:, :nope])
    out = jax.lax.platform_dependent(q.reshape(rows, heads * dq), w, s, tpu=tpu,
                                     default=xla)                         # bf16[H', R, Dv]
    return jnp.moveaxis(out, 0, 1).reshape(*q.shape[:-1], -1).astype(jnp.float32)


def _kv_b(p: Params, cfg: ModelConfig) -> jax.Array:
    """W_kv_b as [H (this device's heads), nope + v, kv_lora]."""
    return weight(p, "self_attn.kv_b_proj.weight").reshape(
        -1, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)


def _indexer_rope(x: jax.Array, pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rope on the first (or last) qk_rope_head_dim dims of x f[..., Di]: neox-style halves, or
    interleaved pairs when cfg.index_rope_interleaved (GLM-5's `indexer_rope_interleave`)."""
    r = cfg.qk_rope_head_dim
    freqs, mscale = rope_frequencies(cfg), _rope_mscale(cfg)
    kw = dict(interleaved=cfg.index_rope_interleaved, mscale=mscale)
    if cfg.index_rope_first:
        return jnp.concatenate([rope(x[..., :r], pos, freqs, **kw), x[..., r:]], -1)
    return jnp.concatenate([x[..., :-r], rope(x[..., -r:], pos, freqs, **kw)], -1)


def indexer_inputs(p: Params, cfg: ModelConfig, h: jax.Array | None, q_lora: jax.Array,
                   pos: jax.Array, ws: WeightShards = WeightShards(),
                   rows: dict[str, jax.Array] | None = None) -> IndexerInputs:
    """The DSA indexer's query heads, head weights and key for each token. Every device scores
    its own pages with every head; with split weights q holds this device's heads only, and
    the attention gathers them (`IndexerInputs.gathered`). `rows`: h's `row_features` with
    the indexer's, when the caller has them already (h is then not read)."""
    if rows is None:
        rows = row_features(p, cfg, h, pos, indexer=True)
    return IndexerInputs(q=_indexer_queries(p, cfg, q_lora, pos), w=rows["index_w"],
                         k=rows["index_k"], heads=cfg.index_n_heads if ws.split else None)


def _indexer_queries(p: Params, cfg: ModelConfig, q_lora: jax.Array, pos: jax.Array
                     ) -> jax.Array:
    """q_lora f[..., R] -> the indexer's query heads f32[..., Hi', Di] of the wq_b p holds:
    this device's heads, or every head (a whole wq_b: its padding heads cut off)."""
    q = linear(p, INDEXER_Q_WEIGHT, q_lora)
    # A whole wq_b holds the zero heads that pad Hi to a multiple of S; a device's part
    # holds at most Hi, so the cut only ever drops padding.
    q = q.reshape(*q_lora.shape[:-1], -1, cfg.index_head_dim)[..., :cfg.index_n_heads, :]
    q = _indexer_rope(q, pos, cfg)
    return hadamard(q) if cfg.index_hadamard else q


def mla_output(p: Params, cfg: ModelConfig, o_lat: jax.Array) -> jax.Array:
    """o_lat f[..., H, kv_lora] of the heads whose W_uv and o_proj columns this device holds
    (all, or its own) -> f[..., hidden]: the whole output, or this device's partial sum.
    On a TPU, a step of more rows than the latent kernels take (LATENT_KERNEL_MAX_ROWS) with
    block-scaled kv_b and o_proj runs both products in one kernel where it fits
    (kernels/whole_heads.py): a device's own rows of a prefill chunk, every head."""
    flat = o_lat.reshape(-1, *o_lat.shape[-2:])
    names = ("self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")
    blocks = [x for name in names for x in (p[name], p.get(name + SCALE_SUFFIX))]
    if (any(x is None for x in blocks) or flat.shape[0] <= LATENT_KERNEL_MAX_ROWS
            or not whole_heads.supports_output(flat.shape[0], flat.shape[1],
                                               cfg.qk_nope_head_dim,
                                               *(x.shape for x in blocks))):
        return _mla_output(p, cfg, o_lat)
    out = jax.lax.platform_dependent(
        flat, *blocks,
        tpu=functools.partial(whole_heads.project_output, nope=cfg.qk_nope_head_dim),
        default=lambda o, *_: _mla_output(p, cfg, o))
    return out.reshape(*o_lat.shape[:-2], -1)


def _mla_output(p: Params, cfg: ModelConfig, o_lat: jax.Array) -> jax.Array:
    """`mla_output` in XLA: W_uv per head, then o_proj (`linear`)."""
    w_uv = _kv_b(p, cfg)[:, cfg.qk_nope_head_dim:]                         # [H, v, kv_lora]
    o = _matmul("...hc,hvc->...hv", o_lat, w_uv)
    return linear(p, "self_attn.o_proj.weight", o.reshape(*o.shape[:-2], -1))


def _merged_values(received: jax.Array, w: jax.Array, s: jax.Array, cfg: ModelConfig
                   ) -> jax.Array:
    """XLA's form of kernels/latent_heads.py: received f32[S, H', R, Dv + 1] -> bf16[R, H' v]
    (merge.merge_received, then `mla_output`'s W_uv matmul)."""
    merged = merge_received(received)                                     # [R, H', Dv]
    w_uv = _dequantised(w, s).reshape(-1, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                      cfg.kv_lora_rank)[:, cfg.qk_nope_head_dim:]
    o = _matmul("...hc,hvc->...hv", merged, w_uv)
    return o.reshape(o.shape[0], -1).astype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class OutputProjection:
    """One layer's `mla_output`, the `project` an attention callback gets. Called on merged
    latent outputs; `of_exchanged` takes the partials a `head_exchange` merge received
    (cp_runtime.parallel.merge.exchange_heads) and merges them on the way: on a TPU, a step of
    few rows with block-scaled weights does the merge and W_uv in one kernel
    (kernels/latent_heads.py: ~15 XLA passes a layer otherwise)."""

    p: Params
    cfg: ModelConfig

    def __call__(self, o_lat: jax.Array) -> jax.Array:
        return mla_output(self.p, self.cfg, o_lat)

    def of_exchanged(self, received: jax.Array) -> jax.Array:
        """received f32[S, H', ..., Dv + 1] -> f[..., hidden] (this device's partial sum)."""
        name = "self_attn.kv_b_proj.weight"
        w, s = self.p[name], self.p.get(name + SCALE_SUFFIX)
        lead = received.shape[2:-1]
        rows = int(np.prod(lead))
        if not _latent_kernels_take(w, s, rows):
            return self(merge_received(received))
        flat = received.reshape(*received.shape[:2], rows, received.shape[-1])
        o = jax.lax.platform_dependent(
            flat, w, s,
            tpu=functools.partial(latent_heads.merge_values, nope=self.cfg.qk_nope_head_dim),
            default=functools.partial(_merged_values, cfg=self.cfg))
        return linear(self.p, "self_attn.o_proj.weight", o.reshape(*lead, -1))


def _swiglu(p: Params, prefix: str, x: jax.Array | Fp8Rows) -> jax.Array:
    g = _rows_linear(p, f"{prefix}.gate_proj.weight", x)
    u = _rows_linear(p, f"{prefix}.up_proj.weight", x)
    return linear(p, f"{prefix}.down_proj.weight", jax.nn.silu(g) * u)


def _rows_linear(p: Params, name: str, x: jax.Array | Fp8Rows) -> jax.Array:
    """`linear` of rows x f[..., in], or of fp8 rows through their values, each row's scale
    then multiplying its outputs (a row's scale factors out of its sums): XLA:TPU wrote a
    dequantised bf16 copy of a chunk's rows in a pass of its own, where the values' widening
    fuses into the matmul."""
    if isinstance(x, Fp8Rows):
        return linear(p, name, x.values.astype(jnp.bfloat16)) * x.scales
    return linear(p, name, x)


def routing(cfg: ModelConfig) -> dict:
    """The model's routing as `reference.route_topk`'s keywords."""
    return dict(k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                norm=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)


def route_topk(cfg: ModelConfig, logits: jax.Array, bias: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """Router logits f32[..., E] and correction bias f32[E] -> (chosen experts i32[..., k],
    their weights f32[..., k]), k = num_experts_per_tok (`reference.route_topk`)."""
    return reference.route_topk(logits, bias, **routing(cfg))


# Steps of at most this many tokens route through the Pallas kernel on a TPU (`_routed`).
ROUTER_KERNEL_MAX_ROWS = 64


def _routed(p: Params, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array, bool]:
    """x f[T, hidden] -> (chosen i32[T, k], weights f32[T, k], by_expert): the router (whole
    on every device) and `route_topk`. On a TPU a step of few tokens with a bf16 gate takes
    cp_runtime.kernels.router, one call where XLA ran a dozen small ops; such a step's
    choices come in ascending expert order on every platform (by_expert: True)."""
    gate, bias = p["mlp.gate.weight"], p["mlp.gate.e_score_correction_bias"]
    if (x.shape[0] > ROUTER_KERNEL_MAX_ROWS
            or not router.supports(x.shape[0], gate.shape, gate.dtype, cfg.num_experts_per_tok)):
        return *route_topk(cfg, _linear(x, gate), bias), False

    def xla(x, gate, bias):
        return reference.by_expert(*route_topk(cfg, _linear(x, gate), bias))

    chosen, weights = jax.lax.platform_dependent(
        x, gate, bias, tpu=functools.partial(router.route, **routing(cfg)), default=xla)
    return chosen, weights, True


def route(cfg: ModelConfig, logits: jax.Array, bias: jax.Array) -> jax.Array:
    """`route_topk` as dense expert weights f32[..., E], zero off the chosen experts."""
    chosen, weights = route_topk(cfg, logits, bias)
    one_hot = jax.nn.one_hot(chosen, cfg.n_routed_experts, dtype=weights.dtype)  # [..., k, E]
    return (weights[..., None] * one_hot).sum(-2)


# A MoE layer's routed experts, stacked (cp_runtime.weights.sharding), by projection.
EXPERTS = "mlp.experts.{}_proj.weight"


def _grouped(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """Rows x[N, in] in groups of `sizes` through the stack w[E, in, out] -> f32[N, out] (in
    W's dtype, widened, as `_matmul`)."""
    return jax.lax.ragged_dot(x.astype(w.dtype), w, sizes).astype(jnp.float32)


# expert_matmul(rows f[N, in], w f8[E, in, out], scales f32[E, in/ga, out/gb], group_sizes
# i32[E], *, up=None, out_dtype=f32, row_scales=None, row_weights=None) -> out_dtype[N, out]:
# rows sorted by expert through their expert's block-scaled weights, read as fp8
# (cp_runtime.kernels.expert_matmul); with up=(w_up, scales_up), silu(rows . w) * (rows . w_up)
# from one pass over the rows; each row's result times its row weight. None: the XLA paths
# below.
ExpertMatmulFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _routed_experts(p: Params, x: jax.Array, chosen: jax.Array, weights: jax.Array,
                    expert_matmul: ExpertMatmulFn | None = None, by_expert: bool = False,
                    fp8: Fp8Rows | None = None, beside: Any = (),
                    ws: WeightShards = WeightShards()) -> tuple[jax.Array, Any]:
    """x f[T, hidden], chosen i32[T, k], weights f32[T, k] -> f[T, hidden] (bf16 through
    `expert_matmul`, else x's dtype): each token through its k experts, weighted. Split
    weights hold a slice of every expert's inner features, so this is the device's partial
    sum; the others add theirs.

    The T*k (token, expert) pairs are sorted by expert and grouped matmuls run each group
    through its expert: `expert_matmul` straight from the fp8 blocks (gate and up in one
    call, which reads the rows once), or `jax.lax.ragged_dot` over the weights in their dtype
    (bf16 dequantised, when block-scaled). The kernel's rows are gathered in bf16, its input
    dtype: the [T*k, hidden] arrays are the layer's largest (k rows a token). The down
    projection's outputs leave the kernel in bf16 and the scatter-add sums them in bf16, as
    vLLM's fused MoE keeps its per-expert outputs and their sum: f32 outputs were a
    [T*k, hidden] array written and read again every MoE layer, and bf16 outputs summed in
    f32 cost XLA:TPU a conversion pass of its own (docs/notes/2026-12-03-experts.md,
    "The experts' down products in bf16"). The sum stays bf16 until `mlp` adds the shared
    experts' f32 output. (Gathered back to token order and summed in f32 instead, XLA fused
    the gather into the sum, slower.) The routing weights scale the down projection's inputs
    ([T*k, inner]) rather than its outputs (XLA:TPU wrote and read those again in f32 for the
    product): the gated call multiplies each row's product by its weight and writes it in
    bf16, the down projection's input dtype (a pass of XLA's own before), and a
    scatter-add sums each token's k rows (a gather back to token order instead ran 2x
    slower in XLA:TPU's estimate). `by_expert`: each token's choices come in ascending
    expert order, so one token's are sorted already (XLA ran the sort as four ops). `fp8`:
    x's rows as `fp8_rows` (f8[T, hidden], f32[T, 1]), which the kernel's rows are gathered
    from instead, at half the bytes. Returns (the sum, beside), beside tied to the gated
    products (`routed_experts`). In expert groups (`ws.expert_groups`) the device runs only
    its group's pairs (cp_runtime.model.expert_groups)."""
    n_experts = p[EXPERTS.format("gate")].shape[0]
    run = expert_rows(p, x, expert_matmul, fp8)
    out = jnp.zeros(x.shape, x.dtype if expert_matmul is None else jnp.bfloat16)
    presorted = by_expert and chosen.shape[0] == 1
    if ws.expert_groups > 1:
        capacity = expert_groups.rows_per_pass(chosen.size, ws.expert_groups)
        return expert_groups.routed_in_group(chosen, weights, ws.first_expert(n_experts),
                                             n_experts, run, out, beside, capacity, presorted)
    flat = chosen.reshape(-1)                                    # [T*k]
    order = jnp.arange(flat.shape[0]) if presorted else jnp.argsort(flat, stable=True)
    token = order // chosen.shape[-1]                            # source token of each row
    sizes = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    y, beside = run(token, weights.reshape(-1)[order, None], sizes, beside)
    return out.at[token].add(y), beside


def expert_rows(p: Params, x: jax.Array, expert_matmul: ExpertMatmulFn | None,
                 fp8: Fp8Rows | None) -> expert_groups.RunFn:
    """run(token i32[N], routing f32[N, 1], sizes i32[E], beside) -> (y [N, hidden], beside):
    rows x[token] (or fp8's), sorted by expert, through their experts' SwiGLU
    (`_routed_experts`), each row's down-projection input times its routing weight; beside
    tied to the gated products."""
    gate, up, down = (EXPERTS.format(proj) for proj in ("gate", "up", "down"))
    if expert_matmul is None:
        def xla(token, routing, sizes, beside):
            rows = x[token]                                      # [N, hidden]
            h = jax.nn.silu(_grouped(rows, weight(p, gate), sizes)) * _grouped(
                rows, weight(p, up), sizes)                      # [N, inner] f32
            h, beside = _tied(h, beside)
            return _grouped(h * routing, weight(p, down), sizes), beside  # down is linear
        return xla

    def blocks(key: str) -> tuple[jax.Array, jax.Array]:
        return p[key], p[key + SCALE_SUFFIX]

    def kernel(token, routing, sizes, beside):
        gated = functools.partial(expert_matmul, up=blocks(up), row_weights=routing,
                                  out_dtype=jnp.bfloat16)              # gate and up at once
        if fp8 is None:
            h = gated(x.astype(jnp.bfloat16)[token], *blocks(gate), sizes)
        else:
            h = gated(fp8.values[token], *blocks(gate), sizes, row_scales=fp8.scales[token])
        h, beside = _tied(h, beside)
        return expert_matmul(h, *blocks(down), sizes, out_dtype=jnp.bfloat16), beside
    return kernel


def _tied(h: jax.Array, beside: Any) -> tuple[jax.Array, Any]:
    """(h, beside) through one `lax.optimization_barrier`; as they are where beside holds no
    array (no barrier then between the gated products and the down projection)."""
    if not jax.tree_util.tree_leaves(beside):
        return h, beside
    return jax.lax.optimization_barrier((h, beside))


# Without an expert_matmul kernel (the XLA path: CPU), steps of at most this many tokens with
# block-scaled (fp8) experts run every expert on every token straight from its fp8
# blocks (`_every_expert`): each expert's weights are read once, as fp8. Longer steps group the
# tokens by expert (`_routed_experts`), whose ragged matmuls need the weights dequantised
# first: a bf16 copy of every expert, written and read again each step, which a prefill
# chunk's thousands of tokens amortise and a decode step cannot.
EVERY_EXPERT_MAX_ROWS = 64


def _experts_from_blocks(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    """x f[T, in] (one input for every expert) or f[T, E, in] (one each), through every expert
    of w f8[E, in, out] with block scales s f32[E, in / gi, out / go] -> f32[T, E, out].

    Per input block k: x_k . w_k as a bf16 matmul (fp8 values are exact in bf16, and XLA reads
    the fp8 blocks straight into it; its result rounded to bf16, as `_matmul`'s), times its
    block's scale in f32, summed over the blocks:
    y[t, e, o] = sum_k s[e, k, o / go] sum_c x[t, k, c] w[e, k, c, o]."""
    e, a, b = w.shape
    gi, go = a // s.shape[-2], b // s.shape[-1]
    xb = x.astype(jnp.bfloat16).reshape(*x.shape[:-1], a // gi, gi)     # [T, (E,) K, gi]
    wb = w.reshape(e, a // gi, gi, b).astype(jnp.bfloat16)              # [E, K, gi, out]
    spec = "tkc,ekco->teko" if x.ndim == 2 else "tekc,ekco->teko"
    part = jnp.einsum(spec, xb, wb).astype(jnp.float32)                 # [T, E, K, out]
    part = part.reshape(*part.shape[:3], b // go, go) * s[None, :, :, :, None]
    return part.sum(2).reshape(x.shape[0], e, b)


def _every_expert(p: Params, x: jax.Array, chosen: jax.Array, weights: jax.Array,
                  first: jax.Array | int = 0) -> jax.Array:
    """`_routed_experts`' result for block-scaled experts and few tokens: every expert on every
    token from its fp8 blocks, each token's outputs weighted by its routing weight for that
    expert (zero where the token did not choose it, or where the expert is not one of the
    device's, first .. first + E)."""
    n_experts = p[EXPERTS.format("gate")].shape[0]
    gate = (jax.nn.one_hot(chosen - first, n_experts, dtype=weights.dtype)
            * weights[..., None]).sum(-2)                               # [T, E]

    def through(proj: str, h: jax.Array) -> jax.Array:
        key = EXPERTS.format(proj)
        return _experts_from_blocks(h, p[key], p[key + SCALE_SUFFIX])

    h = jax.nn.silu(through("gate", x)) * through("up", x)              # [T, E, inner]
    return (through("down", h) * gate[..., None]).sum(1)                # [T, hidden]


class MlpInput(NamedTuple):
    """The MLP's input rows (`mlp_input`).

    x:      f[..., hidden], the rows
    fp8:    the same rows as `fp8_rows` (f8[..., hidden], f32[..., 1]), or None. With them,
            the SwiGLUs and the experts' kernel take these, and x is their dequantised copy,
            which only the experts' XLA paths read
    routed: (chosen i32[T, k], weights f32[T, k]) of a MoE layer, routed from the rows before
            they were rounded to fp8, or None (x is routed)
    """

    x: jax.Array
    fp8: Fp8Rows | None = None
    routed: tuple[jax.Array, jax.Array] | None = None


def mlp(p: Params, cfg: ModelConfig, layer: int, x: jax.Array | MlpInput,
        ws: WeightShards = WeightShards(), expert_matmul: ExpertMatmulFn | None = None,
        *, join: bool = True) -> jax.Array:
    """Dense SwiGLU, or MoE: the routed experts (`routed_experts`) plus the shared experts
    (`plus_shared_experts`). Split weights give partial sums, joined once (into this device's
    rows where the rows are split: `WeightShards.join_rows`), or left for the caller to join
    (`join` False). `expert_matmul` runs block-scaled experts from their fp8 blocks (kernels),
    from x's fp8 rows where it has them (`MlpInput`)."""
    rows = x if isinstance(x, MlpInput) else MlpInput(x)
    finish = ws.join_rows if join else (lambda partial: partial)
    if not cfg.is_moe_layer(layer):
        return finish(_swiglu(p, "mlp", _swiglu_rows(rows)))
    routed, _ = routed_experts(p, cfg, rows, expert_matmul, ws=ws)
    return finish(plus_shared_experts(p, cfg, routed, rows))


def _swiglu_rows(rows: MlpInput) -> jax.Array | Fp8Rows:
    """What the SwiGLUs (dense and shared) take: the fp8 rows where there are some."""
    return rows.x if rows.fp8 is None else rows.fp8


def routed_experts(p: Params, cfg: ModelConfig, rows: MlpInput,
                   expert_matmul: ExpertMatmulFn | None = None, beside: Any = (),
                   ws: WeightShards = WeightShards()) -> tuple[jax.Array, Any]:
    """A MoE layer's routed experts over rows.x f[..., hidden] -> (the (device's partial)
    sum f[..., hidden], beside): each token through its k experts only (`route_topk`), of
    the device's experts (all, or its group's: `ws.expert_groups`).
    beside: values tied (`lax.optimization_barrier`) to the rows' gated products where the
    rows are grouped by expert, so that the work making them (a collective) runs beside the
    gate and up projections; elsewhere handed back as they came."""
    x = rows.x
    flat = x.reshape(-1, x.shape[-1])
    if rows.routed is None:
        chosen, weights, by_expert = _routed(p, cfg, flat)              # [T, k] each
    else:
        (chosen, weights), by_expert = rows.routed, False
    if EXPERTS.format("gate") + SCALE_SUFFIX not in p:
        out, beside = _routed_experts(p, flat, chosen, weights, beside=beside, ws=ws)
    elif expert_matmul is not None:
        fp8 = None if rows.fp8 is None else Fp8Rows(
            *(a.reshape(-1, a.shape[-1]) for a in rows.fp8))
        out, beside = _routed_experts(p, flat, chosen, weights, expert_matmul, by_expert, fp8,
                                      beside, ws)
    elif flat.shape[0] <= EVERY_EXPERT_MAX_ROWS:
        first = ws.first_expert(p[EXPERTS.format("gate")].shape[0])
        out = _every_expert(p, flat, chosen, weights, first)
    else:
        out, beside = _routed_experts(p, flat, chosen, weights, beside=beside, ws=ws)
    return out.reshape(x.shape), beside


def plus_shared_experts(p: Params, cfg: ModelConfig, routed: jax.Array, rows: MlpInput
                        ) -> jax.Array:
    """A MoE layer's routed sum f[..., hidden] plus its shared experts' SwiGLU of rows (where
    it has some), in rows.x's dtype."""
    if cfg.n_shared_experts:
        if int(np.prod(routed.shape[:-1])) > LINEAR_KERNEL_MAX_ROWS:
            # The routed sum whole before the shared experts' is added: in XLA's form, XLA:TPU
            # else began the routed rows' scatter-add from the shared experts' output and cast
            # the sum to the wire's bf16 in a pass of its own; so the add and the cast fuse
            # into the shared down projection (docs/notes/2026-12-03-experts.md,
            # "The routed experts' sum whole before the shared experts' is added"). The
            # kernel takes the sum whole anyway.
            routed = jax.lax.optimization_barrier(routed)
        routed = _plus_shared_experts(p, routed, _swiglu_rows(rows))
    return routed.astype(rows.x.dtype)


SHARED = "mlp.shared_experts.{}_proj.weight"


def _shared_kernel_takes(p: Params, routed: jax.Array, rows: jax.Array | Fp8Rows) -> bool:
    """Whether a TPU adds the shared experts in their kernel (kernels/shared_expert.py): a
    prefill's many fp8 rows (more than LINEAR_KERNEL_MAX_ROWS), a bf16 routed sum, and
    block-scaled weights the kernel tiles."""
    if not isinstance(rows, Fp8Rows) or routed.dtype != jnp.bfloat16:
        return False
    t = int(np.prod(routed.shape[:-1]))
    gate, down = SHARED.format("gate"), SHARED.format("down")
    if t <= LINEAR_KERNEL_MAX_ROWS or gate + SCALE_SUFFIX not in p:
        return False
    return shared_expert.supports(t, p[gate].shape, p[gate + SCALE_SUFFIX].shape,
                                  p[down].shape, p[down + SCALE_SUFFIX].shape)


def _plus_shared_experts(p: Params, routed: jax.Array, rows: jax.Array | Fp8Rows) -> jax.Array:
    """routed f[..., hidden] plus the shared experts' SwiGLU of rows -> f32. On a TPU, a
    prefill's fp8 rows take the kernel, which adds them to the bf16 routed sum and writes the
    sum once, in bf16 (XLA:TPU fused the down projection, the add and the wire's cast into one
    pass priced at about three times the kernel's roofline; docs/notes/2026-12-03-experts.md,
    "The shared experts in one kernel"); elsewhere XLA, in f32."""
    xla = lambda routed, rows: routed + _swiglu(p, "mlp.shared_experts", rows)  # noqa: E731
    if not _shared_kernel_takes(p, routed, rows):
        return xla(routed, rows)
    blocks = [a for proj in ("gate", "up", "down")
              for a in (p[SHARED.format(proj)], p[SHARED.format(proj) + SCALE_SUFFIX])]
    hidden = routed.shape[-1]

    def kernel(routed, rows):
        out = shared_expert.shared_expert(rows.values.reshape(-1, rows.values.shape[-1]),
                                          rows.scales.reshape(-1, 1),
                                          routed.reshape(-1, hidden), *blocks)
        return out.reshape(routed.shape).astype(jnp.float32)

    return jax.lax.platform_dependent(routed, rows, tpu=kernel, default=xla)


# project(o_lat f32[..., H', kv_lora] of this device's heads) -> f[..., hidden] (`mla_output`;
# `OutputProjection` also takes exchanged partials)
ProjectFn = Callable[[jax.Array], jax.Array]
# attend(layer, state, q_row, kv_row, index_or_None, project) -> (attention output f[..., hidden]
# complete on every device, state)
AttendFn = Callable[[int, Any, jax.Array, jax.Array, IndexerInputs | None, ProjectFn],
                    tuple[jax.Array, Any]]


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, pos: jax.Array,
            attend: AttendFn, state: Any, ws: WeightShards = WeightShards(),
            expert_matmul: ExpertMatmulFn | None = None) -> tuple[jax.Array, Any]:
    """Run the decoder over tokens i32[...] at positions i32[...]; returns (hidden, state).

    `params` are in the model layout; `hidden` f[..., hidden] is after the final norm and
    `logits(params, hidden, ws)` projects it. The attention callback gets the output
    projection so the merge can choose where the partial results meet (cp_runtime.parallel.merge).
    `expert_matmul` runs block-scaled experts from their fp8 blocks (`mlp`; None: XLA).
    """
    with phase("dense"):
        x = embed(params, tokens, ws)
    for layer in range(cfg.num_hidden_layers):
        with layer_scope(layer):
            x, state = _layer(params, cfg, layer, x, pos, attend, state, ws, expert_matmul)
    with phase("dense"):
        hidden = rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps)
        return ws.gather_rows(hidden, tokens.shape), state


def _layer(params: Params, cfg: ModelConfig, layer: int, x: jax.Array, pos: jax.Array,
           attend: AttendFn, state: Any, ws: WeightShards,
           expert_matmul: ExpertMatmulFn | None) -> tuple[jax.Array, Any]:
    """One decoder layer: x f[..., hidden] -> (x after its attention and MLP, state). Where
    the rows are split (`WeightShards.rows_split`), x is this device's rows f[R / S, hidden]:
    the norms and `row_features` run on them, and what the heads and experts need of every
    row is gathered (the attention's and the MLP's sums come back reduce-scattered)."""
    p = attention_weights(layer_params(params, layer), cfg, layer, ws)
    out, state = attention_block(p, cfg, layer, x, pos, attend, state, ws)
    with phase("dense"):
        x = x + out
        return x + mlp(p, cfg, layer, mlp_input(p, cfg, layer, x, pos, ws), ws,
                       expert_matmul), state


def attention_block(p: Params, cfg: ModelConfig, layer: int, x: jax.Array, pos: jax.Array,
                    attend: AttendFn, state: Any, ws: WeightShards) -> tuple[jax.Array, Any]:
    """A layer's attention: x f[..., hidden] (this device's rows where they are split) ->
    (its output f[..., hidden], state). p: the layer's weights from `attention_weights`."""
    with phase("attention_inputs"):
        h = rms_norm(x, p["input_layernorm.weight"], cfg.rms_norm_eps)
        own_indexer = cfg.indexer_types[layer] == "full"
        rows = row_features(p, cfg, h, ws.own_rows(pos), indexer=own_indexer)
    if ws.whole_heads:
        q_row, kv_row, index = _own_rows_attention_inputs(p, cfg, rows, pos, ws, own_indexer)
    else:
        with phase("attention_inputs"):
            rows = ws.gather_rows_of(rows, pos.shape, wired=("q_lora",))  # q_lora feeds matmuls
            q_row, kv_row, q_lora = mla_inputs(p, cfg, None, pos, rows)
            index = (indexer_inputs(p, cfg, None, q_lora, pos, ws, rows) if own_indexer
                     else None)
    return attend(layer, state, q_row, kv_row, index, OutputProjection(p, cfg))


def mlp_input(p: Params, cfg: ModelConfig, layer: int, x: jax.Array, pos: jax.Array,
              ws: WeightShards) -> MlpInput:
    """The MLP's input: x f[..., hidden] after the attention, normed, every row of it where
    the rows are split: gathered on the wire, or with `WeightShards.mlp_rows` "fp8" as
    `fp8_rows`, each device routing its own rows first (a MoE layer's router takes them
    unrounded) and gathering their choices beside the rows' scales."""
    h = rms_norm(x, p["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    if not (ws.rows_split and ws.mlp_rows == "fp8"):
        return MlpInput(ws.gather_rows(h, pos.shape, wire=True))
    own = fp8_rows.quantize(h)                                  # [R / S, hidden], [R / S, 1]
    side = [own.scales]
    k = cfg.num_experts_per_tok
    if cfg.is_moe_layer(layer):
        chosen, weights, _ = _routed(p, cfg, h)
        side += [chosen.astype(jnp.float32), weights]           # expert ids exact in f32
    every = ws.gather_rows(jnp.concatenate(side, -1), pos.shape)      # [B, Q, 1 (+ 2k)]
    rows = Fp8Rows(ws.gather_rows(own.values, pos.shape), every[..., :1])
    routed = None
    if cfg.is_moe_layer(layer):
        routed = (every[..., 1:1 + k].reshape(-1, k).astype(jnp.int32),
                  every[..., 1 + k:].reshape(-1, k))
    return MlpInput(fp8_rows.dequantize(rows), rows, routed)


# The attention's weights split by head (cp_runtime.weights.sharding), which a device that
# attends every head of its own rows (`WeightShards.whole_heads`) gathers whole: those that
# make its q (and take it into the latent space), and the one that takes its heads to hidden
# space.
QUERY_SPLIT_WEIGHTS = ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight")
OUTPUT_SPLIT_WEIGHT = "self_attn.o_proj.weight"
HEAD_SPLIT_WEIGHTS = (*QUERY_SPLIT_WEIGHTS, OUTPUT_SPLIT_WEIGHT)
# The indexer's query weight, split by indexer head; gathered whole with q_b and kv_b in a
# layer with its own indexer, so a device makes every indexer head of its own rows too.
INDEXER_Q_WEIGHT = "self_attn.indexer.wq_b.weight"


def attention_weights(p: Params, cfg: ModelConfig, layer: int, ws: WeightShards) -> Params:
    """Layer `layer`'s weights p as its attention takes them: where each device attends every
    head of its own rows (`WeightShards.whole_heads`), the head-split ones gathered whole
    (`query_weights`, `output_weights`)."""
    return output_weights(query_weights(p, cfg, layer, ws), cfg, ws)


def query_weights(p: Params, cfg: ModelConfig, layer: int, ws: WeightShards) -> Params:
    """p with the head-split weights that make q gathered whole where each device attends
    every head of its own rows: q_b, kv_b and, in a layer with its own indexer, wq_b
    (`_own_rows_attention_inputs`); with their scales."""
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


def _own_rows_attention_inputs(p: Params, cfg: ModelConfig, rows: dict[str, jax.Array],
                               pos: jax.Array, ws: WeightShards, own_indexer: bool):
    """`attention_block`'s inputs where each device attends every head of its own rows from
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
            index = IndexerInputs(q=_indexer_queries(p, cfg, q_lora, own_pos),
                                  w=every["index_w"], k=every["index_k"], rows=pos.shape)
    return q_row, every["kv_row"], index


def logits(params: Params, hidden: jax.Array, ws: WeightShards = WeightShards(),
           vocab_size: int | None = None) -> jax.Array:
    """hidden f[..., hidden] -> f32[..., V]; split by vocabulary, each device's logits are
    gathered and `vocab_size` (required then) cuts the padded rows' logits off."""
    head = weight(params, "lm_head.weight" if "lm_head.weight" in params
                  else "model.embed_tokens.weight")
    out = _linear(hidden, head)
    if not ws.split:
        return out
    if vocab_size is None:
        raise ValueError("logits of a vocabulary split over devices need vocab_size")
    return ws.gather(out, -1, vocab_size)
