"""A layer's MLP: a dense SwiGLU, or MoE, the routed experts (cp_runtime.model.expert_router
chooses, cp_runtime.model.moe runs them) plus the shared experts' SwiGLU.

Weights are whole or split over a mesh axis (cp_runtime.weights.sharding): the router is whole on
every device; the dense MLP (row-parallel down), the routed experts (each device holds a slice
of every expert's inner features: gate/up column parallel, down row parallel) and the shared
experts give partial sums, which `mlp` joins (`WeightShards.join_rows`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from cp_runtime.config import ModelConfig
from cp_runtime.kernels import fp8_rows
from cp_runtime.kernels.dispatch import MODEL_KERNELS
from cp_runtime.kernels.fp8_rows import Fp8Rows
from cp_runtime.model.moe import EXPERTS, ExpertMatmulFn, every_expert, pairs_by_expert
from cp_runtime.model.ops import linear, rms_norm
from cp_runtime.model.expert_router import route_tokens
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.params import Params
from cp_runtime.weights.shards import WeightShards

__all__ = ["MlpInput", "mlp_input", "mlp", "swiglu", "routed_experts", "plus_shared_experts",
           "shared_experts_sum", "SHARED"]

# A MoE layer's shared experts, by projection.
SHARED = "mlp.shared_experts.{}_proj.weight"


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
        chosen, weights, _ = route_tokens(p, cfg, h)
        side += [chosen.astype(jnp.float32), weights]           # expert ids exact in f32
    every = ws.gather_rows(jnp.concatenate(side, -1), pos.shape)      # [B, Q, 1 (+ 2k)]
    rows = Fp8Rows(ws.gather_rows(own.values, pos.shape), every[..., :1])
    routed = None
    if cfg.is_moe_layer(layer):
        routed = (every[..., 1:1 + k].reshape(-1, k).astype(jnp.int32),
                  every[..., 1 + k:].reshape(-1, k))
    return MlpInput(fp8_rows.dequantize(rows), rows, routed)


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
        return finish(swiglu(p, "mlp", _swiglu_rows(rows)))
    routed, _ = routed_experts(p, cfg, rows, expert_matmul, ws=ws)
    return finish(plus_shared_experts(p, cfg, routed, rows))


def _swiglu_rows(rows: MlpInput) -> jax.Array | Fp8Rows:
    """What the SwiGLUs (dense and shared) take: the fp8 rows where there are some."""
    return rows.x if rows.fp8 is None else rows.fp8


def swiglu(p: Params, prefix: str, x: jax.Array | Fp8Rows) -> jax.Array:
    """down(silu(gate x) * up x) through the weights `prefix`.{gate,up,down}_proj -> f32."""
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


def routed_experts(p: Params, cfg: ModelConfig, rows: MlpInput,
                   expert_matmul: ExpertMatmulFn | None = None, beside: Any = (),
                   ws: WeightShards = WeightShards()) -> tuple[jax.Array, Any]:
    """A MoE layer's routed experts over rows.x f[..., hidden] -> (the (device's partial)
    sum f[..., hidden], beside): each token through its k experts only (`route_tokens`), of
    the device's experts (all, or its group's: `ws.expert_groups`), grouped by expert
    (`moe.pairs_by_expert`) or, for few tokens, every expert on every token
    (`moe.every_expert`), as `ModelKernels.routed_experts` chooses.
    beside: values tied (`lax.optimization_barrier`) to the rows' gated products where the
    rows are grouped by expert, so that the work making them (a collective) runs beside the
    gate and up projections; elsewhere handed back as they came."""
    x = rows.x
    flat = x.reshape(-1, x.shape[-1])
    if rows.routed is None:
        chosen, weights, by_expert = route_tokens(p, cfg, flat)         # [T, k] each
    else:
        (chosen, weights), by_expert = rows.routed, False

    def grouped(matmul: ExpertMatmulFn | None) -> tuple[jax.Array, Any]:
        if matmul is None:
            return pairs_by_expert(p, flat, chosen, weights, beside=beside, ws=ws)
        fp8 = None if rows.fp8 is None else Fp8Rows(
            *(a.reshape(-1, a.shape[-1]) for a in rows.fp8))
        return pairs_by_expert(p, flat, chosen, weights, matmul, by_expert, fp8, beside, ws)

    def every() -> tuple[jax.Array, Any]:
        first = ws.first_expert(p[EXPERTS.format("gate")].shape[0])
        return every_expert(p, flat, chosen, weights, first), beside

    out, beside = MODEL_KERNELS.routed_experts(
        flat.shape[0], block_scaled=EXPERTS.format("gate") + SCALE_SUFFIX in p,
        expert_matmul=expert_matmul, grouped=grouped, every_expert=every)
    return out.reshape(x.shape), beside


def plus_shared_experts(p: Params, cfg: ModelConfig, routed: jax.Array, rows: MlpInput
                        ) -> jax.Array:
    """A MoE layer's routed sum f[..., hidden] plus its shared experts' SwiGLU of rows (where
    it has some), in rows.x's dtype."""
    if cfg.n_shared_experts:
        routed = shared_experts_sum(p, MODEL_KERNELS.routed_sum_whole(routed),
                                    _swiglu_rows(rows))
    return routed.astype(rows.x.dtype)


def shared_experts_sum(p: Params, routed: jax.Array, rows: jax.Array | Fp8Rows) -> jax.Array:
    """routed f[..., hidden] plus the shared experts' SwiGLU of rows -> f32: in XLA, in f32,
    or where `ModelKernels.shared_experts` takes them (a prefill's fp8 rows on a TPU) one
    kernel that adds them to the bf16 routed sum and writes the sum once."""
    blocks = [x for proj in ("gate", "up", "down")
              for x in (p[SHARED.format(proj)], p.get(SHARED.format(proj) + SCALE_SUFFIX))]
    return MODEL_KERNELS.shared_experts(
        routed, rows, blocks,
        lambda routed, rows: routed + swiglu(p, "mlp.shared_experts", rows))
