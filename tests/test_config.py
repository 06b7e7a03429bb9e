"""Model configs, the dtype table and the capacity figures."""

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.capacity import bytes_per_token, capacity_report
from cp_runtime.config import (ConfigError, RuntimeConfig, load_model_config,
                               load_runtime_config, model_names)
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype


def test_every_config_loads():
    assert {"glm-5.2", "deepseek-v3.2", "tiny", "small"} <= set(model_names())
    for name in model_names():
        cfg = load_model_config(name)
        assert cfg.indexer_types[0] == "full"


def test_glm_and_deepseek_shapes():
    glm = load_model_config("glm-5.2")
    assert (glm.num_hidden_layers, glm.num_full_layers, glm.latent_dim) == (78, 21, 640)
    assert (glm.kv_lora_rank, glm.qk_rope_head_dim, glm.qk_nope_head_dim, glm.v_head_dim,
            glm.q_lora_rank, glm.num_attention_heads) == (512, 64, 192, 256, 2048, 64)
    assert (glm.index_n_heads, glm.index_head_dim, glm.index_topk) == (32, 128, 2048)
    assert glm.first_k_dense_replace == 3 and not glm.is_moe_layer(2) and glm.is_moe_layer(3)
    ds = load_model_config("deepseek-v3.2")
    assert (ds.num_hidden_layers, ds.num_full_layers, ds.num_attention_heads) == (61, 61, 128)
    assert (ds.q_lora_rank, ds.qk_nope_head_dim, ds.v_head_dim, ds.index_n_heads) == (
        1536, 128, 128, 64)


def test_shared_layers_use_last_full_layer():
    tiny = load_model_config("tiny")
    assert tiny.indexer_types == ("full", "shared", "full", "shared")
    assert [tiny.indexer_slot(i) for i in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("text, field", [
    ("vocab_size = 'big'\n", "vocab_size"),
    ("colour = 3\n", "colour"),
])
def test_bad_file_names_file_and_field(tmp_path, text, field):
    good = (load_model_config.__globals__["CONFIG_DIR"] / "models" / "tiny.toml").read_text()
    lines = [ln for ln in good.splitlines() if not ln.startswith(field)]
    path = tmp_path / "broken.toml"
    path.write_text("\n".join(lines) + "\n" + text)
    with pytest.raises(ConfigError, match=rf"broken\.toml.*{field}"):
        load_model_config(path)


def test_missing_field_named(tmp_path):
    path = tmp_path / "short.toml"
    path.write_text("vocab_size = 3\n")
    with pytest.raises(ConfigError, match=r"short\.toml: missing field 'hidden_size'"):
        load_model_config(path)


def test_unknown_model_lists_choices():
    with pytest.raises(ConfigError, match="tiny"):
        load_model_config("no-such-model")


def test_runtime_config_validation(tmp_path):
    with pytest.raises(ConfigError, match="page_size=24 must be a positive multiple of 16"):
        RuntimeConfig(page_size=24)
    with pytest.raises(ConfigError, match="fp8_e4m3"):
        RuntimeConfig(kv_cache_dtype="int4")
    path = tmp_path / "rt.toml"
    path.write_text('kv_cache_dtype = "bf16"\nnum_shards = 4\n')
    rt = load_runtime_config(path, page_size=32)
    assert (rt.kv_cache_dtype, rt.num_shards, rt.page_size) == ("bf16", 4, 32)


def test_dtype_table():
    assert latent_cache_dtype("auto") == jnp.bfloat16
    assert latent_cache_dtype("fp8_e4m3") == jnp.float8_e4m3fn
    assert latent_cache_dtype("fp8_e5m2") == jnp.float8_e5m2
    # The indexer cache is bf16 whenever the latent is narrower, never fp8.
    for name in ("fp8_e4m3", "fp8_e5m2", "bf16", "auto"):
        assert indexer_cache_dtype(name) == jnp.bfloat16
    assert indexer_cache_dtype("f32") == jnp.float32
    with pytest.raises(ValueError, match="unknown kv-cache dtype 'fp4'.*auto.*bf16.*fp8_e4m3"):
        latent_cache_dtype("fp4")


def test_capacity_figures():
    glm = load_model_config("glm-5.2")
    assert bytes_per_token(glm, "bf16") == 105_216
    assert bytes_per_token(glm, "fp8_e4m3") == 55_296
    report = capacity_report(glm, "fp8_e4m3", devices=16, hbm_gib=1.0, weights_gib=0.0)
    assert report.ratio_vs_bf16_2dp == "1.90"
    assert report.tokens_that_fit == 16 * (1 << 30) // 55_296
    with pytest.raises(ValueError, match="devices=0"):
        capacity_report(glm, "bf16", devices=0, hbm_gib=1, weights_gib=0)


def test_capacity_cli_json():
    out = subprocess.run(
        [sys.executable, "-m", "cp_runtime.cli", "capacity", "--model", "glm-5.2",
         "--kv-cache-dtype", "fp8_e4m3", "--json", "--devices", "16", "--hbm-gib", "192",
         "--weights-gib", "40"], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert (data["bytes_per_token_bf16"], data["bytes_per_token"]) == (105216, 55296)
    assert data["ratio_vs_bf16_2dp"] == "1.90"
    assert data["tokens_that_fit"] == int(152 * (1 << 30)) * 16 // 55296
    assert np.isclose(data["ratio_vs_bf16"], 105216 / 55296, atol=1e-4)


def test_capacity_cli_bad_dtype():
    proc = subprocess.run([sys.executable, "-m", "cp_runtime.cli", "capacity",
                           "--kv-cache-dtype", "fp4"], capture_output=True, text=True)
    assert proc.returncode == 2 and "fp8_e4m3" in proc.stderr
