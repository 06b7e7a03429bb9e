"""The tpu7x-16 model (benchmarks/tpu_model.py): terms add up, units are what they say, the
rates enter where they should, and docs/performance.md shows exactly what the module prints."""

import dataclasses
import json
import pathlib

import pytest

from cp_runtime.benchmarks import tpu_model
from cp_runtime.benchmarks.throughput import matmul_weights, projection_work
from cp_runtime.config import load_model_config

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "performance.md"


@pytest.fixture(scope="module")
def glm():
    return load_model_config("glm-5.2")


HW = tpu_model.tpu7x_16()
SETUP = tpu_model.Setup()


def test_device_is_half_a_chip():
    chip = tpu_model.TPU7X_CHIP
    assert HW.devices == 16
    assert HW.hbm_bytes_per_s == pytest.approx(7.37e12 / 2)
    assert HW.bf16_flops == pytest.approx(2307e12 / 2) and HW.fp8_flops == 2 * HW.bf16_flops
    assert HW.hbm_bytes == 96 * 2**30
    assert HW.ici_bytes_per_s == pytest.approx(chip["ici_bidir_bytes_per_s"] / 4)   # 300 GB/s


def test_step_time_is_the_sum_of_its_terms(glm):
    for case in tpu_model.scenarios([8192], [128 << 10], [1, 32]):
        r = tpu_model.evaluate(glm, HW, SETUP, case)
        assert r["seconds"] == pytest.approx(sum(t["ms"] for t in r["terms"]) / 1e3)
        # each term: max of its resources plus its latency
        for t in r["terms"]:
            assert t["ms"] >= 0 and t["bound"] in ("HBM", "MXU", "ICI", "latency", "-")


def test_prefill_sums_its_chunks(glm):
    """Two 8K chunks: the weights are read once per chunk and the projection flops are those of
    16K tokens, split over the 16 devices."""
    terms = {t.name: t for t in tpu_model.prefill_terms(glm, HW, SETUP, length=16384)}
    one = projection_work(glm, 8192, logit_rows=1, param_bytes=1, replicas=1)
    proj = terms["weights + projections"]
    assert proj.flops == pytest.approx(2 * one.flops / 16)
    assert proj.hbm_bytes == pytest.approx(2 * one.bytes / 16)
    assert proj.precision == "fp8"


def test_units_of_decode_terms(glm):
    """Batch 1 at 128K: weight bytes are the active weights + lm_head + one embedding row, fp8,
    over 16 devices; indexer bytes are every local key (padded to key blocks) of the 21 full
    layers in bf16; attention
    reads ceil(129 / 16) = 9 fp8 pages of 16 x 640 per layer, plus its queries and partials."""
    terms = {t.name: t for t in tpu_model.decode_terms(glm, HW, SETUP, context=128 << 10,
                                                       batch=1)}
    hid, ps = glm.hidden_size, SETUP.page_size
    weights = (matmul_weights(glm) + glm.vocab_size * hid + hid) / 16
    assert terms["weights + projections"].hbm_bytes == pytest.approx(weights)
    # 8193 pages -> 513 local pages, padded by the kernel to whole 64-page key blocks: 576
    keys = glm.num_full_layers * 576 * ps * glm.index_head_dim * 2
    assert keys <= terms["indexer scores"].hbm_bytes <= 1.01 * keys
    h, d, v = glm.num_attention_heads, glm.latent_dim, glm.kv_lora_rank
    per_layer = (9 * (ps * d * 1 + 8)           # fp8 pages + their slot/page ids
                 + h * d * 2                    # bf16 query rows
                 + h * (v + 1) * 4)             # f32 partial output and lse
    assert terms["selected-page attention"].hbm_bytes == glm.num_hidden_layers * per_layer
    flops = glm.num_hidden_layers * 2 * 9 * glm.num_attention_heads * ps * (
        glm.latent_dim + glm.kv_lora_rank)
    assert terms["selected-page attention"].flops == pytest.approx(flops)
    # merge: reduce-scatter of f32[1, 64, 512] over heads (ring: 15/16 of it) + all-gather of
    # lse f32[1, 64]
    merge = glm.num_hidden_layers * (15 / 16 * 64 * 512 * 4 + 15 * 64 * 4)
    assert terms["attention merge"].ici_bytes == pytest.approx(merge)
    # q heads: all-gather of f32[1, 64, 640] per layer, of the indexer's f32[1, 32, 128] per full
    heads = 15 / 16 * 4 * (78 * 64 * 640 + 21 * 32 * 128)
    assert terms["q heads all-gather"].ici_bytes == pytest.approx(heads)
    assert terms["collective latency"].collectives == 5 * 78 + 3 * 21


def test_doubling_hbm_bandwidth_halves_bandwidth_bound_terms(glm):
    fast = dataclasses.replace(HW, hbm_bytes_per_s=2 * HW.hbm_bytes_per_s)
    halved = 0
    for context, batch in ((128 << 10, 1), (1 << 20, 32)):
        for t in tpu_model.decode_terms(glm, HW, SETUP, context=context, batch=batch):
            before, after = t.seconds(HW), t.seconds(fast)
            if t.bound(HW) == "HBM" and t.bound(fast) == "HBM":
                assert after == pytest.approx(before / 2)
                halved += 1
            elif t.hbm_bytes == 0:
                assert after == before
    assert halved >= 4


def test_memory_fit(glm):
    """Weights (~743 B parameters, fp8) take ~46 GB of each device; 32 sequences of 1M tokens
    do not fit beside them."""
    r = {x["case"]: x for x in (tpu_model.evaluate(glm, HW, SETUP, c) for c in
                                tpu_model.scenarios([8192], [1 << 20], [1, 32]))}
    assert 45 < r["prefill 8K"]["hbm_gb_per_device"] < 48
    assert r["decode 1M B=1"]["fits"] and not r["decode 1M B=32"]["fits"]


def test_doc_table_is_what_the_module_prints(capsys, tmp_path):
    assert tpu_model.main(["--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split("\nwrote ")[0].rstrip("\n")
    assert printed in DOC.read_text(), "docs/performance.md is out of date: paste the output"
    data = json.loads((tmp_path / "tpu_model.json").read_text())
    assert [r["case"] for r in data["results"]][:2] == ["prefill 8K", "prefill 1M"]


@pytest.mark.slow
def test_the_hand_model_beside_the_compiler(capsys):
    """`--compiler`: the same decode step and prefill chunk compiled for tpu7x-16; every term
    where the two differ by more than 20% is named (slow: ~1 min of compiling)."""
    from cp_runtime.aot.topology import has_libtpu

    if not has_libtpu():
        pytest.skip("needs libtpu (tpu extra)")
    assert tpu_model.main(["--compiler", "--compiler-layers", "1", "--contexts", "8k",
                           "--batches", "1", "--chunk-size", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "hand model vs the TPU compiler" in printed
    for term in ("indexer scores", "selected-page attention", "cache writes",
                 "rest of the step", "whole step"):
        assert term in printed
    assert "differs: selected-page attention" in printed   # the estimate's upper bound
