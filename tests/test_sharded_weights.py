"""Weights split over the `cp` mesh (runtime weights = "sharded") against the same weights whole
on every device: same logits, 1/S of the bytes per device, and the MoE's grouped matmul against
a dense loop over every expert."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_engine, random_tokens, rel_l2
from cp_runtime.config import ConfigError, RuntimeConfig, load_model_config
from cp_runtime.model.forward import _swiglu, mlp, route
from cp_runtime.weights.format import resolve_runtime_weights
from cp_runtime.weights.layout import split_of
from cp_runtime.weights.params import init_params, layer_params, model_layout, model_shapes

DEEPSEEK_MINI = load_model_config("deepseek-mini")


def _prefill(model, params, shards: int, weights: str) -> np.ndarray:
    """Logits f32[40, V] of every query of a 40-token prefill (one step: one compile; decode
    steps with split weights are compared over Ray in test_ray)."""
    engine = make_engine(model, params, kv_cache_dtype="f32", num_shards=shards,
                         pages_per_shard=max(8 // shards, 2), page_size=16, chunk_size=64,
                         weights=weights)
    s = engine.create_session()
    return engine.extend(s.id, random_tokens(model, 40, seed=3), all_logits=True)


@pytest.mark.parametrize("model_name", ["tiny", "deepseek-mini"])
@pytest.mark.parametrize("shards", [1, 16])
def test_sharded_weights_give_the_replicated_logits(model_name, shards):
    model = load_model_config(model_name)
    params = init_params(model, seed=0)
    whole = _prefill(model, params, shards, "replicated")
    split = _prefill(model, params, shards, "sharded")
    assert rel_l2(split, whole) <= 1e-5


def test_each_device_holds_a_sixteenth_of_the_split_weights():
    model = DEEPSEEK_MINI
    engine = make_engine(model, init_params(model, seed=0), kv_cache_dtype="f32", num_shards=16,
                         pages_per_shard=2, page_size=16, weights="sharded")
    shapes = model_shapes(model)
    split_bytes = sum(4 * math.prod(s) for n, s in shapes.items() if split_of(n, s, model))
    whole_bytes = sum(4 * math.prod(s) for n, s in shapes.items() if not split_of(n, s, model))
    per_device = engine.executor.weight_bytes()
    assert len(per_device) == 16
    assert set(per_device.values()) == {split_bytes // 16 + whole_bytes}
    assert whole_bytes < 0.01 * split_bytes                # only norms and biases stay whole
    assert engine.executor.stats()["weight_bytes_per_device"] == split_bytes // 16 + whole_bytes


def test_grouped_experts_match_a_dense_loop_over_every_expert():
    """The MoE layer (tokens go only to their k experts, ragged_dot) against running every
    expert on every token and weighting by the router's dense weights."""
    model = DEEPSEEK_MINI
    hf = init_params(model, seed=1)
    p = layer_params(model_layout(hf, model), 1)
    p_hf = layer_params(hf, 1)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 7, model.hidden_size)),
                    jnp.float32)
    gate = route(model, jnp.einsum("...i,oi->...o", x, p_hf["mlp.gate.weight"]),
                 p_hf["mlp.gate.e_score_correction_bias"])
    dense = sum(gate[..., e, None] * _swiglu(p_hf, f"mlp.experts.{e}", x)
                for e in range(model.n_routed_experts))
    dense = dense + _swiglu(p_hf, "mlp.shared_experts", x)
    assert rel_l2(mlp(p, model, 1, x), dense) <= 1e-6
    assert int((gate > 0).sum(-1).max()) == model.num_experts_per_tok


def test_merge_variants_need_their_weight_split():
    with pytest.raises(ConfigError, match="head_scatter.*needs weights='sharded'"):
        RuntimeConfig(merge="head_scatter", weights="replicated")
    # "auto" is checked once it is resolved: the tiny model replicates, which head_scatter
    # cannot run with.
    with pytest.raises(ConfigError, match="head_scatter.*needs weights='sharded'"):
        resolve_runtime_weights(RuntimeConfig(merge="head_scatter"), load_model_config("tiny"),
                                device_bytes=2**34)
    with pytest.raises(ConfigError, match="hidden_psum.*needs weights='replicated'"):
        RuntimeConfig(merge="hidden_psum", weights="sharded")
    with pytest.raises(ConfigError, match="weights='halved' is not one of"):
        RuntimeConfig(weights="halved")
