"""The benchmark suite's own arithmetic and plumbing: capacity figures, the roofline measurement,
the throughput work accounting on hand-worked cases, and the report writer."""

import json

import jax
import pytest

from cp_runtime.benchmarks import cache_capacity as capacity
from cp_runtime.benchmarks import indexer_cache_dtype as selection
from cp_runtime.benchmarks import kernel_error, throughput
from cp_runtime.benchmarks import suite_report as report
from cp_runtime.benchmarks._shared import minimum_work
from cp_runtime.benchmarks._shared.markdown import markdown_table
from cp_runtime.benchmarks._shared.roofline_probe import measure_roofline
from cp_runtime.cache.capacity import deployment_report, slice_report
from cp_runtime.cli import main as cli
from cp_runtime.config import ModelConfig, load_model_config
from cp_runtime.weights.params import param_shapes

GIB = 1 << 30


# -- capacity -------------------------------------------------------------------------------
def test_capacity_glm_figures():
    rows = capacity.capacity_rows(["glm-5.2"], ["bf16", "fp8_e4m3", "fp8_e5m2", "f32"])
    by = {r["dtype"]: r for r in rows}
    assert by["bf16"]["bytes_per_token"] == 105216
    assert by["fp8_e4m3"]["bytes_per_token"] == by["fp8_e5m2"]["bytes_per_token"] == 55296
    assert by["f32"]["bytes_per_token"] == 2 * 105216
    assert by["fp8_e4m3"]["ratio_vs_bf16"] == "1.90x"
    assert by["bf16"]["ratio_vs_bf16"] == "1.00x"
    assert by["fp8_e4m3"]["tokens_per_gib"] == GIB // 55296
    assert by["fp8_e4m3"]["indexer"] == "bfloat16"
    # tpu7x-16 by default: 96 GiB a device, less glm-5.2's fp8 weight shard and a 9.6 GiB
    # reserve (docs/capacity.md: 44.73 GiB of weights, 12,946,753 fp8 tokens)
    assert by["fp8_e4m3"]["weights_gib"] == pytest.approx(44.73, abs=0.005)
    assert by["fp8_e4m3"]["reserve_gib"] == pytest.approx(9.6)
    assert by["fp8_e4m3"]["slice_tokens"] == 12_946_753


@pytest.mark.parametrize("model", ["glm-5.2", "deepseek-v3.2", "tiny"])
def test_bench_capacity_is_cp_runtime_capacity(model, tmp_path, capsys):
    """bench capacity and `cp-runtime capacity` share one device model: the same tokens as
    deployment_report on tpu7x-16, and as the command's --json."""
    assert capacity.main(["--models", model, "--kv-cache-dtypes", "fp8_e4m3,bf16",
                          "--out", str(tmp_path)]) == 0
    rows = {r["dtype"]: r for r in json.loads((tmp_path / "capacity.json").read_text())["rows"]}
    cfg = load_model_config(model)
    want = deployment_report(cfg, "fp8_e4m3", devices=16, hbm_gib=96.0, topology="tpu7x-16")
    assert rows["fp8_e4m3"]["slice_tokens"] == want.tokens_that_fit
    assert rows["bf16"]["slice_tokens"] == want.tokens_that_fit_bf16
    assert rows["fp8_e4m3"]["weights_gib"] == want.weights_gib_per_device
    capsys.readouterr()
    assert cli.main(["capacity", "--model", model, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["tokens_that_fit_fp8"] == rows["fp8_e4m3"]["slice_tokens"]
    assert printed["tokens_that_fit_bf16"] == rows["bf16"]["slice_tokens"]


def test_capacity_groups_full_size_models_apart(tmp_path):
    rows = capacity.capacity_rows(["glm-5.2", "deepseek-v3.2", "tiny", "small"], ["fp8_e4m3"])
    groups = {r["model"]: r["group"] for r in rows}
    assert groups["glm-5.2"] == groups["deepseek-v3.2"] != groups["tiny"] == groups["small"]
    assert groups["glm-5.2"].startswith("full-size") and groups["tiny"].startswith("toy")


def test_capacity_weights_reduce_slice(tmp_path):
    """--weights-gib: a fixed share for every model, no reserve (as `cp-runtime capacity`)."""
    assert capacity.main(["--models", "glm-5.2", "--kv-cache-dtypes", "fp8_e4m3",
                          "--weights-gib", "32", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "capacity.json").read_text())
    assert (d["topology"], d["devices"], d["hbm_gib"], d["weights_gib"]) == ("tpu7x-16", 16,
                                                                             96.0, 32.0)
    (row,) = d["rows"]
    assert row["slice_tokens"] == 16 * 64 * GIB // 55296 and row["reserve_gib"] == 0
    assert (tmp_path / "capacity.png").stat().st_size > 0


def test_slice_report_is_the_capacity_command():
    """slice_report: tpu7x-16 unless told otherwise; a custom slice needs both sizes; a fixed
    weight share goes through capacity_report with no reserve."""
    glm = load_model_config("glm-5.2")
    assert slice_report(glm, "fp8_e4m3") == deployment_report(
        glm, "fp8_e4m3", devices=16, hbm_gib=96.0, topology="tpu7x-16")
    assert slice_report(glm, "fp8_e4m3", topology="tpu7x-32").devices == 32
    fixed = slice_report(glm, "fp8_e4m3", weights_gib=32.0)
    assert fixed.reserve_gib_per_device == 0 and fixed.tokens_that_fit == 16 * 64 * GIB // 55296
    for bad in ({"devices": 16}, {"topology": "tpu7x-8", "devices": 8, "hbm_gib": 96.0}):
        with pytest.raises(ValueError):
            slice_report(glm, "fp8_e4m3", **bad)


def test_capacity_custom_slice(tmp_path):
    assert capacity.main(["--models", "glm-5.2", "--kv-cache-dtypes", "fp8_e4m3",
                          "--devices", "32", "--hbm-gib", "96", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "capacity.json").read_text())["rows"]
    want = deployment_report(load_model_config("glm-5.2"), "fp8_e4m3", devices=32,
                             hbm_gib=96.0)
    assert row["slice_tokens"] == want.tokens_that_fit == 39_346_305    # docs/capacity.md


# -- roofline -------------------------------------------------------------------------------
def test_roofline_positive():
    roof = measure_roofline(jax.devices()[:2], mem_mib=8, matmul_n=64, repeats=1)
    assert roof["devices"] == 2 and roof["mem_bytes"] == 8 << 20
    for key in ("read_gb_per_s", "copy_gb_per_s", "memory_gb_per_s", "matmul_gflop_per_s"):
        assert roof[key] > 0, key


# -- work accounting ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hand() -> ModelConfig:
    """Small enough to count by hand: hid 4, 1 head, ranks 2, 2 layers (full, shared), dense MLP
    (moe_intermediate_size 1 only because config sizes must be positive: no MoE layer reads it).
    latent_dim 256 (128 + 128 lanes), K = index_topk / ps = 1 page at ps 16."""
    return ModelConfig(name="hand", vocab_size=10, hidden_size=4, num_hidden_layers=2,
                       num_attention_heads=1, q_lora_rank=2, kv_lora_rank=2, qk_nope_head_dim=2,
                       qk_rope_head_dim=2, v_head_dim=2, index_n_heads=1, index_head_dim=2,
                       index_topk=16, indexer_types=("full", "shared"), first_k_dense_replace=2,
                       intermediate_size=3, moe_intermediate_size=1, n_routed_experts=0,
                       num_experts_per_tok=0, n_shared_experts=0)


def test_matmul_weights_by_hand(hand):
    # attention 8 + 8 + 16 + 8 + 8 = 48; indexer 4 + 8 + 4 = 16; MLP 3 * 3 * 4 = 36
    assert minimum_work.matmul_weights(hand) == (48 + 16 + 36) + (48 + 36)


@pytest.mark.parametrize("name", ["tiny", "small", "glm-5.2"])
def test_matmul_weights_match_param_shapes(name):
    """With every routed expert counted, the formula is every 2-D tensor but the embeddings."""
    model = load_model_config(name)
    shapes = param_shapes(model)
    total = sum(s[0] * s[1] for k, s in shapes.items() if len(s) == 2
                and k not in ("model.embed_tokens.weight", "lm_head.weight"))
    assert minimum_work.matmul_weights(model, experts=model.n_routed_experts) == total


def test_projection_work_by_hand(hand):
    w = minimum_work.projection_work(hand, 3, logit_rows=1, param_bytes=4, replicas=2)
    # per token 2 * 184 + Hadamard 2 * 2^2 * (1 + 1) = 384; lm_head 2 * 10 * 4 = 80
    assert w.flops == 2 * (3 * 384 + 80)
    # weights 184 + lm_head 40 + 3 embedding rows of 4, f32
    assert w.bytes == 2 * 4 * (184 + 40 + 12)


def test_indexer_attention_write_by_hand(hand):
    w = minimum_work.indexer_work(hand, 10, 6, kv_cache_dtype="fp8_e4m3")
    assert (w.flops, w.bytes) == (10 * (2 * 2 + 3), 6 * 2 * 2)          # bf16 indexer keys
    assert minimum_work.indexer_work(hand, 10, 6, kv_cache_dtype="f32").bytes == 6 * 2 * 4
    w = minimum_work.attention_work(hand, 10, 3, page_size=16, kv_cache_dtype="fp8_e4m3")
    assert (w.flops, w.bytes) == (2 * 10 * 2 * (256 + 2), 2 * 3 * 16 * 256)
    w = minimum_work.cache_write_work(hand, 5, kv_cache_dtype="fp8_e4m3")
    assert (w.flops, w.bytes) == (0, 5 * (2 * 256 + 2 * 2))


def test_decode_step_work_by_hand(hand):
    # t = 40 on page 2: indexer 32 keys; attention 1 selected page + own page, 16 + 9 keys
    w = minimum_work.decode_step_work(hand, context=40, page_size=16, kv_cache_dtype="fp8_e4m3",
                                    shards=2, param_bytes=4)
    assert w.flops == 2 * (384 + 80) + 32 * 7 + 2 * 25 * 2 * 258
    assert w.bytes == 2 * 4 * (184 + 40 + 4) + 32 * 2 * 2 + 2 * 2 * 16 * 256 + 516


def test_prefill_work_by_hand(hand):
    # 40 tokens in chunks [0, 32) and [32, 40); pages of 16; K = 1
    w = minimum_work.prefill_work(hand, length=40, chunk=32, page_size=16,
                                kv_cache_dtype="fp8_e4m3", shards=1, param_bytes=4)
    index_pairs = 16 * 16 + 8 * 32                                       # 512
    attend_pairs = 136 + (16 * 16 + 136) + (8 * 16 + 36)                 # 692
    projections = (32 * 384 + 80) + (8 * 384 + 80)
    assert w.flops == projections + index_pairs * 7 + 2 * attend_pairs * 2 * 258
    keys_read, pages_read = 16 + 32, 2 + 3
    weights = 4 * (184 + 40 + 32 * 4) + 4 * (184 + 40 + 8 * 4)
    assert w.bytes == weights + keys_read * 4 + 2 * pages_read * 16 * 256 + 40 * 516


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_prefill_in_single_tokens_is_a_sum_of_decode_steps(name):
    model = load_model_config(name)
    kw = dict(page_size=16, kv_cache_dtype="bf16", shards=4, param_bytes=2)
    prefill = minimum_work.prefill_work(model, length=100, chunk=1, **kw)
    steps = [minimum_work.decode_step_work(model, context=t, **kw) for t in range(100)]
    assert prefill.flops == sum(s.flops for s in steps)
    assert prefill.bytes == sum(s.bytes for s in steps)


def test_dense_model_selects_every_page(hand):
    dense = throughput.dense_model(hand, tokens=40, page_size=16)
    assert dense.index_topk == 48 and dense.index_topk // 16 >= 40 // 16
    assert dense.latent_dim == hand.latent_dim


# -- report ---------------------------------------------------------------------------------
def test_markdown_table():
    text = markdown_table([{"a": 1, "b": 0.123456}, {"a": "x|y"}])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | 0.1235 |", "| x\\|y |  |"]


# `bench all --quick --only capacity,kernel_error` end to end: test_benchmark_smoke.py.
def test_report_writes_each_section_and_names_a_failure(tmp_path, monkeypatch, capsys):
    """report.md is rewritten after each section (the next one sees it, itself pending); a
    failed section's last error line reaches the console and the exit status is 1."""
    seen = {}

    def broken(argv):
        seen["report"] = (tmp_path / "report.md").read_text()
        raise RuntimeError("deliberately broken")

    monkeypatch.setattr(kernel_error, "main", broken)
    assert report.main(["--only", "capacity,kernel_error", "--out", str(tmp_path)]) == 1
    assert "- capacity: ok" in seen["report"] and "- kernel_error: pending" in seen["report"]
    assert "## Capacity" in seen["report"]
    out = capsys.readouterr().out
    assert "== kernel_error FAILED after" in out and "RuntimeError: deliberately broken" in out
    assert "failed: kernel_error)" in out
    text = (tmp_path / "report.md").read_text()
    assert "- kernel_error: failed" in text and "pending" not in text
    assert "**failed:**" in text and "deliberately broken" in text


def test_report_prog_and_only_help(capsys):
    """`cp-runtime bench all` is the report's name in its usage, and --only lists every
    section it accepts."""
    with pytest.raises(SystemExit):
        report.main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: cp-runtime bench all ")
    names = ", ".join(s.name for s in report.SECTIONS)
    assert f"from: {names} (unset: all)" in " ".join(text.split())
    with pytest.raises(SystemExit):
        cli.main(["bench", "all", "--only", "nope"])
    assert "cp-runtime bench all: error: argument --only" in capsys.readouterr().err


def test_last_error_line():
    assert report.last_error_line("Traceback (most recent call last):\n  File x\n"
                                  "ValueError: bad\n\n") == "ValueError: bad"
    assert report.last_error_line("exit status 2") == "exit status 2"


def test_report_rejects_unknown_benchmark(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report.main(["--only", "nope", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--only: 'nope' is not one of" in capsys.readouterr().err


# -- throughput, end to end -----------------------------------------------------------------
@pytest.mark.slow             # kept out of the default suite for its time budget
def test_throughput_tiny_run(tmp_path):
    out = tmp_path / "throughput.json"
    assert throughput.main(["--lengths", "128,256", "--shards", "2",
                            "--kv-cache-dtypes", "fp8_e4m3", "--pool-factors", "1,2",
                            "--pool-length", "128", "--decode-steps", "2", "--base-pages", "16",
                            "--page-size", "16", "--chunk-size", "64", "--dense-max-length", "128",
                            "--roofline-mib", "8", "--matmul-n", "64", "--no-progress",
                            "--out", str(tmp_path)]) == 0
    d = json.loads(out.read_text())
    short, long = d["rows"]
    assert (short["segment_start"], long["segment_start"]) == (0, 128)
    assert long["prefill_total_s"] == pytest.approx(short["prefill_s"] + long["prefill_s"])
    for row in d["rows"]:
        assert row["prefill_tok_per_s"] > 0 and row["decode_ms"] > 0
        assert 0 < row["decode_bw_%"] and 0 < row["prefill_flop_%"]
    assert short["dense_decode_ms"] > 0 and "dense_decode_ms" not in long
    small, big = d["pool_rows"]
    assert big["pool_pages_per_shard"] == 2 * small["pool_pages_per_shard"]
    assert small["decode_vs_smallest_pool"] == 1.0 and big["decode_vs_smallest_pool"] > 0
    assert d["roofline"]["2"]["matmul_gflop_per_s"] > 0
    assert (tmp_path / "throughput_decode.png").exists()
    assert (tmp_path / "throughput_prefill.png").exists()


# -- selection, end to end ------------------------------------------------------------------
@pytest.mark.slow             # ~30 s of compiles here; the default suite has no room yet
def test_selection_runs_and_writes_its_figures(tmp_path):
    assert selection.main(["--seeds", "1", "--tokens", "256", "--recall-trials", "4",
                           "--recall-length", "256", "--topks", "16,32",
                           "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "selection.json").read_text())
    assert {r["model"] for r in d["selection"]} >= {"tiny"}
    assert all(0 <= r["changed_pct"] <= 100 for r in d["selection"])
    assert {r["index_topk"] for r in d["recall"]} == {16, 32}
    for r in d["recall"]:                                   # "hits/trials"
        hits, trials = map(int, r["recall"].split("/"))
        assert trials == 4 and 0 <= hits <= trials
