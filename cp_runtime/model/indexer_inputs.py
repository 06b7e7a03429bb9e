"""The DSA indexer's inputs: its query heads, head weights and key for each token.

  q_i = Hadamard(RoPE(W_iq q_lora));  k_i = Hadamard(RoPE(LayerNorm(W_ik x)))
  w = W_w x * Hi^-0.5 * Di^-0.5;  I(t, s) = sum_h w_h(t) ReLU(q_i,h(t) . k_i(s))

The scores I and the selection they make run in the attention (cp_runtime.model.attention);
the key and weights come from the weights every device holds whole
(cp_runtime.model.attention_inputs.row_features), the query heads from wq_b, split by head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cp_runtime.config import ModelConfig
from cp_runtime.kernels import fp8_rows
from cp_runtime.model.ops import hadamard, layer_norm, linear, rope, rope_frequencies, rope_mscale
from cp_runtime.weights.params import Params
from cp_runtime.weights.shards import WeightShards

__all__ = ["IndexerInputs", "INDEXER_Q_WEIGHT", "indexer_rope", "indexer_keys",
           "indexer_weights", "indexer_queries"]

# The indexer's query weight, split by indexer head.
INDEXER_Q_WEIGHT = "self_attn.indexer.wq_b.weight"


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
        fp8 scoring takes them (Strategy.indexer_scores): rounded where they are made,
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


def indexer_rope(x: jax.Array, pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rope on the first (or last) qk_rope_head_dim dims of x f[..., Di]: neox-style halves, or
    interleaved pairs when cfg.index_rope_interleaved (GLM-5's `indexer_rope_interleave`)."""
    r = cfg.qk_rope_head_dim
    freqs, mscale = rope_frequencies(cfg), rope_mscale(cfg)
    kw = dict(interleaved=cfg.index_rope_interleaved, mscale=mscale)
    if cfg.index_rope_first:
        return jnp.concatenate([rope(x[..., :r], pos, freqs, **kw), x[..., r:]], -1)
    return jnp.concatenate([x[..., :-r], rope(x[..., -r:], pos, freqs, **kw)], -1)


def indexer_keys(p: Params, cfg: ModelConfig, projected: jax.Array, pos: jax.Array
                 ) -> jax.Array:
    """The projected keys W_ik x f32[..., Di] at positions pos i32[...] -> the cached keys
    f32[..., Di]: LayerNorm, rope, Hadamard (where the config has it)."""
    k = layer_norm(projected, p["self_attn.indexer.k_norm.weight"],
                   p["self_attn.indexer.k_norm.bias"], 1e-6)
    k = indexer_rope(k, pos, cfg)
    return hadamard(k) if cfg.index_hadamard else k


def indexer_weights(cfg: ModelConfig, projected: jax.Array) -> jax.Array:
    """The projected head weights W_w x f32[..., Hi], scaled by Hi^-0.5 Di^-0.5."""
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    return projected * (hi ** -0.5 * di ** -0.5)


def indexer_queries(p: Params, cfg: ModelConfig, q_lora: jax.Array, pos: jax.Array
                    ) -> jax.Array:
    """q_lora f[..., R] -> the indexer's query heads f32[..., Hi', Di] of the wq_b p holds:
    this device's heads, or every head (a whole wq_b: its padding heads cut off)."""
    q = linear(p, INDEXER_Q_WEIGHT, q_lora)
    # A whole wq_b holds the zero heads that pad Hi to a multiple of S; a device's part
    # holds at most Hi, so the cut only ever drops padding.
    q = q.reshape(*q_lora.shape[:-1], -1, cfg.index_head_dim)[..., :cfg.index_n_heads, :]
    q = indexer_rope(q, pos, cfg)
    return hadamard(q) if cfg.index_hadamard else q
