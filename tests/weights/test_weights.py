"""Weights: reproducible init, HF names, safetensors round trip."""

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.model.oracle import oracle_logits
from cp_runtime.weights.params import init_params, load_params, param_shapes, save_params


def test_hf_names(tiny):
    names = set(param_shapes(tiny))
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in names
    assert "model.layers.1.self_attn.indexer.wq_b.weight" not in names     # shared layer
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names                  # dense layer 0


def test_init_is_reproducible(tiny):
    a, b, c = init_params(tiny, 1), init_params(tiny, 1), init_params(tiny, 2)
    name = "model.layers.2.self_attn.q_b_proj.weight"
    assert (a[name] == b[name]).all() and not (a[name] == c[name]).all()


def test_round_trip_reproduces_logits(tmp_path, tiny, tiny_params):
    path = tmp_path / "model.safetensors"
    save_params(tiny_params, path)
    loaded = load_params(path, tiny)
    tokens = jnp.arange(40) % tiny.vocab_size
    a = oracle_logits(tiny_params, tokens, cfg=tiny, page_size=16)
    b = oracle_logits(loaded, tokens, cfg=tiny, page_size=16)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_names_missing_tensor(tmp_path, tiny, tiny_params):
    path = tmp_path / "bad.safetensors"
    save_params({k: v for k, v in tiny_params.items() if "wq_b" not in k}, path)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.indexer.wq_b"):
        load_params(path, tiny)
