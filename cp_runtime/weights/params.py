"""Model weights: random init from a config and a seed, and safetensors I/O with the Hugging Face
DeepSeek-V3.2 tensor names (`model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight`, ...).

Weights are a flat dict `{hf_name: array}` in HF layout (linear weights are `[out, in]`), so a
checkpoint round trip is the identity. `layer_params` gives one layer's view with the
`model.layers.{i}.` prefix stripped.

The model runs on the *model layout* (`model_layout`): the same names and arrays, except that
each MoE layer's routed experts are stacked into three tensors (cp_runtime.weights.sharding's
EXPERT_STACKS), transposed for a grouped matmul and split over devices by inner feature (each
device a slice of every expert):
    mlp.experts.gate_proj.weight, mlp.experts.up_proj.weight   [E, hidden, inner]
    mlp.experts.down_proj.weight                               [E, inner, hidden]
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from cp_runtime.config import ModelConfig
from cp_runtime.weights.sharding import EXPERT_STACKS

__all__ = ["param_shapes", "init_params", "layer_params", "save_params", "load_params",
           "model_layout", "model_shapes", "expert_sources"]

Params = dict[str, jax.Array]


def _attention_shapes(cfg: ModelConfig, full: bool) -> dict[str, tuple[int, ...]]:
    h, hid = cfg.num_attention_heads, cfg.hidden_size
    shapes = {
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, hid),
        "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
        "self_attn.q_b_proj.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, hid),
        "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                       cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (hid, h * cfg.v_head_dim),
    }
    if full:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        shapes |= {
            "self_attn.indexer.wq_b.weight": (hi * di, cfg.q_lora_rank),
            "self_attn.indexer.wk.weight": (di, hid),
            "self_attn.indexer.k_norm.weight": (di,),
            "self_attn.indexer.k_norm.bias": (di,),
            "self_attn.indexer.weights_proj.weight": (hi, hid),
        }
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inner, hidden),
        f"{prefix}.up_proj.weight": (inner, hidden),
        f"{prefix}.down_proj.weight": (hidden, inner),
    }


def _layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    hid = cfg.hidden_size
    shapes = {"input_layernorm.weight": (hid,), "post_attention_layernorm.weight": (hid,)}
    shapes |= _attention_shapes(cfg, cfg.indexer_types[layer] == "full")
    if not cfg.is_moe_layer(layer):
        return shapes | _mlp_shapes("mlp", hid, cfg.intermediate_size)
    shapes |= {"mlp.gate.weight": (cfg.n_routed_experts, hid),
               "mlp.gate.e_score_correction_bias": (cfg.n_routed_experts,)}
    for e in range(cfg.n_routed_experts):
        shapes |= _mlp_shapes(f"mlp.experts.{e}", hid, cfg.moe_intermediate_size)
    if cfg.n_shared_experts:
        shapes |= _mlp_shapes("mlp.shared_experts", hid,
                              cfg.moe_intermediate_size * cfg.n_shared_experts)
    return shapes


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, by HF name."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
              "model.norm.weight": (cfg.hidden_size,)}
    for layer in range(cfg.num_hidden_layers):
        shapes |= {f"model.layers.{layer}.{k}": v for k, v in _layer_shapes(cfg, layer).items()}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def expert_sources(name: str, model: ModelConfig) -> list[str] | None:
    """The HF tensors (one per expert) a stacked expert tensor is built from, or None when
    `name` is not a stack. Each is transposed into the stack: HF [out, in] -> [in, out]."""
    for stack in EXPERT_STACKS:
        if name.endswith(stack):
            prefix, proj = name[: -len(stack)], stack.split(".")[2]
            return [f"{prefix}mlp.experts.{e}.{proj}.weight"
                    for e in range(model.n_routed_experts)]
    return None


def _stack_names(model: ModelConfig) -> dict[str, list[str]]:
    """{stacked name: its HF sources} for every MoE layer."""
    return {f"model.layers.{layer}.{stack}": expert_sources(f"model.layers.{layer}.{stack}",
                                                            model)
            for layer in range(model.num_hidden_layers) if model.is_moe_layer(layer)
            for stack in EXPERT_STACKS}


def model_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model layout, by name (`param_shapes` with experts stacked)."""
    shapes = param_shapes(model)
    for stack, sources in _stack_names(model).items():
        out, inp = shapes[sources[0]]
        for src in sources:
            del shapes[src]
        shapes[stack] = (len(sources), inp, out)
    return shapes


def model_layout(params: Params, model: ModelConfig) -> Params:
    """HF-layout weights -> the model layout (routed experts stacked); a no-op on weights
    already in it."""
    stacks = _stack_names(model)
    if not stacks or next(iter(stacks)) in params:
        return params
    out = dict(params)
    for stack, sources in stacks.items():
        out[stack] = jnp.stack([jnp.asarray(out.pop(src)).T for src in sources])
    return out


def _init_one(key: jax.Array, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return jnp.ones(shape, dtype)
    if name.endswith(".bias"):
        return jnp.zeros(shape, dtype)
    if name.endswith("embed_tokens.weight"):
        return jax.random.normal(key, shape, dtype)
    # Linear [out, in]: unit-variance outputs for unit-variance inputs.
    return jax.random.normal(key, shape, dtype) * shape[-1] ** -0.5


def init_params(cfg: ModelConfig, seed: int, dtype=jnp.float32) -> Params:
    """Random weights, reproducible from `seed` (each tensor keyed by its name's position)."""
    shapes = param_shapes(cfg)
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {name: _init_one(k, name, shape, dtype)
            for k, (name, shape) in zip(keys, shapes.items())}


def layer_params(params: Params, layer: int) -> Params:
    prefix = f"model.layers.{layer}."
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def save_params(params: Params, path: str | pathlib.Path) -> None:
    save_file({k: np.asarray(v) for k, v in params.items()}, str(path))


def load_params(path: str | pathlib.Path, cfg: ModelConfig) -> Params:
    """Load a safetensors file and check it holds exactly the tensors `cfg` needs."""
    tensors = load_file(str(path))
    want = param_shapes(cfg)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise ValueError(f"{path}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    for name, shape in want.items():
        if tensors[name].shape != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {tensors[name].shape}, "
                             f"config {cfg.name} needs {shape}")
    return {name: jnp.asarray(tensors[name]) for name in want}
