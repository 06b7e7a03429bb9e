"""A prefill chunk as two halves of its rows, interleaved layer by layer, so that each half's
collectives run beside the other half's compute.

Where a chunk's rows are split over the devices and each device attends every head of its
own rows (`WeightShards.whole_heads`), a layer is one chain: the attention, the MLP's input
all-gathered, the experts, their sums reduce-scattered, the next layer's attention. Nothing
runs beside the all-gather or the reduce-scatter but what XLA:TPU finds off that chain, and
it found almost nothing: the compiled chunk left the MLP's collectives exposed
(docs/notes/2026-12-05-prefill-schedule.md, "Two halves of a chunk").

Cut by position, the rows make two chains: half A is the first half of every row's queries,
half B the rest, and B depends on A only where B's queries attend A's rows (the cache and
the gathered pages, written by A first). Each half's collective is tied
(`lax.optimization_barrier`) to a piece of the other half's work, so that the scheduler
keeps the collective in flight across it:

    A's attention   beside  B's reduce-scatter (of the layer before)
    B's attention   beside  A's all-gather
    A's experts     beside  B's all-gather (a MoE layer: A's gate and up kernel)
    B's experts     beside  A's reduce-scatter (a MoE layer: B's routed experts)

Left to itself (the same halves, untied) the scheduler hid about a fifth of them. The price:
every weight of a layer is read twice, by kernels of half the rows. The values are the
unsplit step's: each row's math is the same, and B sees A's rows as it would in one pass.

The pages' all-gather of a layer (gather_kv: the pages as the step found them, `ShardAttention.
every_page`) depends on nothing the step computes, and at a million tokens it is the largest
collective left, which XLA:TPU issued after the layer's indexer kernel with almost nothing
beside it. So each layer's pages are gathered ahead, at the start of an earlier layer, and
tied to a piece of that layer's work (`ShardState.ahead`):

    a layer with its own indexer   its own pages beside half A's indexer kernel, the next
                                   layer's (where shared) beside half B's; with 32K chunks
                                   the two shared layers after those too, one beside each
    a shared layer after those     at the start of the layer two before it, beside that
                                   layer's B attention (tied with A's MLP input)

The indexer's cost grows with the context as the pages' gather does, and a 16K chunk's
half-kernel in fp8 outlasts about one page gather: the two kernels of a layer with its own
indexer take two, and the shared layers' gathers are spread over the group's layers
(docs/notes/2026-12-05-prefill-schedule.md, "The pages gathered two layers ahead"), each
buffer held for two layers. The kernel grows with the chunk's queries too, the gather does
not: a 32K chunk's kernels take four (`ahead_layers`), GLM-5.2's whole group of one full
layer and three shared ones.

The head-split weights that make a layer's q (q_b, kv_b, and wq_b in a layer with its own
indexer: `attention_inputs.query_weights`) depend on nothing either: they are gathered during the
layer before, tied with the chained pages (B's attention, A's MLP input), where in their own layer
its first kernels waited on them (docs/notes/2026-12-05-prefill-schedule.md,
"The q weights a layer ahead"). o_proj's gather, hidden beside its own layer's attention,
stays there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.config import ModelConfig
from cp_runtime.model.attention_inputs import (attention_weights, gathered_query_weights,
                                               output_weights, query_weights)
from cp_runtime.model.layers import AttendFn, attention_block
from cp_runtime.model.mlp import MlpInput, mlp, mlp_input, plus_shared_experts, routed_experts
from cp_runtime.model.moe import ExpertMatmulFn
from cp_runtime.model.ops import embed, rms_norm
from cp_runtime.model.scopes import layer_scope, phase
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.params import Params, layer_params
from cp_runtime.weights.shards import WeightShards

__all__ = ["forward_in_halves", "halves_fit", "AHEAD_LAYERS", "AHEAD_QUERIES", "CHAIN_DISTANCE",
           "ahead_layers", "layers_gathered_ahead", "layers_gathered_in_chain"]

# Layers whose pages a layer with its own indexer gathers beside its two halves' indexer
# kernels, itself included, for each AHEAD_QUERIES of a chunk's queries: one beside each
# kernel a 16K chunk (`ahead_layers`).
AHEAD_LAYERS = 2
AHEAD_QUERIES = 16384
# How many layers before its own a shared layer past those has its pages gathered: two, so
# that each gather has a whole layer's work to run beside (one layer before left more of it
# exposed: docs/notes/2026-12-05-prefill-schedule.md, "The pages gathered two layers ahead").
# Each holds its gathered buffer, a layer's pages of the whole context, for that long.
CHAIN_DISTANCE = 2


def halves_fit(rows_shape: tuple[int, ...], num_shards: int) -> bool:
    """Whether a step's rows i32[B, Q] cut into halves of Q / 2 queries that each split
    evenly over the shards."""
    b, q = rows_shape
    return q % 2 == 0 and (b * q // 2) % num_shards == 0


def ahead_layers(queries: int) -> int:
    """How many layers' pages a layer with its own indexer gathers beside its two halves'
    indexer kernels, for a chunk of `queries` queries: AHEAD_LAYERS for each AHEAD_QUERIES,
    at least AHEAD_LAYERS. A half's kernel grows with its queries and the context, a page
    gather with the context alone: a 16K chunk's half-kernel outlasts about one gather, a 32K
    chunk's two (GLM-5.2's whole group of a full layer and three shared ones;
    docs/notes/2026-12-05-prefill-schedule.md,
    "A 32K chunk's indexer group gathered beside its kernels")."""
    return AHEAD_LAYERS * max(1, queries // AHEAD_QUERIES)


def layers_gathered_ahead(cfg: ModelConfig, layer: int, ahead: int = AHEAD_LAYERS
                          ) -> tuple[int, ...]:
    """The layers whose pages `layer` gathers beside its halves' indexer kernels: itself and
    the shared layers after it, at most `ahead` (`ahead_layers`); none where it has no
    indexer of its own."""
    if cfg.indexer_types[layer] != "full":
        return ()
    group = [layer]
    while (len(group) < ahead and group[-1] + 1 < cfg.num_hidden_layers
           and cfg.indexer_types[group[-1] + 1] != "full"):
        group.append(group[-1] + 1)
    return tuple(group)


def layers_gathered_in_chain(cfg: ModelConfig, layer: int, ahead: int = AHEAD_LAYERS
                             ) -> tuple[int, ...]:
    """The shared layer whose pages `layer` gathers beside its own work: the layer
    CHAIN_DISTANCE on, where it and the layers between share an indexer and the indexer's
    layer does not gather it beside its kernels (`ahead` of them); else none."""
    later = layer + CHAIN_DISTANCE
    if later >= cfg.num_hidden_layers or any(
            cfg.indexer_types[i] == "full" for i in range(layer + 1, later + 1)):
        return ()
    owner = max(i for i in cfg.full_layers if i < later)
    return () if later in layers_gathered_ahead(cfg, owner, ahead) else (later,)


def _gather_ahead(layers: tuple[int, ...], layer: int, attend: Any, state: Any) -> Any:
    """`state` with the pages of `layers` gathered by `attend` (a ShardAttention), each under
    its own layer's scope, and those of layers before `layer` (already run) dropped."""
    ahead = [(later, pages) for later, pages in state.ahead if later >= layer]
    for later in layers:
        with layer_scope(later):
            ahead.append((later, attend.every_page(state.latent[later])))
    return dataclasses.replace(state, ahead=tuple(ahead))


def _tie_ahead(state: Any, layers: tuple[int, ...], values: tuple) -> tuple[Any, tuple]:
    """(state, values), the gathered pages of `layers` tied (`lax.optimization_barrier`) to
    `values`, so that the gathers run beside the work that makes them."""
    ahead = dict(state.ahead)
    values, tied = lax.optimization_barrier((values, tuple(ahead[i] for i in layers)))
    ahead.update(zip(layers, tied))
    return dataclasses.replace(state, ahead=tuple(ahead.items())), values


def _query_weights_ahead(params: Params, cfg: ModelConfig, layer: int, ws: WeightShards
                         ) -> Params | None:
    """The next layer's weights with its q weights gathered (`attention_inputs.query_weights`), to
    be gathered during `layer`; None after the last layer."""
    if layer + 1 == cfg.num_hidden_layers:
        return None
    with layer_scope(layer + 1):
        return query_weights(layer_params(params, layer + 1), cfg, layer + 1, ws)


def _tie_weights(p: Params, names: tuple[str, ...], values: tuple) -> tuple[Params, tuple]:
    """(p, values), p's weights `names` and their scales tied (`lax.optimization_barrier`) to
    `values`, so that their gathers run beside the work that makes them."""
    tied = {k: v for k, v in p.items() if k.removesuffix(SCALE_SUFFIX) in names}
    values, tied = lax.optimization_barrier((values, tied))
    return {**p, **tied}, values


def _mlps(p: Params, cfg: ModelConfig, layer: int, rows: tuple[MlpInput, MlpInput],
          ws: WeightShards, expert_matmul: ExpertMatmulFn | None) -> tuple[jax.Array, jax.Array]:
    """(A's MLP sums joined into this device's rows, B's partial sums): in a MoE layer, B's
    all-gathered rows tied to A's gated products (`routed_experts`' beside), A's
    reduce-scatter to B's routed sum; a dense layer's all-gather to A's MLP and the
    reduce-scatter to B's.

    XLA:TPU starts a tied collective just before the last kernel ahead of its tie. Tied to
    whole MLPs, with the shared experts last in a short kernel of their own, B's all-gather
    and A's reduce-scatter had only that kernel beside them; tied as here, A's gate and up
    kernel runs beside the all-gather and B's two expert kernels beside the reduce-scatter
    (docs/notes/2026-12-03-experts.md, "The shared experts in one kernel")."""
    a_in, b_in = rows
    if not cfg.is_moe_layer(layer):
        a_partial = mlp(p, cfg, layer, a_in, ws, expert_matmul, join=False)
        b_in, a_partial = lax.optimization_barrier((b_in, a_partial))
        a_sum = ws.join_rows(a_partial)
        b_partial = mlp(p, cfg, layer, b_in, ws, expert_matmul, join=False)
        return lax.optimization_barrier((a_sum, b_partial))
    a_routed, b_in = routed_experts(p, cfg, a_in, expert_matmul, beside=b_in, ws=ws)
    a_sum = ws.join_rows(plus_shared_experts(p, cfg, a_routed, a_in))
    b_routed, _ = routed_experts(p, cfg, b_in, expert_matmul, ws=ws)
    a_sum, b_routed = lax.optimization_barrier((a_sum, b_routed))
    return a_sum, plus_shared_experts(p, cfg, b_routed, b_in)


def forward_in_halves(params: Params, cfg: ModelConfig, tokens: jax.Array, pos: jax.Array,
                      attends: tuple[AttendFn, AttendFn], state: Any, ws: WeightShards,
                      expert_matmul: ExpertMatmulFn | None = None) -> tuple[jax.Array, Any]:
    """`layers.forward` over tokens and pos i32[B, Q] as two halves of Q / 2 queries.

    attends: the attention callbacks of half A (pos[:, :Q/2]) and half B (pos[:, Q/2:]),
    each handing its gathered pages on (`ShardAttention.hands_over`). ws: rows split, each
    device attending every head of its own rows (`halves_fit` holds).
    returns: (hidden f[B, Q, hidden], state), as `layers.forward`.
    """
    if not (ws.rows_split and ws.whole_heads):
        raise ValueError("a chunk runs in halves only where each device attends every head "
                         "of its own rows (WeightShards.whole_heads)")
    half = tokens.shape[1] // 2
    ahead = ahead_layers(tokens.shape[1])
    tokens_of = (tokens[:, :half], tokens[:, half:])
    pos_of = (pos[:, :half], pos[:, half:])
    with phase("dense"):
        x = [embed(params, t, ws) for t in tokens_of]
    selection = [None, None]
    b_partial = None                  # B's MLP sums of the layer before, not yet joined
    p_ahead = None                    # this layer's q weights, gathered in the layer before
    for layer in range(cfg.num_hidden_layers):
        beside_kernels = layers_gathered_ahead(cfg, layer, ahead)
        chained = layers_gathered_in_chain(cfg, layer, ahead)
        state = _gather_ahead(beside_kernels + chained, layer, attends[0], state)
        with layer_scope(layer):          # both halves' weights, each gathered once
            p = (attention_weights(layer_params(params, layer), cfg, layer, ws)
                 if p_ahead is None else output_weights(p_ahead, cfg, ws))
        p_ahead = _query_weights_ahead(params, cfg, layer, ws)      # in the next layer's scope
        with layer_scope(layer):

            def attention(i: int, state):
                state = dataclasses.replace(state, selection=selection[i],
                                            tie_ahead=beside_kernels[i::2],
                                            every=state.every if i else None)
                out, state = attention_block(p, cfg, layer, x[i], pos_of[i], attends[i],
                                             state, ws)
                selection[i] = state.selection
                return out, state

            a_out, state = attention(0, state)
            if b_partial is not None:
                with phase("dense"):
                    b_sum, a_out = lax.optimization_barrier((ws.join_rows(b_partial), a_out))
                x[1] = x[1] + b_sum
            with phase("dense"):
                x[0] = x[0] + a_out
                a_in = mlp_input(p, cfg, layer, x[0], pos_of[0], ws)
            b_out, state = attention(1, state)
            state = dataclasses.replace(state, every=None)
            with phase("dense"):
                state, (a_in, b_out) = _tie_ahead(state, chained, (a_in, b_out))
                if p_ahead is not None:
                    p_ahead, (a_in, b_out) = _tie_weights(p_ahead, gathered_query_weights(
                        cfg, layer + 1), (a_in, b_out))
                x[1] = x[1] + b_out
                b_in = mlp_input(p, cfg, layer, x[1], pos_of[1], ws)
                a_sum, b_partial = _mlps(p, cfg, layer, (a_in, b_in), ws, expert_matmul)
                x[0] = x[0] + a_sum
    with phase("dense"):
        x[1] = x[1] + ws.join_rows(b_partial)
        hidden = [ws.gather_rows(rms_norm(h, params["model.norm.weight"], cfg.rms_norm_eps),
                                 t.shape) for h, t in zip(x, tokens_of)]
        return jnp.concatenate(hidden, axis=1), state
