"""config.json read as transformers reads it (cp_runtime.weights.checkpoint.read_hf_config;
docs/reference-semantics.md has the table key by key).

tests/reference/fixtures/config_cases.json holds config.json dicts, each leaving out or setting
a key whose default or meaning matters, with what transformers 5 built from each
(tests/reference/build_fixtures.py: AutoConfig.from_pretrained, then the model: its norms' eps,
its rotary embedding's inverse frequencies and cos/sin factor, its attention's softmax scale,
which layers got an indexer, which rope its modeling file applies). The loader must give the
same model, or refuse what transformers refuses. No torch here: the stored readings only.
"""

import dataclasses
import json
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.config import ConfigError, RopeScaling, load_model_config
from cp_runtime.model.attention_inputs import row_features
from cp_runtime.model.ops import rms_norm, rope_frequencies, rope_mscale
from cp_runtime.weights.checkpoint import read_hf_config
from cp_runtime.weights.params import init_params, layer_params

CASES = json.loads((pathlib.Path(__file__).parents[1] / "reference" / "fixtures"
                    / "config_cases.json").read_text())["cases"]
INDEXER_K_NORM_EPS = 1e-6        # cp_runtime.model.indexer_inputs.indexer_keys' LayerNorm


def read(tmp_path, hf: dict):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf))
    return read_hf_config(d)


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_config_json_read_as_transformers_reads_it(tmp_path, case):
    want = case["transformers"]
    if "error" in want:                          # transformers refuses it: so does the loader
        with pytest.raises(ValueError):
            read(tmp_path, case["config"])
        return
    cfg = read(tmp_path, case["config"])
    # Norms: the config's eps for the layer norms and the final one; MLA's inner RMSNorms and
    # the indexer's key LayerNorm 1e-6 whatever the config says.
    assert cfg.rms_norm_eps == want["rms_norm_eps"] == want["input_layernorm_eps"]
    assert cfg.mla_norm_eps == want["mla_norm_eps"] == want["kv_a_norm_eps"]
    assert want["indexer_k_norm_eps"] == INDEXER_K_NORM_EPS
    # Routing and the layer plan.
    for field in ("routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
                  "tie_word_embeddings", "n_routed_experts", "first_k_dense_replace"):
        assert getattr(cfg, field) == want[field], field
    assert want["mlp_layer_types"] == (["dense"] * cfg.first_k_dense_replace
                                       + ["sparse"] * (cfg.num_hidden_layers
                                                       - cfg.first_k_dense_replace))
    assert list(cfg.indexer_types) == want["indexer_types"]
    # Rope: layouts, theta, YaRN's frequencies, its cos/sin factor and the softmax scale.
    assert cfg.mla_rope_interleaved == want["mla_rope_interleaved"]
    assert cfg.index_rope_interleaved == want["index_rope_interleaved"]
    assert cfg.rope_theta == want["rope_theta"]
    assert (cfg.rope_scaling is None) == (want["rope_type"] == "default")
    np.testing.assert_allclose(rope_frequencies(cfg), want["inv_freq"], rtol=2e-6, atol=0)
    assert rope_mscale(cfg) == pytest.approx(want["rope_mscale"], rel=1e-12)
    assert cfg.qk_head_dim == want["qk_head_dim"]
    assert cfg.softmax_scale == pytest.approx(want["softmax_scale"], rel=1e-12)
    assert cfg.weight_dtype == ("f32" if want["dtype"] == "float32" else "bf16")


def test_cases_cover_the_known_mismatches():
    """The three the audit started from, as transformers has them: GLM's indexer rope
    interleaved with no key saying so; MLA's inner norms at 1e-6 beside rms_norm_eps 1e-5;
    the dtype written as `dtype`."""
    by_name = {c["case"]: c for c in CASES}
    glm = by_name["glm minimal: every optional key left out"]
    assert "indexer_rope_interleave" not in glm["config"]
    assert glm["transformers"]["index_rope_interleaved"] is True
    assert glm["transformers"]["rms_norm_eps"] == 1e-5
    assert glm["transformers"]["mla_norm_eps"] == 1e-6
    both = by_name["glm dtype and torch_dtype"]
    assert both["transformers"]["dtype"] == "float32"                 # `dtype` wins


# -- what the stored cases do not cover --------------------------------------------------------
GLM = next(c["config"] for c in CASES if c["case"].startswith("glm minimal"))
DEEPSEEK = next(c["config"] for c in CASES if c["case"].startswith("deepseek minimal"))


@pytest.mark.parametrize("key, field", [("rope_interleave", "mla_rope_interleaved"),
                                        ("indexer_rope_interleave", "index_rope_interleaved")])
def test_glm_explicit_rope_layout_is_honoured(tmp_path, key, field):
    """transformers' GlmMoeDsa reads neither key (it always interleaves); a config that states
    a layout gets it, as vLLM and SGLang give it (GLM-5's own config states both true)."""
    assert getattr(read(tmp_path, GLM), field) is True
    assert getattr(read(tmp_path, GLM | {key: False}), field) is False
    assert getattr(read(tmp_path, GLM | {key: True}), field) is True


def test_deepseek_rope_layout_keys_are_not_read(tmp_path):
    cfg = read(tmp_path, DEEPSEEK | {"rope_interleave": False, "indexer_rope_interleave": True})
    assert (cfg.mla_rope_interleaved, cfg.index_rope_interleaved) == (True, False)


@pytest.mark.parametrize("change, match", [
    ({"num_key_value_heads": 1}, r"num_key_value_heads=1 differs from num_attention_heads=2"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, r"partial_rotary_factor=0\.5"),
    ({"rope_parameters": {"indexed_attention": {"rope_type": "default"}}},
     r"rope per layer type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling type 'linear'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}},
     r"lacks 'original_max_position_embeddings'"),
    ({"scoring_func": "softmax"}, r"scoring_func='softmax' is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ({"mlp_layer_types": ["dense", "sparse", "dense"] + ["sparse"] * 3},
     r"mlp_layer_types must be 6 entries, 'dense' ones then 'sparse' ones"),
])
def test_refused_with_the_key_named(tmp_path, change, match):
    """What neither transformers' class nor this runtime computes (or what transformers itself
    fails on) is refused, naming the key."""
    with pytest.raises(ValueError, match=match):
        read(tmp_path, GLM | change)


def test_inner_norm_eps_reaches_the_model(tiny):
    """row_features normalises q_a's and kv_a's latent outputs with mla_norm_eps, not
    rms_norm_eps: outputs of mean square ~1e-5, where the two eps give different values."""
    cfg = dataclasses.replace(tiny, rms_norm_eps=1e-5)
    assert cfg.mla_norm_eps == 1e-6
    p = layer_params(init_params(cfg, seed=1), 0)
    p = {**p, "self_attn.q_a_proj.weight": p["self_attn.q_a_proj.weight"] * 3e-3}
    h = np.random.default_rng(0).standard_normal((5, cfg.hidden_size)).astype(np.float32)
    got = row_features(p, cfg, jnp.asarray(h), jnp.arange(5), indexer=False)["q_lora"]
    a = h @ np.asarray(p["self_attn.q_a_proj.weight"]).T
    assert 1e-6 < float(np.mean(a * a)) < 1e-4
    norm = np.asarray(p["self_attn.q_a_layernorm.weight"])
    want = a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-6) * norm
    other = a / np.sqrt(np.mean(a * a, -1, keepdims=True) + 1e-5) * norm
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5)
    assert np.max(np.abs(other - want) / np.abs(want)) > 1e-2
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(a), norm, 1e-6)), want,
                               rtol=2e-5)


def test_toml_rope_scaling_takes_the_new_fields(tmp_path):
    text = (load_model_config.__globals__["CONFIG_DIR"] / "models" / "tiny.toml").read_text()
    path = tmp_path / "yarn.toml"
    path.write_text(text + "\n[rope_scaling]\nfactor = 4\noriginal_max_position_embeddings = 64"
                           "\nattention_factor = 1.25\ntruncate = false\n")
    rs = load_model_config(path).rope_scaling
    assert rs == RopeScaling(4.0, 64, attention_factor=1.25, truncate=False)
    assert rs.rope_mscale == 1.25


@pytest.mark.parametrize("mscale, mscale_all_dim, want", [
    (1.0, 1.0, 1.0), (0.0, 0.0, 0.1 * math.log(40) + 1), (0.8, 0.0, 0.1 * math.log(40) + 1),
    (0.0, 0.8, 0.1 * math.log(40) + 1),
    (1.0, 0.5, (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1))])
def test_rope_mscale_rule(mscale, mscale_all_dim, want):
    """transformers' attention_factor: the ratio only where both mscales are non-zero."""
    rs = RopeScaling(40.0, 4096, mscale=mscale, mscale_all_dim=mscale_all_dim)
    assert rs.rope_mscale == pytest.approx(want, rel=1e-15)


def test_rope_scaling_checks_still_apply():
    with pytest.raises(ConfigError, match="factor"):
        RopeScaling(0.5, 4096)
