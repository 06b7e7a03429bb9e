"""Model configs, the dtype table and the capacity figures."""

import dataclasses
import json
import math
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.cache.capacity import GIB, bytes_per_token, capacity_report, weight_bytes_per_device
from cp_runtime.cli import main as cli
from cp_runtime.config import (ConfigError, RuntimeConfig, Strategy, check_runtime_for_model,
                               load_model_config, load_runtime_config, model_names,
                               resolve_strategy)
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype
from cp_runtime.weights.params import model_shapes


def test_every_config_loads():
    assert {"glm-5.2", "deepseek-v3.2", "tiny", "small"} <= set(model_names())
    for name in model_names():
        cfg = load_model_config(name)
        assert cfg.indexer_types[0] == "full"


def test_small_glm_indexer_is_small_with_glms_indexer():
    glm, small = load_model_config("glm-5.2"), load_model_config("small")
    probe = load_model_config("small-glm-indexer")
    assert (probe.index_n_heads, probe.index_head_dim) == (glm.index_n_heads, glm.index_head_dim)
    assert dataclasses.replace(probe, index_n_heads=small.index_n_heads,
                               index_head_dim=small.index_head_dim, name=small.name) == small


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
    with pytest.raises(ConfigError, match=r"gathers='tree' is not one of \('auto', 'flat'"):
        RuntimeConfig(gathers="tree")
    with pytest.raises(ConfigError, match=r"tpu_schedule='eager' is not one of \('overlap'"):
        RuntimeConfig(tpu_schedule="eager")
    path = tmp_path / "rt.toml"
    path.write_text('kv_cache_dtype = "bf16"\nnum_shards = 4\n')
    rt = load_runtime_config(path, page_size=32)
    assert (rt.kv_cache_dtype, rt.num_shards, rt.page_size) == ("bf16", 4, 32)


def test_strategy_knobs_are_flat_keys_of_a_file_keywords_and_replace(tmp_path):
    """The strategy's knobs are written flat (RuntimeConfig's docstring) and land in
    runtime.strategy, as enums equal to their strings."""
    path = tmp_path / "rt.toml"
    path.write_text('num_shards = 4\nmerge = "all_gather"\ngathers = "flat"\n')
    rt = load_runtime_config(path, wire_dtype="f32")
    assert rt.strategy == Strategy(merge="all_gather", gathers="flat", wire_dtype="f32")
    assert rt == RuntimeConfig(num_shards=4, merge="all_gather", gathers="flat",
                               wire_dtype="f32")
    assert rt.strategy.merge == "all_gather" and f"{rt.strategy.merge}" == "all_gather"
    moved = dataclasses.replace(rt, gathers="staged", page_size=32)
    assert (moved.strategy.gathers, moved.strategy.merge, moved.page_size) == (
        "staged", "all_gather", 32)
    assert not hasattr(rt, "merge")                 # read from runtime.strategy
    path.write_text('merge = "tree"\n')
    with pytest.raises(ConfigError, match=r"rt.toml: merge='tree' is not one of \('auto'"):
        load_runtime_config(path)
    path.write_text('[strategy]\nmerge = "all_gather"\n')
    with pytest.raises(ConfigError, match=r"rt.toml: unknown field 'strategy' \(the strategy"):
        load_runtime_config(path)
    path.write_text('attention = "gather_kv"\nweights = "replicated"\n')
    with pytest.raises(ConfigError, match="rt.toml: attention='gather_kv' needs weights"):
        load_runtime_config(path)


def test_resolve_strategy_makes_each_platform_choice_once():
    tiny = load_model_config("tiny")
    cpu, tpu = (resolve_strategy(Strategy(), tiny, p) for p in ("cpu", "tpu"))
    assert (cpu.wire_dtype, cpu.mlp_rows, cpu.indexer_scores, cpu.chunk_halves) == (
        "f32", "wire", "cache", False)
    assert (tpu.wire_dtype, tpu.mlp_rows, tpu.indexer_scores, tpu.chunk_halves) == (
        "bf16", "fp8", "fp8", True)
    given = Strategy(wire_dtype="bf16", mlp_rows="fp8", indexer_scores="fp8", chunk_halves="on",
                     merge="all_gather", row_attention="rows")
    chosen = resolve_strategy(given, tiny, "cpu")
    assert (chosen.wire_dtype, chosen.mlp_rows, chosen.indexer_scores, chosen.chunk_halves,
            chosen.merge, chosen.row_attention) == ("bf16", "fp8", "fp8", True, "all_gather",
                                                    "rows")
    assert resolve_strategy(Strategy(chunk_halves="off"), tiny, "tpu").chunk_halves is False


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
        [sys.executable, "-m", "cp_runtime.cli.main", "capacity", "--model", "glm-5.2",
         "--kv-cache-dtype", "fp8_e4m3", "--json", "--devices", "16", "--hbm-gib", "192",
         "--weights-gib", "40"], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert (data["bytes_per_token_bf16"], data["bytes_per_token"]) == (105216, 55296)
    assert data["ratio_vs_bf16_2dp"] == "1.90"
    assert data["tokens_that_fit"] == int(152 * (1 << 30)) * 16 // 55296
    assert np.isclose(data["ratio_vs_bf16"], 105216 / 55296, atol=1e-4)


def test_capacity_cli_bad_dtype():
    proc = subprocess.run([sys.executable, "-m", "cp_runtime.cli.main", "capacity",
                           "--kv-cache-dtype", "fp4"], capture_output=True, text=True)
    assert proc.returncode == 2 and "fp8_e4m3" in proc.stderr


# -- value checks -------------------------------------------------------------------------------
def tiny_toml_with(tmp_path, field: str, value: str):
    """tiny.toml with `field` set to the TOML text `value` (or dropped when value is '')."""
    good = (load_model_config.__globals__["CONFIG_DIR"] / "models" / "tiny.toml").read_text()
    lines = [ln for ln in good.splitlines() if not ln.startswith(f"{field} ")]
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(lines) + (f"\n{field} = {value}\n" if value else "\n"))
    return path


SIZE_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
               "intermediate_size", "moe_intermediate_size", "n_group", "topk_group"]


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", ["0", "-4"])
def test_model_sizes_must_be_positive(tmp_path, field, value):
    path = tiny_toml_with(tmp_path, field, value)
    with pytest.raises(ConfigError, match=rf"bad\.toml: bad: {field}={value} must be a positive "
                                          "integer"):
        load_model_config(path)


@pytest.mark.parametrize("field, value, match", [
    ("n_routed_experts", "-1", "n_routed_experts=-1 must be an integer >= 0"),
    ("n_shared_experts", "-1", "n_shared_experts=-1 must be an integer >= 0"),
    ("first_k_dense_replace", "-1", "first_k_dense_replace=-1 must be an integer >= 0"),
    ("first_k_dense_replace", "5", "first_k_dense_replace=5 > num_hidden_layers=4"),
    ("num_experts_per_tok", "0", "num_experts_per_tok=0 with n_routed_experts=4"),
    ("rms_norm_eps", "0.0", "rms_norm_eps=0.0 must be a finite number above 0"),
    ("rope_theta", "-1.0", "rope_theta=-1.0 must be a finite number above 0"),
    ("rope_theta", "inf", "rope_theta=inf must be a finite number above 0"),
    ("routed_scaling_factor", "0.0", "routed_scaling_factor=0.0 must be a finite number"),
    ("indexer_types", '["full", "shared"]', "indexer_types has 2 entries, num_hidden_layers=4"),
])
def test_model_counts_and_floats_checked(tmp_path, field, value, match):
    with pytest.raises(ConfigError, match=rf"bad\.toml: .*{re.escape(match)}"):
        load_model_config(tiny_toml_with(tmp_path, field, value))


@pytest.mark.parametrize("ids, match", [
    ("[0, 4]", "got 4"), ("[0, -1]", "got -1"), ("[0, 2, 2]", "got 'a repeated id'"),
    ('"0,2"', "must be a list"),
])
def test_indexer_full_layers_checked(tmp_path, ids, match):
    path = tiny_toml_with(tmp_path, "indexer_types", "")
    path.write_text(path.read_text() + f"indexer_full_layers = {ids}\n")
    with pytest.raises(ConfigError, match=rf"bad\.toml: field 'indexer_full_layers'.*{match}"):
        load_model_config(path)


def test_dense_model_may_have_no_experts():
    small = load_model_config("small")
    assert (small.n_routed_experts, small.num_experts_per_tok) == (0, 0)


@pytest.mark.parametrize("field", ["num_shards", "pages_per_shard", "chunk_size", "max_batch",
                                   "key_block_pages", "query_block", "page_size"])
@pytest.mark.parametrize("value", [0, -16])
def test_runtime_sizes_must_be_positive(tmp_path, field, value):
    with pytest.raises(ConfigError, match=rf"{field}={value} must be a positive integer"):
        RuntimeConfig(**{field: value})
    path = tmp_path / "rt.toml"
    path.write_text(f"{field} = {value}\n")
    with pytest.raises(ConfigError, match=rf"rt\.toml: {field}={value} must be"):
        load_runtime_config(path)


def test_runtime_checked_against_model(tmp_path):
    glm = load_model_config("glm-5.2")
    check_runtime_for_model(glm, RuntimeConfig(model="glm-5.2", page_size=64))
    with pytest.raises(ConfigError, match=r"field 'model'='tiny' but the model in use is "
                                          r"'glm-5.2'"):
        check_runtime_for_model(glm, RuntimeConfig(model="tiny"))
    with pytest.raises(ConfigError, match=r"field 'page_size'=48: model glm-5.2's "
                                          r"index_topk=2048 is not a positive multiple of it"):
        check_runtime_for_model(glm, RuntimeConfig(model="glm-5.2", page_size=48,
                                                   selection="page"))
    # Token selection picks tokens, whatever the page size.
    check_runtime_for_model(glm, RuntimeConfig(model="glm-5.2", page_size=48, selection="token"))
    with pytest.raises(ConfigError, match=r"selection='pages' is not one of"):
        RuntimeConfig(selection="pages")
    path = tmp_path / "rt.toml"
    path.write_text('model = "glm-5.2"\npage_size = 48\nselection = "page"\n')
    with pytest.raises(ConfigError, match=r"rt\.toml: field 'page_size'=48"):
        load_runtime_config(path, model=glm)
    path.write_text('model = "tiny"\n')
    with pytest.raises(ConfigError, match=r"rt\.toml: field 'model'='tiny'"):
        load_runtime_config(path, model=glm)
    assert load_runtime_config(path, model=load_model_config("tiny")).model == "tiny"


# -- capacity of a deployment -----------------------------------------------------------------

def grown(cfg, **more):
    """cfg with some sizes increased by the given amounts."""
    return dataclasses.replace(cfg, **{k: getattr(cfg, k) + v for k, v in more.items()})


def test_weight_sharding_rules():
    """Each rule seen by its marginal cost on 16 devices, bf16 (2 bytes a value)."""
    glm = load_model_config("glm-5.2")
    d, hid, layers = 16, glm.hidden_size, glm.num_hidden_layers
    base = weight_bytes_per_device(glm, d, "bf16")
    moe = layers - glm.first_k_dense_replace
    # Vocabulary: 16 more rows are one more row of embedding and lm head per device.
    assert weight_bytes_per_device(grown(glm, vocab_size=d), d, "bf16") - base == 2 * hid * 2
    # Heads: 16 more heads are one more head of q_b, kv_b and o_proj per device.
    per_head = (glm.qk_head_dim * glm.q_lora_rank
                + (glm.qk_nope_head_dim + glm.v_head_dim) * glm.kv_lora_rank
                + hid * glm.v_head_dim)
    assert (weight_bytes_per_device(grown(glm, num_attention_heads=d), d, "bf16") - base
            == layers * per_head * 2)
    # Routed experts: 16 more experts are one more whole expert per MoE layer and device, plus
    # the router's 16 new rows and its bias's 16 new entries (both whole on every device).
    expert = 3 * glm.moe_intermediate_size * hid
    assert (weight_bytes_per_device(grown(glm, n_routed_experts=d), d, "bf16") - base
            == moe * (expert * 2 + d * hid * 2 + d * 4))
    # Dense MLP: column / row parallel, 16 more features are one more per device.
    dense = glm.first_k_dense_replace
    assert (weight_bytes_per_device(grown(glm, intermediate_size=d), d, "bf16") - base
            == dense * 3 * hid * 2)
    # Features: 16 more q_lora ranks are 16 more rows of q_a_proj (whole on every device), the
    # whole (norm, f32) q_a_layernorm's 16 values, and a column more in each local head of q_b
    # and indexer wq_b.
    heads, index_heads = glm.num_attention_heads // d, glm.index_n_heads // d
    full = len(glm.full_layers)
    assert (weight_bytes_per_device(grown(glm, q_lora_rank=d), d, "bf16") - base
            == 2 * (layers * (hid * d + heads * glm.qk_head_dim * d)
                    + full * index_heads * glm.index_head_dim * d) + 4 * layers * d)


def test_weight_dtypes():
    glm = load_model_config("glm-5.2")
    shapes = model_shapes(glm)
    n = sum(math.prod(s) for s in shapes.values())
    one_d = sum(math.prod(s) for s in shapes.values() if len(s) == 1)     # norms, biases: f32
    assert weight_bytes_per_device(glm, 1, "bf16") == 2 * n + 2 * one_d
    assert weight_bytes_per_device(glm, 1, "auto") == weight_bytes_per_device(glm, 1, "fp8")
    fp8 = weight_bytes_per_device(glm, 1, "fp8")
    # fp8: one byte a matmul value, an f32 per 128x128 block; embeddings etc. stay bf16.
    embeddings = 2 * glm.vocab_size * glm.hidden_size * 2
    assert n < fp8 < n + embeddings + n * 4 // (128 * 128) + 2 * 10**9
    with pytest.raises(ValueError, match="weight dtype 'int4'"):
        weight_bytes_per_device(glm, 1, "int4")


def capacity_json(capsys, *argv) -> dict:
    assert cli.main(["capacity", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model", ["glm-5.2", "deepseek-v3.2"])
@pytest.mark.parametrize("topology, devices", [("tpu7x-16", 16), ("tpu7x-32", 32)])
def test_capacity_cli_topology(capsys, model, topology, devices):
    data = capacity_json(capsys, "--model", model, "--topology", topology)
    cfg = load_model_config(model)
    weights = weight_bytes_per_device(cfg, devices, "fp8")
    assert (data["devices"], data["hbm_gib_per_device"], data["topology"]) == (devices, 96.0,
                                                                               topology)
    assert data["weight_bytes_per_device"] == weights and data["weight_dtype"] == "fp8"
    assert data["reserve_gib_per_device"] == pytest.approx(9.6)
    kv = 96.0 - weights / GIB - 9.6
    assert data["kv_gib_per_device"] == pytest.approx(kv) and data["weights_fit"]
    assert data["tokens_that_fit_fp8"] == int(kv * GIB) * devices // data["bytes_per_token_fp8"]
    assert data["tokens_that_fit_bf16"] == int(kv * GIB) * devices // data["bytes_per_token_bf16"]
    assert data["tokens_that_fit"] == data["tokens_that_fit_fp8"]


def test_capacity_glm_ratio_and_dtypes(capsys):
    fp8 = capacity_json(capsys, "--model", "glm-5.2")            # default: tpu7x-16
    assert fp8["topology"] == "tpu7x-16"
    assert (fp8["bytes_per_token_bf16"], fp8["bytes_per_token"]) == (105216, 55296)
    assert fp8["ratio_vs_bf16_2dp"] == "1.90"
    # The latent cache in host memory: the devices hold 21 layers x 128 bf16 indexer keys a
    # token, the hosts 78 layers x 640 fp8 latent bytes.
    assert (fp8["device_bytes_per_token_host_latent"], fp8["host_bytes_per_token"]) == (
        21 * 128 * 2, 78 * 640)
    assert fp8["device_bytes_per_token_host_latent"] + fp8["host_bytes_per_token"] == 55296
    cache_bytes = int(fp8["kv_gib_per_device"] * GIB) * 16
    assert fp8["tokens_that_fit_host_latent"] == cache_bytes // 5376 > 10 * fp8["tokens_that_fit"]
    bf16 = capacity_json(capsys, "--model", "glm-5.2", "--weight-dtype", "bf16")
    assert bf16["weight_bytes_per_device"] > 1.9 * fp8["weight_bytes_per_device"]
    assert not bf16["weights_fit"] and bf16["tokens_that_fit"] == 0     # 89 GiB + reserve
    custom = capacity_json(capsys, "--devices", "8", "--hbm-gib", "200", "--reserve-gib", "4")
    assert custom["topology"] is None and custom["reserve_gib_per_device"] == 4.0
    assert custom["weight_bytes_per_device"] == weight_bytes_per_device(
        load_model_config("glm-5.2"), 8, "fp8")


@pytest.mark.parametrize("argv, match", [
    (["--hbm-gib", "inf", "--devices", "4"], "argument --hbm-gib: 'inf' must be a finite"),
    (["--devices", "0", "--hbm-gib", "4"], "argument --devices: '0' must be positive"),
    (["--weight-dtype", "int4"], "argument --weight-dtype: invalid choice"),
    (["--topology", "tpu9"], "argument --topology: invalid choice"),
])
def test_capacity_cli_usage_errors(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        cli.main(["capacity", *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--devices", "4"], "--devices and --hbm-gib go together"),
    (["--topology", "tpu7x-32", "--devices", "4", "--hbm-gib", "9"], "not both"),
])
def test_capacity_cli_conflicts(capsys, argv, match):
    assert cli.main(["capacity", *argv]) == 2
    assert match in capsys.readouterr().err
