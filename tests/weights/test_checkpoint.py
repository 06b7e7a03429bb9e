"""Hugging Face DeepSeek-V3.2-format checkpoints (cp_runtime.weights.checkpoint), YaRN rope and
group-limited routing (cp_runtime.model.expert_router), and `benchmarks.niah --checkpoint DIR` end
to end.

A tiny checkpoint is written once per module: config.json with YaRN, fp8 quantisation in 16x32
blocks (non-square, so a swapped block axis shows; most weights have partial edge blocks), 4
expert groups and one MTP layer whose
tensors are present; weights sharded over two files with an index; a byte-level BPE tokenizer
trained here on the needle benchmark's words.
"""

import dataclasses
import json
import math
import re
import shutil
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_engine, random_tokens, rel_l2
from safetensors.numpy import save_file
from serving_helpers import start_server, stop_server

import cp_runtime

from cp_runtime.benchmarks import niah
from cp_runtime.benchmarks._shared import needles
from cp_runtime.config import ConfigError, ModelConfig, RopeScaling, load_model_config
from cp_runtime.model.attention_inputs import mla_inputs
from cp_runtime.model.ops import rope, rope_frequencies
from cp_runtime.model.expert_router import dense_expert_weights
from cp_runtime.model.oracle import oracle_logits
from cp_runtime.weights.checkpoint import (load_checkpoint, load_hf_params, load_tokenizer,
                                           read_hf_config)
from cp_runtime.weights.params import init_params, layer_params, param_shapes

BLOCK = (16, 32)   # [out, in]
E4M3_MAX = 448.0
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
HF_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "vocab_size": 512, "hidden_size": 72, "num_hidden_layers": 2, "num_attention_heads": 4,
    "q_lora_rank": 40, "kv_lora_rank": 40, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
    "v_head_dim": 16, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 64,
    "first_k_dense_replace": 1, "intermediate_size": 88, "moe_intermediate_size": 24,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 4,
    "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 163840, "rope_scaling": YARN,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": list(BLOCK)},
}


def expected_config(name: str) -> ModelConfig:
    hf = HF_CONFIG
    return ModelConfig(
        name=name, vocab_size=512, hidden_size=72, num_hidden_layers=2, num_attention_heads=4,
        q_lora_rank=40, kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        index_n_heads=4, index_head_dim=32, index_topk=64, indexer_types=("full", "full"),
        first_k_dense_replace=1, intermediate_size=88, moe_intermediate_size=24,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, rms_norm_eps=1e-6,
        rope_theta=10000.0, routed_scaling_factor=2.5, tie_word_embeddings=False,
        n_group=hf["n_group"], topk_group=hf["topk_group"], norm_topk_prob=True,
        rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        weight_dtype="fp8")


# -- writing a checkpoint ---------------------------------------------------------------------
def quantize(w: np.ndarray, block=BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """f32[out, in] -> (f8_e4m3[out, in], scale_inv f32[ceil(out/bo), ceil(in/bi)])."""
    bo, bi = block
    scale = np.zeros((-(-w.shape[0] // bo), -(-w.shape[1] // bi)), np.float32)
    q = np.zeros(w.shape, jnp.float8_e4m3fn)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            scale[r, c] = np.abs(blk).max() / E4M3_MAX
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / scale[r, c]).astype(q.dtype)
    return q, scale


def dequantize_by_blocks(q: np.ndarray, scale: np.ndarray, block=BLOCK) -> np.ndarray:
    """The test's own dequantisation: a loop over blocks."""
    bo, bi = block
    out = np.zeros(q.shape, np.float32)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            sl = np.s_[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            out[sl] = q[sl].astype(np.float32) * scale[r, c]
    return out


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """As in DeepSeek-V3.2: every linear weight but the embedding, head, router and indexer
    head weights is fp8."""
    plain = ("embed_tokens", "lm_head", "mlp.gate.weight", "weights_proj")
    return len(shape) == 2 and not any(p in name for p in plain)


def checkpoint_tensors(cfg: ModelConfig, seed: int, block=BLOCK) -> tuple[dict, dict]:
    """({stored name: array as stored}, {HF name: f32 weight the loader must return})."""
    stored, expected = {}, {}
    for name, w in init_params(cfg, seed).items():
        w = np.asarray(w, np.float32)
        if is_quantized(name, w.shape):
            q, s = quantize(w, block)
            stored[name], stored[name + "_scale_inv"] = q, s
            expected[name] = dequantize_by_blocks(q, s, block)
        elif name.endswith("e_score_correction_bias"):
            stored[name] = expected[name] = w + np.linspace(-0.5, 0.5, w.size, dtype=np.float32)
        else:
            stored[name] = w.astype(jnp.bfloat16)
            expected[name] = stored[name].astype(np.float32)
    # The MTP layer (model.layers.{num_hidden_layers}): present, never read.
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    q, s = quantize(np.ones((cfg.hidden_size, 2 * cfg.hidden_size), np.float32), block)
    stored |= {mtp + "eh_proj.weight": q, mtp + "eh_proj.weight_scale_inv": s,
               mtp + "enorm.weight": np.ones(cfg.hidden_size, jnp.bfloat16)}
    last = cfg.num_hidden_layers - 1
    stored |= {mtp + k: np.zeros(np.shape(v), np.float32)
               for k, v in layer_params(expected, last).items()}
    return stored, expected


def split_shards(stored: dict) -> dict[str, dict]:
    """Two shards; layer 0's o_proj scale sits in the other shard than its weight."""
    first = "model-00001-of-00002.safetensors"
    second = "model-00002-of-00002.safetensors"
    shards = {first: {}, second: {}}
    for name, x in stored.items():
        in_first = name.startswith(("model.embed_tokens", "model.layers.0."))
        if name == "model.layers.0.self_attn.o_proj.weight_scale_inv":
            in_first = False
        shards[first if in_first else second][name] = x
    return shards


def write_shards(d, shards: dict[str, dict]) -> None:
    for fname, tensors in shards.items():
        save_file(tensors, str(d / fname))
    weight_map = {n: f for f, ts in shards.items() for n in ts}
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))


def write_checkpoint(d, hf_config: dict, seed: int) -> tuple[ModelConfig, dict]:
    """A fresh checkpoint directory `d` for `hf_config` (config.json, fp8 shards; no tokenizer):
    its config as read back, and the dequantised weights a loader must produce."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config))
    cfg = read_hf_config(d)
    stored, expected = checkpoint_tensors(cfg, seed=seed)
    write_shards(d, split_shards(stored))
    return cfg, expected


def niah_corpus() -> list[str]:
    words = [*needles.SUBJECTS, *needles.VERBS, *needles.OBJECTS, *needles.KEY_WORDS]
    lines = [f" {w}." for w in words] + [" ".join(words)]
    lines += [" The registered code for the amber-cobalt account is 1234567.",
              ("\nQuestion: what is the registered code for the amber-cobalt account?\n"
               "Answer: The registered code for the amber-cobalt account is 8901234.")]
    return lines * 4


def write_tokenizer(d) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(niah_corpus(), trainer)
    tok.save(str(d / "tokenizer.json"))
    added = {"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True,
             "rstrip": False, "single_word": False}
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "add_eos_token": False, "bos_token": added, "eos_token": EOS}))


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    dir: object
    cfg: ModelConfig
    shards: dict
    expected: dict


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Checkpoint:
    d = tmp_path_factory.mktemp("ckpt") / "tiny-v32"
    d.mkdir()
    cfg = expected_config(d.name)
    stored, expected = checkpoint_tensors(cfg, seed=3)
    shards = split_shards(stored)
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    write_shards(d, shards)
    write_tokenizer(d)
    return Checkpoint(d, cfg, shards, expected)


def copy_of(ckpt: Checkpoint, tmp_path):
    d = tmp_path / ckpt.dir.name
    shutil.copytree(ckpt.dir, d)
    return d


# -- config ---------------------------------------------------------------------------------
def test_read_hf_config(ckpt):
    assert read_hf_config(ckpt.dir) == ckpt.cfg


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {**YARN, "type": "dynamic"}}, "rope_scaling type 'dynamic'"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"model_type": "llama"}, "model_type"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"n_group": 3}, "n_group"),
])
def test_bad_config_named(ckpt, tmp_path, change, match):
    d = copy_of(ckpt, tmp_path)
    hf = {k: v for k, v in (HF_CONFIG | change).items() if v is not None}
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=match):
        read_hf_config(d)


def test_rope_parameters_format(ckpt, tmp_path):
    """The newer HF format: rope_theta and the YaRN table together in `rope_parameters`."""
    d = copy_of(ckpt, tmp_path)
    classic = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0,
            **{k: v for k, v in YARN.items() if k != "type"}}
    (d / "config.json").write_text(json.dumps(classic | {"rope_parameters": yarn}))
    assert read_hf_config(d) == ckpt.cfg
    plain = {"rope_type": "default", "rope_theta": 50000.0}
    (d / "config.json").write_text(json.dumps(classic | {"rope_parameters": plain}))
    cfg = read_hf_config(d)
    assert cfg.rope_scaling is None and cfg.rope_theta == 50000.0


def test_toml_rope_scaling(tmp_path):
    ds = load_model_config("deepseek-v3.2")
    assert ds.rope_scaling == RopeScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert (ds.n_group, ds.topk_group, ds.norm_topk_prob) == (8, 4, True)
    text = (load_model_config.__globals__["CONFIG_DIR"] / "models" / "tiny.toml").read_text()
    path = tmp_path / "yarn.toml"
    path.write_text(text + "\n[rope_scaling]\nfactor = 4\noriginal_max_position_embeddings = 64\n")
    assert load_model_config(path).rope_scaling == RopeScaling(4.0, 64)
    path.write_text(text + "\n[rope_scaling]\nfactor = 4\noriginal_max_position_embeddings = 64\n"
                           "colour = 1\n")
    with pytest.raises(ConfigError, match=r"yarn\.toml: unknown field 'rope_scaling\.colour'"):
        load_model_config(path)


# -- weights --------------------------------------------------------------------------------
def test_load_hf_params_dequantizes_exactly(ckpt):
    params = load_hf_params(ckpt.dir, ckpt.cfg)
    assert set(params) == set(param_shapes(ckpt.cfg))           # no MTP-layer tensors
    for name, want in ckpt.expected.items():
        assert params[name].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(params[name]), want, err_msg=name)
    # The blocks were scaled differently: dequantisation used more than one scale per tensor.
    scale = ckpt.shards["model-00002-of-00002.safetensors"][
        "model.layers.0.self_attn.o_proj.weight_scale_inv"]
    assert scale.shape == (5, 2) and len(np.unique(scale)) > 1


def test_single_file_checkpoint(ckpt, tmp_path):
    d = copy_of(ckpt, tmp_path)
    for f in [*ckpt.shards, "model.safetensors.index.json"]:
        (d / f).unlink()
    save_file({n: x for ts in ckpt.shards.values() for n, x in ts.items()},
              str(d / "model.safetensors"))
    params = load_hf_params(d, ckpt.cfg)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    np.testing.assert_array_equal(np.asarray(params[name]), ckpt.expected[name])


def test_power_of_two_scales_in_e8m0(ckpt, tmp_path):
    """scale_fmt ue8m0 checkpoints: scales that are powers of two, possibly stored as e8m0."""
    d = copy_of(ckpt, tmp_path)
    shards = {f: dict(ts) for f, ts in ckpt.shards.items()}
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    second = shards["model-00002-of-00002.safetensors"]
    pow2 = np.exp2(np.round(np.log2(second[name + "_scale_inv"]))).astype(np.float32)
    second[name + "_scale_inv"] = pow2.astype(jnp.float8_e8m0fnu)
    write_shards(d, shards)
    got = load_hf_params(d, ckpt.cfg)[name]
    np.testing.assert_array_equal(np.asarray(got), dequantize_by_blocks(second[name], pow2))


SCALE = "model.layers.0.self_attn.o_proj.weight_scale_inv"
WEIGHT = "model.layers.1.self_attn.q_b_proj.weight"


def test_missing_shard_file(ckpt, tmp_path):
    d = copy_of(ckpt, tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard file 'model-00002-of-00002\.safetensors' "
                                         r"\(holding 'model\."):
        load_hf_params(d, ckpt.cfg)


def test_missing_scale(ckpt, tmp_path):
    d = copy_of(ckpt, tmp_path)
    shards = {f: dict(ts) for f, ts in ckpt.shards.items()}
    del shards["model-00002-of-00002.safetensors"][SCALE]
    write_shards(d, shards)
    with pytest.raises(ValueError, match=rf"index\.json: missing tensor '{re.escape(SCALE)}' "
                                         r"\(the scale of 'model\.layers\.0\.self_attn\.o_proj"):
        load_hf_params(d, ckpt.cfg)


def test_missing_tensor(ckpt, tmp_path):
    d = copy_of(ckpt, tmp_path)
    shards = {f: dict(ts) for f, ts in ckpt.shards.items()}
    del shards["model-00002-of-00002.safetensors"]["model.norm.weight"]
    write_shards(d, shards)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.norm\.weight'"):
        load_hf_params(d, ckpt.cfg)


def test_wrong_shapes(ckpt, tmp_path):
    d = copy_of(ckpt, tmp_path)
    shards = {f: dict(ts) for f, ts in ckpt.shards.items()}
    second = shards["model-00002-of-00002.safetensors"]
    second["model.norm.weight"] = np.ones(7, jnp.bfloat16)
    write_shards(d, shards)
    with pytest.raises(ValueError, match=r"00002\.safetensors: tensor 'model\.norm\.weight' "
                                         r"has shape \(7,\)"):
        load_hf_params(d, ckpt.cfg)
    second["model.norm.weight"] = ckpt.shards["model-00002-of-00002.safetensors"][
        "model.norm.weight"]
    second[WEIGHT + "_scale_inv"] = np.ones((2, 2), np.float32)
    write_shards(d, shards)
    with pytest.raises(ValueError, match=rf"'{re.escape(WEIGHT)}_scale_inv' has shape \(2, 2\)"):
        load_hf_params(d, ckpt.cfg)


# -- corrupted safetensors files --------------------------------------------------------------
def raw_safetensors(path, header, data: bytes, length: int | None = None) -> None:
    """Write a .safetensors file by hand: 8-byte header length (given, or the true one), the
    header (JSON of `header`, or `header` itself when bytes), then `data`."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD_HEADER = {"__metadata__": {"format": "pt"}, "a": entry("F32", [2, 2], 0, 16),
               "b": entry("BF16", [3], 16, 22)}


@pytest.mark.parametrize("header, data, length, match", [
    (GOOD_HEADER, bytes(22), 1 << 40, r"header length 1099511627776 exceeds the 100000000-byte"),
    (GOOD_HEADER, bytes(22), 5000, r"header length 5000 exceeds the \d+ bytes after it"),
    (b"[1, 2]", b"", None, r"header is a JSON list, not an object"),
    (b"{not json", b"", None, r"header is not valid JSON"),
    ({"a": [1]}, bytes(16), None, r"tensor 'a': header entry is \[1\], not an object"),
    ({"a": entry("C64", [2], 0, 16)}, bytes(16), None, r"tensor 'a': dtype 'C64' is not one"),
    ({"a": entry("F32", [2, -2], 0, 16)}, bytes(16), None, r"tensor 'a': shape \[2, -2\]"),
    ({"a": entry("F32", "2x2", 0, 16)}, bytes(16), None, r"tensor 'a': shape '2x2'"),
    ({"a": {"dtype": "F32", "shape": [4]}}, bytes(16), None, r"tensor 'a': data_offsets None"),
    ({"a": entry("F32", [4], 16, 0)}, bytes(16), None, r"tensor 'a': data_offsets \[16, 0\]"),
    ({"a": entry("F32", [2, 2], 0, 12)}, bytes(12), None,
     r"tensor 'a': data_offsets \[0, 12\] hold 12 bytes; F32 \[2, 2\] needs 16"),
    ({"a": entry("F32", [4], 0, 16), "b": entry("F32", [2], 8, 16)}, bytes(16), None,
     r"tensor 'b' at bytes \[8, 16\) overlaps tensor 'a', which ends at 16"),
    ({"a": entry("F32", [4], 0, 16), "b": entry("F32", [1], 20, 24)}, bytes(24), None,
     r"tensor 'b' starts at byte 20, leaving a gap after byte 16 \(the end of 'a'\)"),
    ({"a": entry("F32", [4], 4, 20)}, bytes(20), None, r"tensor 'a' starts at byte 4"),
    ({"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 16, 32)}, bytes(24), None,
     r"tensor 'b' ends at byte 32, past the 24-byte data section"),
    ({"a": entry("F32", [4], 0, 16)}, bytes(20), None,
     r"4 bytes after the last tensor 'a' belong to no tensor"),
    ({"__metadata__": [1], "a": entry("F32", [4], 0, 16)}, bytes(16), None,
     r"header .__metadata__. is not an object"),
])
def test_corrupt_safetensors_named(glm_ckpt, tmp_path, header, data, length, match):
    d = tmp_path / "bad"
    d.mkdir()
    shutil.copy(glm_ckpt.dir / "config.json", d)
    raw_safetensors(d / "model.safetensors", header, data, length)
    with pytest.raises(ValueError, match=r"bad/model\.safetensors: " + match):
        load_hf_params(d, glm_ckpt.cfg)


def test_truncated_safetensors(glm_ckpt, tmp_path):
    d = tmp_path / "cut"
    d.mkdir()
    shutil.copy(glm_ckpt.dir / "config.json", d)
    whole = (glm_ckpt.dir / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(whole[:-10])
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor '[\w.]+' ends at byte "
                                         r"\d+, past the \d+-byte data section \(truncated"):
        load_hf_params(d, glm_ckpt.cfg)
    (d / "model.safetensors").write_bytes(whole[:5])
    with pytest.raises(ValueError, match=r"5 bytes, too short for the 8-byte header length"):
        load_hf_params(d, glm_ckpt.cfg)


def test_hand_written_file_reads(tmp_path):
    """The checked reader accepts a valid hand-written file (metadata, two dtypes)."""
    from cp_runtime.weights.checkpoint import _SafetensorsFile   # the reader the loader uses

    a = np.arange(4, dtype=np.float32).reshape(2, 2)
    b = np.asarray([1, 2, 3], jnp.bfloat16)
    raw_safetensors(tmp_path / "x.safetensors", GOOD_HEADER, a.tobytes() + b.tobytes())
    f = _SafetensorsFile(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(f.read("a"), a)
    np.testing.assert_array_equal(f.read("b").astype(np.float32), [1, 2, 3])


# -- tokenizer ------------------------------------------------------------------------------
@pytest.mark.parametrize("config, bos", [
    ({"bos_token": {"content": BOS}}, 0), ({"bos_token": BOS}, 0),
    ({"bos_token": BOS, "add_bos_token": False}, None), ({}, None)])
def test_tokenizer_bos(ckpt, tmp_path, config, bos):
    d = copy_of(ckpt, tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(d).bos_token_id == bos


def test_tokenizer_round_trip_and_missing_package(ckpt, monkeypatch):
    tok = load_tokenizer(ckpt.dir)
    text = "\nQuestion: what is the registered code for the willow-amber account?"
    ids = tok.encode(text)
    assert tok.bos_token_id not in ids and tok.decode(ids) == text
    monkeypatch.setitem(sys.modules, "tokenizers", None)        # import fails
    with pytest.raises(ValueError, match=r"pip install 'cp-runtime\[hf\]'"):
        load_tokenizer(ckpt.dir)


# -- YaRN -----------------------------------------------------------------------------------
def test_yarn_factor_one_is_plain_rope(tiny, tiny_params):
    one = dataclasses.replace(tiny, rope_scaling=RopeScaling(1.0, 4096, 32.0, 1.0, 1.0, 1.0))
    np.testing.assert_array_equal(rope_frequencies(one), rope_frequencies(tiny))
    assert one.softmax_scale == tiny.softmax_scale
    h = np.random.default_rng(0).standard_normal((9, tiny.hidden_size)).astype(np.float32)
    pos = jnp.arange(100, 109)
    p = layer_params(tiny_params, 0)
    for a, b in zip(mla_inputs(p, one, h, pos), mla_inputs(p, tiny, h, pos)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_yarn_frequencies():
    ds = load_model_config("deepseek-v3.2")
    d = ds.qk_rope_head_dim
    plain = ds.rope_theta ** (-np.arange(0, d, 2, dtype=np.float32) / d)
    yarn = rope_frequencies(ds)
    # Correction dims for 4096 original positions, theta 1e4, d 64: beta_fast 32 turns at 10.47
    # (floor 10), beta_slow 1 turn at 22.5 (ceil 23): pairs up to 10 keep their frequency,
    # pairs from 23 on are divided by 40, those between are blended monotonically.
    np.testing.assert_array_equal(yarn[:11], plain[:11])
    np.testing.assert_array_equal(yarn[23:], plain[23:] / np.float32(40))
    ratio = plain[10:24] / yarn[10:24]
    assert np.all(np.diff(ratio) > 0) and 1 < ratio[1] and ratio[-2] < 40


def test_rope_uses_given_frequencies():
    inv_freq = np.asarray([0.5, 0.03125], np.float32)
    x = np.random.default_rng(1).standard_normal((3, 2, 4)).astype(np.float32)   # [T, H, d]
    pos = np.asarray([0, 5, 17])
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), inv_freq, interleaved=True))
    want = np.empty_like(x)
    for t in range(3):
        for i, f in enumerate(inv_freq):
            c, s = np.cos(pos[t] * f), np.sin(pos[t] * f)
            a, b = x[t, :, 2 * i], x[t, :, 2 * i + 1]
            want[t, :, 2 * i], want[t, :, 2 * i + 1] = a * c - b * s, b * c + a * s
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)   # f32 sin/cos of angles <= 9


def test_softmax_scale_has_yarn_mscale():
    ds = load_model_config("deepseek-v3.2")
    assert ds.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2,
                                             rel=1e-15)
    rs = RopeScaling(40.0, 4096, mscale=0.707, mscale_all_dim=0.707)      # DeepSeek-V2 style
    other = dataclasses.replace(ds, rope_scaling=rs)
    assert other.softmax_scale == pytest.approx(
        192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2, rel=1e-15)
    assert rs.rope_mscale == 1.0


# -- grouped routing ------------------------------------------------------------------------
def _router_inputs(n_experts: int, tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, n_experts)).astype(np.float32)
    # Many biased scores below 0: a dropped group must lose to them (-inf, not 0).
    bias = (rng.standard_normal(n_experts) - 0.5).astype(np.float32)
    return logits, bias


def test_routing_one_group_is_unchanged(tiny):
    logits, bias = _router_inputs(tiny.n_routed_experts, 64, 0)
    got = np.asarray(dense_expert_weights(tiny, jnp.asarray(logits), jnp.asarray(bias)))
    # Routing before groups existed: top-k of the biased scores, normalised unbiased scores.
    s = jax.nn.sigmoid(jnp.asarray(logits))
    _, chosen = jax.lax.top_k(s + bias, tiny.num_experts_per_tok)
    mask = jax.nn.one_hot(chosen, tiny.n_routed_experts, dtype=s.dtype).sum(-2)
    gate = s * mask
    before = gate / gate.sum(-1, keepdims=True) * tiny.routed_scaling_factor
    np.testing.assert_array_equal(got, np.asarray(before))
    assert np.allclose(got.sum(-1), tiny.routed_scaling_factor)


def numpy_route(logits, bias, n_group, topk_group, k, norm, scale):
    """The routing rule as a loop over tokens: f32[T, E] weights."""
    t, e = logits.shape
    size = e // n_group
    out = np.zeros((t, e))
    for row in range(t):
        s = 1 / (1 + np.exp(-logits[row].astype(np.float64)))
        b = s + bias
        group_score = [np.sort(b[g * size:(g + 1) * size])[-2:].sum() for g in range(n_group)]
        groups = np.argsort(group_score)[::-1][:topk_group]
        allowed = [x for g in groups for x in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda x: -b[x])[:k]
        w = s[chosen] / (s[chosen].sum() if norm else 1.0)
        out[row, chosen] = w * scale
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grouped_routing_matches_loop(tiny, norm):
    # 6 of the 8 experts in the 2 kept groups: some of them score below a dropped expert.
    cfg = dataclasses.replace(tiny, n_routed_experts=16, num_experts_per_tok=6, n_group=4,
                              topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5)
    logits, bias = _router_inputs(16, 64, 1)
    got = np.asarray(dense_expert_weights(cfg, jnp.asarray(logits), jnp.asarray(bias)))
    want = numpy_route(logits, bias, 4, 2, 6, norm, 2.5)
    np.testing.assert_array_equal(got != 0, want != 0)
    np.testing.assert_allclose(got, want, rtol=1e-6)     # f32 sigmoid vs f64
    # Experts used lie in at most topk_group groups per token.
    assert ((got != 0).reshape(64, 4, 4).any(-1).sum(-1) <= 2).all()
    # The group limit mattered: plain top-6 of the biased scores picks other experts somewhere.
    plain = numpy_route(logits, bias, 1, 1, 6, norm, 2.5)
    assert ((plain != 0) != (want != 0)).any()


# -- the model through the runtime ----------------------------------------------------------
def test_loaded_model_paged_matches_oracle(ckpt):
    cfg, params, _ = load_checkpoint(ckpt.dir)
    engine = make_engine(cfg, params, kv_cache_dtype="f32", num_shards=16, pages_per_shard=2,
                         page_size=16, chunk_size=32, max_batch=1, weight_dtype="f32")
    s = engine.create_session()
    toks = random_tokens(cfg, 70, 5)
    out = [engine.extend(s.id, toks, all_logits=True)]
    for step in range(2):
        tok = random_tokens(cfg, 1, 50 + step)[0]
        out.append(engine.decode([s.id], [tok]))
        toks.append(tok)
    out = np.concatenate(out)
    ref = oracle_logits(params, jnp.asarray(toks), cfg=cfg, page_size=16)
    assert rel_l2(out, ref) <= 1e-5     # f32 cache: accumulation order only (measured 4e-7)
    # Each feature took effect: switched off, the same weights give other logits. YaRN with
    # mscale_all_dim 0 and attention_factor 1 has YaRN's frequencies, the plain softmax scale
    # and unscaled cos and sin: the frequencies matter too.
    def logits_of(**change):
        other = dataclasses.replace(cfg, **change)
        return oracle_logits(params, jnp.asarray(toks), cfg=other, page_size=16)

    plain_rope = logits_of(rope_scaling=None)
    assert rel_l2(logits_of(n_group=1, topk_group=1), ref) > 1e-3
    assert rel_l2(plain_rope, ref) > 1e-3
    freqs_only = RopeScaling(40.0, 4096, mscale=0.0, mscale_all_dim=0.0, attention_factor=1.0)
    assert rel_l2(logits_of(rope_scaling=freqs_only), plain_rope) > 1e-3


# -- GLM-5 (glm_moe_dsa) ----------------------------------------------------------------------
# GLM-5's config.json names: rope in `rope_parameters`, rope layouts `rope_interleave` and
# `indexer_rope_interleave`, dense layers as `mlp_layer_types`, the indexer schedule as
# `index_topk_freq` / `index_skip_topk_offset` (freq 2, offset 2 over 4 layers: full, full,
# shared, full). Sizes above 128 so the 128x128 fp8 blocks are several per weight, some partial.
GLM_BLOCK = (128, 128)
GLM_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
    "vocab_size": 512, "hidden_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 136, "kv_lora_rank": 48, "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "index_n_heads": 4, "index_head_dim": 32,
    "index_topk": 64, "index_topk_freq": 2, "index_skip_topk_offset": 2,
    "index_topk_pattern": None, "index_share_for_mtp_iteration": True,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "intermediate_size": 144,
    "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "hidden_act": "silu", "moe_layer_freq": 1, "attention_bias": False, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
    "rope_interleave": True, "indexer_rope_interleave": True, "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 202752,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": list(GLM_BLOCK)},
}


def glm_expected_config(name: str) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=512, hidden_size=160, num_hidden_layers=4, num_attention_heads=4,
        q_lora_rank=136, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=16,
        v_head_dim=32, index_n_heads=4, index_head_dim=32, index_topk=64,
        indexer_types=("full", "full", "shared", "full"), first_k_dense_replace=1,
        intermediate_size=144, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, rms_norm_eps=1e-5, rope_theta=8e6,
        routed_scaling_factor=2.5, mla_rope_interleaved=True, index_rope_interleaved=True,
        weight_dtype="fp8")


@pytest.fixture(scope="module")
def glm_ckpt(tmp_path_factory) -> Checkpoint:
    """A single-file GLM-5-format checkpoint with 128x128 fp8 blocks (no tokenizer)."""
    d = tmp_path_factory.mktemp("ckpt") / "tiny-glm5"
    d.mkdir()
    cfg = glm_expected_config(d.name)
    stored, expected = checkpoint_tensors(cfg, seed=4, block=GLM_BLOCK)
    (d / "config.json").write_text(json.dumps(GLM_CONFIG))
    save_file(stored, str(d / "model.safetensors"))
    return Checkpoint(d, cfg, {"model.safetensors": stored}, expected)


def write_config(tmp_path, hf: dict):
    d = tmp_path / "glm"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    return d


def test_read_glm_config(glm_ckpt):
    assert read_hf_config(glm_ckpt.dir) == glm_ckpt.cfg


def test_glm_indexer_schedule_of_glm5():
    """offset 3, freq 4 over 78 layers: the first three, then every fourth from 6 (21 full)."""
    hf = GLM_CONFIG | {"num_hidden_layers": 78, "index_topk_freq": 4,
                       "index_skip_topk_offset": 3, "mlp_layer_types": None,
                       "first_k_dense_replace": 3}
    cfg = read_hf_config.__globals__["_model_config"](
        {k: v for k, v in hf.items() if v is not None}, "glm5", where="glm5/config.json")
    assert cfg.full_layers == (0, 1, 2, *range(6, 78, 4)) and cfg.num_full_layers == 21
    assert cfg.first_k_dense_replace == 3


def test_glm_explicit_indexer_types_win(tmp_path):
    types = ["full", "shared", "shared", "shared"]
    d = write_config(tmp_path, GLM_CONFIG | {"indexer_types": types,
                                             "index_topk_pattern": "unknown"})
    assert read_hf_config(d).indexer_types == tuple(types)


@pytest.mark.parametrize("change, match", [
    ({"kv_lora_rank": None}, r"config\.json: lacks required field 'kv_lora_rank'"),
    ({"index_topk_freq": "2"}, r"index_topk_freq='2' must be an integer"),
    ({"index_topk_pattern": "FSXS"}, r"index_topk_pattern='FSXS' has 'X'"),
    ({"index_topk_pattern": ["full", "sparse", "full", "full"]}, r"indexer_types 'sparse'"),
    ({"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, r"mlp_layer_types must be 4"),
    ({"mlp_layer_types": ["dense", "sparse"]}, r"mlp_layer_types must be 4"),
    ({"topk_method": "greedy"}, r"topk_method='greedy' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_scaling type"),
    ({"indexer_types": ["shared"] * 4}, r"indexer_types\[0\] must be 'full'"),
])
def test_bad_glm_config_named(tmp_path, change, match):
    with pytest.raises(ValueError, match=match):
        read_hf_config(write_config(tmp_path, GLM_CONFIG | change))


def test_glm_fp8_blocks_dequantize_exactly(glm_ckpt):
    params = load_hf_params(glm_ckpt.dir, glm_ckpt.cfg)
    assert set(params) == set(param_shapes(glm_ckpt.cfg))
    for name, want in glm_ckpt.expected.items():
        np.testing.assert_array_equal(np.asarray(params[name]), want, err_msg=name)
    # No indexer on the shared layer 2; q_b_proj [160, 136] spans 2 x 2 blocks of 128.
    assert "model.layers.2.self_attn.indexer.wk.weight" not in params
    scale = glm_ckpt.shards["model.safetensors"]["model.layers.0.self_attn.q_b_proj.weight"
                                                 "_scale_inv"]
    assert scale.shape == (2, 2) and len(np.unique(scale)) == 4


def test_glm_model_paged_matches_oracle(glm_ckpt):
    cfg = read_hf_config(glm_ckpt.dir)
    params = load_hf_params(glm_ckpt.dir, cfg)
    engine = make_engine(cfg, params, kv_cache_dtype="f32", num_shards=16, pages_per_shard=2,
                         page_size=16, chunk_size=32, max_batch=1, weight_dtype="f32")
    s = engine.create_session()
    toks = random_tokens(cfg, 90, 6)
    out = [engine.extend(s.id, toks, all_logits=True)]
    tok = random_tokens(cfg, 1, 60)[0]
    out.append(engine.decode([s.id], [tok]))
    toks.append(tok)
    out = np.concatenate(out)
    ref = oracle_logits(params, jnp.asarray(toks), cfg=cfg, page_size=16)
    assert rel_l2(out, ref) <= 1e-5     # f32 cache: accumulation order only


# -- the needle benchmark -------------------------------------------------------------------
def test_text_needles_decode(ckpt):
    tok = load_tokenizer(ckpt.dir)
    ctx = needles.text_context(tok, needles.VARIANTS["single"], 512, (0.0, 1.0),
                            np.random.default_rng(0))
    assert ctx.haystack[0] == tok.bos_token_id and len(ctx.haystack) == 512
    for case in ctx.cases:
        (probe,) = case.probes
        question = tok.decode(probe.prompt)
        m = re.fullmatch(r"\nQuestion: what is the registered code for the (\w+-\w+) account\?"
                         r"\nAnswer: The registered code for the \1 account is", question)
        assert m, question
        value = tok.decode(probe.answer)
        assert re.fullmatch(r" \d{7}", value), value
        needle = f" The registered code for the {m.group(1)} account is{value}."
        assert needle in tok.decode(case.suffix.tolist())


@pytest.mark.slow             # kept out of the default suite for its time budget
def test_niah_runs_checkpoint(ckpt, tmp_path):
    out = tmp_path / "out"
    assert niah.main(["--checkpoint", str(ckpt.dir), "--lengths", "512", "--depths", "2",
                      "--variants", "single", "--kv-cache-dtypes", "fp8_e4m3", "--shards", "16",
                      "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "niah.json").read_text())
    assert report["model"] == ckpt.dir.name
    assert len(report["cells"]) == 2 and all(c["trials"] == 1 for c in report["cells"])
    assert all(np.isfinite(c["logprob"]) for c in report["cells"])


def test_a_served_checkpoint_takes_text_and_returns_text(ckpt):
    """`cp-runtime serve --checkpoint DIR`: extend takes text through the checkpoint's
    tokenizer and generate returns the generated tokens' text."""
    server = start_server("--checkpoint", str(ckpt.dir))
    try:
        with cp_runtime.Client(server.address) as client:
            assert client.server["text"] is True and client.server["model"] == str(ckpt.dir)
            session = client.create_session()
            text = "The river pilot walked past the grey harbour wall"
            assert session.extend(text)["length"] == len(load_tokenizer(ckpt.dir).encode(text))
            gen = session.generate(max_tokens=5)
            assert gen.text == load_tokenizer(ckpt.dir).decode(gen.tokens)
    finally:
        stop_server(server)
