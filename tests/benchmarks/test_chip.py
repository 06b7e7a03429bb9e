"""`cp-runtime bench chip` (benchmarks/chip.py): its quick mode end to end on the CPU, through the
command line as a TPU host runs it (no matplotlib needed), with the profiler trace read; the
random weights it makes on the host in their stored dtype; the arithmetic of what fits and of the
floors; and, marked `tpu` (deselected by default), a quick run on a real TPU whose floors must
sit under what it measured."""

import json

import jax
import numpy as np
import pytest

from cp_runtime.benchmarks._shared import chip_measure, chip_trace
from cp_runtime.cache.capacity import bytes_per_token
from cp_runtime.config import RuntimeConfig, load_model_config
from cp_runtime.weights.format import STORED_DTYPES, device_tensors
from cp_runtime.weights.fp8_blocks import dequantize
from cp_runtime.weights.host_init import RandomBlocks, tensor_std
from cp_runtime.weights.params import model_shapes
from cp_runtime.weights.placement import place_weights


def _bench(argv: list[str], out) -> dict:
    from cp_runtime.cli.main import main
    assert main(["bench", "chip", *argv, "--no-progress", "--out", str(out)]) == 0
    return json.loads((out / "chip.json").read_text())


def test_quick_runs_on_the_cpu(tmp_path):
    d = _bench(["--quick", "--trace"], tmp_path)
    assert d["errors"] == [] and d["skipped"] == []
    assert d["model"]["name"] == "tiny" and d["model"]["layers"] == 2
    assert [r["context"] for r in d["prefill"]] == [512, 1024]
    assert [r["batch"] for r in d["decode"]] == [1, 2]
    assert d["peaks"]["matmul_tflop_per_s"] > 0 and d["peaks"]["hbm_gb_per_s"] > 0
    cold = d["cold_start"]
    assert cold["weights_bytes"] > 0 and cold["weights_gb_per_s"] > 0
    assert cold["programs_compiled"] >= cold["step_programs"] >= 4
    for r in d["prefill"]:
        assert r["tok_per_s"] > 0 and 0 < r["warm_s"] <= r["wall_s"]
        assert r["floor_flops"] > 0 and r["mxu_share"] > 0
    for r in d["decode"]:
        assert r["step_ms"] > 0 and r["floor_bytes"] > 0 and r["hbm_share"] > 0
        assert r["trace"]["available"], r["trace"]
        assert "sparse_attention" in r["trace"]["phases_ms"]
    assert d["prefill_trace"]["available"] and d["phases"]


def test_random_weights_are_made_in_their_stored_dtype():
    tiny = load_model_config("tiny")
    source = RandomBlocks(tiny, "fp8", seed=3)
    name = "model.layers.1.mlp.experts.down_proj.weight"          # [E, inner, hidden]
    whole = source.read(name, None, 0, 0)
    assert whole.values.dtype == STORED_DTYPES["fp8"] and whole.scales is not None
    values = dequantize(whole, "f32")
    assert np.isfinite(values).all()
    rms, std = float(np.sqrt((values ** 2).mean())), tensor_std(name, whole.values.shape)
    assert 0.8 * std < rms < 1.25 * std
    embed = source.read("model.embed_tokens.weight", None, 0, 0).values
    assert embed.dtype == STORED_DTYPES["bf16"]
    assert 0.5 < float(np.sqrt((embed.astype(np.float32) ** 2).mean())) < 2
    part = source.read(name, 2, 16, 48, experts=(1, 3))
    np.testing.assert_array_equal(part.values.view(np.uint8),
                                  whole.values[1:3, :, 16:48].view(np.uint8))
    assert part.first == (0, 16)
    again = RandomBlocks(tiny, "fp8", seed=3).read(name, None, 0, 0).values
    np.testing.assert_array_equal(again.view(np.uint8), whole.values.view(np.uint8))


def test_random_weights_place_split_over_devices():
    """Each device's block of every tensor is the source's, split as the layout says."""
    tiny = load_model_config("tiny")
    source = RandomBlocks(tiny, "fp8")
    tensors = device_tensors(source.shapes, tiny, "sharded", "fp8", 2)
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    placed = place_weights(source, tensors, mesh, "cp")
    for name in source.shapes:
        want = source.read(name, None, 0, 0).values
        got = np.asarray(placed[name])
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)


def test_an_engine_on_random_fp8_weights_gives_finite_logits():
    from cp_runtime.engine import Engine, LocalExecutor
    tiny = load_model_config("tiny")
    rt = RuntimeConfig(model="tiny", num_shards=1, pages_per_shard=16, page_size=16,
                       chunk_size=64, weight_dtype="fp8", weights="replicated")
    engine = Engine(tiny, rt, LocalExecutor(tiny, rt, RandomBlocks(tiny, "fp8")))
    session = engine.create_session()
    logits = engine.extend(session.id, list(range(100)))
    assert np.isfinite(logits).all() and 0.1 < float(np.std(logits)) < 100


def test_glm_fits_three_layers_on_a_v5e_chip():
    """15.75 GiB: the three dense layers and a 128K pool fit, the first MoE layer (9.9 GB of
    fp8 experts) does not."""
    glm = load_model_config("glm-5.2")
    fit = chip_measure.fit_layers(glm, weight_dtype="fp8", kv_cache_dtype="fp8_e4m3",
                                  memory=int(15.75 * 2 ** 30), pages=2048 + 200, page_size=64,
                                  chunk=8192)
    assert fit["layers"] == 3 and fit["fits"]
    assert not chip_measure.fit_layers(glm, weight_dtype="fp8", kv_cache_dtype="fp8_e4m3",
                                       memory=int(15.75 * 2 ** 30), pages=2048 + 200,
                                       page_size=64, chunk=8192, layers=4)["fits"]


def test_decode_floor_reads_the_weights_once_and_each_row_its_cache():
    """GLM-5.2's first 4 layers (full indexers, the 4th MoE) at 131,008 tokens: page 2047."""
    glm = chip_measure.cut_model(load_model_config("glm-5.2"), 4)
    tensors = device_tensors(model_shapes(glm), glm, "replicated", "fp8", 1)
    peaks = {"matmul_tflop_per_s": 197.0, "hbm_gb_per_s": 819.0}
    row = (4 * 2047 * 64 * 128 * 2                # the indexer's bf16 keys, 4 full layers
           + 4 * (1 + 2048 // 64) * 64 * 640      # 33 fp8 latent pages a layer
           + bytes_per_token(glm, "fp8_e4m3"))    # the row's cache write
    whole = sum(t.nbytes_per_device for t in tensors.values())
    for b in (1, 8):
        floor = chip_measure.decode_floor(glm, peaks, tensors, batch=b, context=131008,
                                          page_size=64, kv_cache_dtype="fp8_e4m3")
        weights = chip_measure.weight_read_bytes(tensors, glm, b, b)
        assert floor.bytes == weights + b * row
        assert floor.hbm_s == pytest.approx(floor.bytes / 819e9)
    # 8 of 256 experts and one embedding row of a whole model's bytes; 64 experts for 8 rows
    assert chip_measure.weight_read_bytes(tensors, glm, 1, 1) < 0.5 * whole
    assert chip_measure.weight_read_bytes(tensors, glm, 8, 8) < whole


def test_self_times_leave_out_nested_events():
    # (start, duration): a loop of 10 holding two ops of 3 and 2, then an op of 4
    events = [(0, 10, "while"), (1, 3, "a"), (5, 2, "b"), (12, 4, "c")]
    assert chip_trace._self_times(events) == [5, 3, 2, 4]


@pytest.mark.tpu
def test_quick_on_a_tpu_sits_above_its_floors(tmp_path):
    if jax.default_backend() != "tpu":
        pytest.skip("needs a TPU")
    d = _bench(["--quick", "--model", "glm-5.2", "--layers", "2", "--contexts", "8k",
                "--chunk-size", "8k", "--batches", "1,8", "--trace"], tmp_path)
    assert d["errors"] == [], d["errors"]
    assert d["peaks"]["matmul_tflop_per_s"] > 10 and d["peaks"]["hbm_read_gb_per_s"] > 100
    assert d["cold_start"]["weights_gb_per_s"] > 0.1
    assert d["prefill"] and d["decode"]
    for r in d["prefill"]:
        assert r["floor_mxu_ms"] < 1e3 * r["warm_s"]
        assert 0 < r["mxu_share"] <= 1
    for r in d["decode"]:
        assert r["floor_hbm_ms"] < r["step_ms"]
        assert 0 < r["hbm_share"] <= 1
        if r["trace"]["available"]:
            assert 0 < r["device_ms"] <= r["step_ms"]


@pytest.mark.tpu
def test_greedy_tokens_on_a_tpu_follow_the_cpu_oracle(tiny, tiny_params):
    """The engine on the chip (its Pallas kernels, fp8 cache, token selection) generates what
    the CPU's oracle ranks first: each greedy token the oracle's argmax, or within 0.02 of its
    top logit (bf16 MXU products and an fp8 cache on the chip against f32 on the CPU)."""
    if jax.default_backend() != "tpu":
        pytest.skip("needs a TPU")
    import jax.numpy as jnp

    from conftest import make_engine, random_tokens
    from cp_runtime.engine.requests import Extend, Generate, SamplingParams, Token
    from cp_runtime.model.oracle import oracle_logits

    engine = make_engine(tiny, tiny_params, num_shards=1, pages_per_shard=64, page_size=16,
                         chunk_size=64)
    session = engine.create_session()
    prompt = random_tokens(tiny, 300, 0)
    engine.submit(Extend(id="x", session=session.id, tokens=np.asarray(prompt)))
    while engine.has_work:
        engine.step()
    engine.submit(Generate(id="g", session=session.id, sampling=SamplingParams(max_tokens=12)))
    tokens = []
    while engine.has_work:
        tokens += [e.token for e in engine.step() if isinstance(e, Token)]
    assert len(tokens) == 12
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ref = np.asarray(oracle_logits(jax.device_put(tiny_params, cpu),
                                       jnp.asarray(prompt + tokens[:-1]), cfg=tiny,
                                       page_size=16))[len(prompt) - 1:]
    gaps = ref.max(-1) - ref[np.arange(len(tokens)), tokens]
    assert (gaps <= 0.02 * np.abs(ref).max(-1)).all(), gaps
    assert (ref.argmax(-1) == tokens).mean() >= 0.75
