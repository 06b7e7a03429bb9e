"""A MoE layer's router: which k experts each token goes to, and with what weight.

  sigmoid scores s, biased b = s + e_score_correction_bias; groups limit the choice (keep
  topk_group of n_group groups by the sum of their two best b), top-k of b among them; weights
  s over the chosen, normalised (norm_topk_prob), times routed_scaling.

The router's weights are whole on every device (cp_runtime.weights.sharding): every device
routes every token it holds, and the same tokens route the same way everywhere.
"""

from __future__ import annotations

import jax

from cp_runtime.config import ModelConfig
from cp_runtime.kernels import reference
from cp_runtime.kernels.dispatch import MODEL_KERNELS
from cp_runtime.model.ops import xla_linear
from cp_runtime.weights.params import Params

__all__ = ["routing_keywords", "top_k_experts", "route_tokens", "dense_expert_weights"]


def routing_keywords(cfg: ModelConfig) -> dict:
    """The model's routing as `reference.route_topk`'s keywords (kernels/router.py's too)."""
    return dict(k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                norm=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)


def top_k_experts(cfg: ModelConfig, logits: jax.Array, bias: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """Router logits f32[..., E] and correction bias f32[E] -> (chosen experts i32[..., k],
    their weights f32[..., k]), k = num_experts_per_tok (`reference.route_topk`)."""
    return reference.route_topk(logits, bias, **routing_keywords(cfg))


def route_tokens(p: Params, cfg: ModelConfig, x: jax.Array
                 ) -> tuple[jax.Array, jax.Array, bool]:
    """x f[T, hidden] -> (chosen i32[T, k], weights f32[T, k], by_expert): the router's
    logits (its weights whole on every device) and `top_k_experts`. A step of few tokens may
    take kernels/router.py (`ModelKernels.route`); its choices then come in ascending expert
    order on every platform (by_expert True)."""
    gate, bias = p["mlp.gate.weight"], p["mlp.gate.e_score_correction_bias"]

    def in_xla(x: jax.Array, gate: jax.Array, bias: jax.Array):
        return reference.by_expert(*top_k_experts(cfg, xla_linear(x, gate), bias))

    return MODEL_KERNELS.route(
        x, gate, bias, k=cfg.num_experts_per_tok, keywords=routing_keywords(cfg), xla=in_xla,
        without_kernel=lambda: top_k_experts(cfg, xla_linear(x, gate), bias))


def dense_expert_weights(cfg: ModelConfig, logits: jax.Array, bias: jax.Array) -> jax.Array:
    """`top_k_experts` as dense expert weights f32[..., E], zero off the chosen experts."""
    chosen, weights = top_k_experts(cfg, logits, bias)
    one_hot = jax.nn.one_hot(chosen, cfg.n_routed_experts, dtype=weights.dtype)  # [..., k, E]
    return (weights[..., None] * one_hot).sum(-2)
