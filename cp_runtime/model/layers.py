"""The decoder's layer stack, independent of where attention reads its keys from.

Per layer: x += attention(RMSNorm(x)) (MLA with the DSA indexer's selection:
cp_runtime.model.attention_inputs, cp_runtime.model.mla, cp_runtime.model.indexer_inputs), then
x += MLP(RMSNorm(x)) (cp_runtime.model.mlp). `forward` runs the stack with an attention
callback, so the dense oracle (cp_runtime.model.oracle) and the paged, context-parallel path
(cp_runtime.model.attention) share every line except attention itself; a chunk run as two
interleaved halves is cp_runtime.model.halves.

Weights are in the model layout (cp_runtime.weights.params.model_layout), whole or split over a
mesh axis (cp_runtime.weights.sharding); a `WeightShards` says which, and each function gathers
or sums what its split needs, so the same lines run in both modes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from cp_runtime.config import ModelConfig
from cp_runtime.model.attention_inputs import (attention_weights, indexer_inputs, mla_inputs,
                                               own_rows_attention_inputs, row_features)
from cp_runtime.model.indexer_inputs import IndexerInputs
from cp_runtime.model.mla import OutputProjection, ProjectFn
from cp_runtime.model.mlp import mlp, mlp_input
from cp_runtime.model.moe import ExpertMatmulFn
from cp_runtime.model.ops import embed, rms_norm
from cp_runtime.model.scopes import layer_scope, phase
from cp_runtime.weights.params import Params, layer_params
from cp_runtime.weights.shards import WeightShards

__all__ = ["AttendFn", "forward", "decoder_layer", "attention_block"]

# attend(layer, state, q_row, kv_row, index_or_None, project) -> (attention output f[..., hidden]
# complete on every device, state)
AttendFn = Callable[[int, Any, jax.Array, jax.Array, IndexerInputs | None, ProjectFn],
                    tuple[jax.Array, Any]]


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, pos: jax.Array,
            attend: AttendFn, state: Any, ws: WeightShards = WeightShards(),
            expert_matmul: ExpertMatmulFn | None = None) -> tuple[jax.Array, Any]:
    """Run the decoder over tokens i32[...] at positions i32[...]; returns (hidden, state).

    `params` are in the model layout; `hidden` f[..., hidden] is after the final norm and
    `ops.logits(params, hidden, ws)` projects it. The attention callback gets the output
    projection so the merge can choose where the partial results meet
    (cp_runtime.parallel.merge). `expert_matmul` runs block-scaled experts from their fp8
    blocks (`mlp.mlp`; None: XLA).
    """
    with phase("dense"):
        x = embed(params, tokens, ws)
    for layer in range(cfg.num_hidden_layers):
        with layer_scope(layer):
            x, state = decoder_layer(params, cfg, layer, x, pos, attend, state, ws,
                                     expert_matmul)
    with phase("dense"):
        hidden = rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps)
        return ws.gather_rows(hidden, tokens.shape), state


def decoder_layer(params: Params, cfg: ModelConfig, layer: int, x: jax.Array, pos: jax.Array,
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
        q_row, kv_row, index = own_rows_attention_inputs(p, cfg, rows, pos, ws, own_indexer)
    else:
        with phase("attention_inputs"):
            rows = ws.gather_rows_of(rows, pos.shape, wired=("q_lora",))  # q_lora feeds matmuls
            q_row, kv_row, q_lora = mla_inputs(p, cfg, None, pos, rows)
            index = (indexer_inputs(p, cfg, None, q_lora, pos, ws, rows) if own_indexer
                     else None)
    return attend(layer, state, q_row, kv_row, index, OutputProjection(p, cfg))
