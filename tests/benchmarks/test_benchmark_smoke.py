"""Every benchmark's `main` runs end to end in its quick mode, shrunk by its own flags to the
smallest honest configuration (one length, a toy model, S = 1 or 2, one repeat), and writes its
JSON: a smoke test per benchmark, so a broken entry point shows in the default suite rather
than in a user's first hour. The fuller runs (and their figures' checks) are the slow tests of
test_benchmarks.py, test_profile_bench.py, test_serving_benchmark.py and test_tpu_model.py.

Budget: the default-suite tests here take about 185 s on the 2-core development machine
(every engine-based benchmark compiles at least a prefill and a decode step, seconds each;
decode compiles eight step programs by design, dispatch starts Ray, recovery two server
processes, overload one). Only tpu_model --compiler runs with `-m slow` (TPU compiles, about 3
min even cut to one layer); tpu_model's main runs here without it. Order matters a little:
kernel_error before report and niah before selection share compiled programs and the recall
model within the session."""

import json

import jax
import pytest

from cp_runtime.benchmarks import all_gather_latency as collectives
from cp_runtime.benchmarks import cache_capacity as capacity
from cp_runtime.benchmarks import (decode, kernel_error, kernels, million, moe_layouts, niah,
                                   overload, prefix_reuse, profile, serving, throughput)
from cp_runtime.benchmarks import host_page_transfers as host_pages
from cp_runtime.benchmarks import indexer_cache_dtype as selection
from cp_runtime.benchmarks import lockstep_dispatch as dispatch
from cp_runtime.benchmarks import machine_roofline as roofline
from cp_runtime.benchmarks import merge_variants as merge
from cp_runtime.benchmarks import restart_recovery as recovery
from cp_runtime.benchmarks import suite_report as report
from cp_runtime.benchmarks.hand_model import tpu_model
from cp_runtime.cache.capacity import deployment_report
from cp_runtime.config import load_model_config

COMMON = ["--quick", "--no-progress"]


@pytest.fixture(autouse=True)
def _jax_started():
    """JAX has the session's 16 devices before a benchmark asks for its --shards."""
    jax.devices()


def _run(module, tmp_path, *flags: str) -> None:
    assert module.main([*COMMON, *flags, "--out", str(tmp_path)]) == 0


def _json(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / name).read_text())


def test_capacity(tmp_path):
    _run(capacity, tmp_path, "--models", "glm-5.2,tiny", "--kv-cache-dtypes", "bf16,fp8_e4m3")
    rows = {(r["model"], r["dtype"]): r for r in _json(tmp_path, "capacity.json")["rows"]}
    want = deployment_report(load_model_config("glm-5.2"), "fp8_e4m3", devices=16, hbm_gib=96.0)
    assert rows["glm-5.2", "fp8_e4m3"]["slice_tokens"] == want.tokens_that_fit
    assert rows["tiny", "bf16"]["group"] != rows["glm-5.2", "bf16"]["group"]
    assert (tmp_path / "capacity.png").stat().st_size > 0


def test_host_pages(tmp_path):
    _run(host_pages, tmp_path, "--pages", "64", "--counts", "9", "--groups", "1,8",
         "--repeats", "1")
    rows = _json(tmp_path, "host_pages.json")["rows"]
    assert [(r["group"], r["pages"]) for r in rows] == [(1, 9), (8, 9)]
    assert all(r["read_ms"] > 0 for r in rows)


def test_collectives(tmp_path):
    _run(collectives, tmp_path, "--shards", "2", "--depth", "2", "--rounds", "1",
         "--values", "4")
    rows = _json(tmp_path, "collectives.json")["rows"]
    assert {r["mode"] for r in rows} >= {"flat"} and all(r["program_1_ms"] > 0 for r in rows)


def test_decode(tmp_path):
    _run(decode, tmp_path, "--model", "small", "--shards", "1", "--short", "256", "--long",
         "512", "--pool-context", "256", "--batch", "2", "--rounds", "1", "--steps", "1",
         "--roofline-mib", "8")
    d = _json(tmp_path, "decode.json")
    assert d["checks"]["long_step_ms"] > 0 and d["checks"]["extra_bytes"] > 0


def test_dispatch(tmp_path):
    _run(dispatch, tmp_path, "--shards", "2", "--hosts", "1", "--steps", "2", "--context", "32")
    rows = _json(tmp_path, "dispatch.json")["rows"]
    assert [r["executor"] for r in rows] == ["local", "ray/actor", "ray/socket"]
    assert all(r["step_ms"] > 0 for r in rows)


def test_kernel_error(tmp_path):
    _run(kernel_error, tmp_path)                     # glm-5.2 shapes, as the report runs it
    rows = _json(tmp_path, "kernel_error.json")["rows"]
    assert len(rows) == 4 and all(0 < r["rel_l2_%"] < r["bound_rel_l2_%"] for r in rows)


def test_kernels(tmp_path):
    _run(kernels, tmp_path, "--kernels", "decode", "--kv-cache-dtypes", "fp8_e4m3")
    d = _json(tmp_path, "kernels.json")
    assert d["size"] == "small" and [r["kernel"] for r in d["results"]] == ["decode"]
    assert d["results"][0]["rel_l2"] < 0.05


def test_merge(tmp_path):
    # A prefill chunk of 8 has the decode step's shapes: one compile per variant, not two.
    _run(merge, tmp_path, "--model", "tiny", "--shards", "2", "--repeats", "1",
         "--prefill-tokens", "8")
    d = _json(tmp_path, "merge.json")
    assert d["tokens"] == {"decode B=8": 8, "prefill chunk Q=8": 8}
    assert len(d["rows"]) == len(merge.VARIANTS)
    assert all(r["decode B=8 ms"] > 0 and r["prefill chunk Q=8 ms"] > 0 for r in d["rows"])


def test_merge_sizes_the_prefill_chunk_to_fit():
    """glm-5.2 at S = 16: 34 MB of gathered partials per token, so 1 GiB holds 24 tokens."""
    glm = load_model_config("glm-5.2")
    kw = dict(heads=glm.num_attention_heads, value_dim=glm.kv_lora_rank, shards=16)
    q = merge.prefill_tokens(**kw, budget_bytes=1 << 30)
    assert q == 24 and merge.gathered_bytes(q, **kw) <= 1 << 30
    assert merge.gathered_bytes(q + 8, **kw) > 1 << 30
    assert merge.prefill_tokens(**kw, budget_bytes=1 << 40) == merge.PREFILL_TOKENS
    tiny = load_model_config("tiny")                    # a toy model's whole chunk fits
    assert merge.prefill_tokens(heads=tiny.num_attention_heads, value_dim=tiny.kv_lora_rank,
                                shards=16, budget_bytes=1 << 30) == merge.PREFILL_TOKENS


def test_million(tmp_path):
    _run(million, tmp_path, "--tokens", "1k", "--model", "small", "--shards", "2",
         "--chunk-size", "1k", "--decode-steps", "1")
    r = _json(tmp_path, "million.json")["result"]
    assert r["tokens"] == 1024 and r["prefill_tok_per_s"] > 0 and r["decode_ms_per_step"] > 0


def test_moe_layouts(tmp_path):
    """4 devices' sums in 1, 2 and 4 groups: the same to bf16 rounding (each device's partial
    leaves its kernel in bf16); a device's rows cut below its pairs would not be."""
    _run(moe_layouts, tmp_path, "--shards", "4", "--groups", "1,2,4")
    d = _json(tmp_path, "moe_layouts.json")["check"]
    assert set(d["max_abs_diff"]) == {"1", "2", "4"} and d["max_abs"] > 0
    assert all(diff <= 2 ** -7 * d["max_abs"] for diff in d["max_abs_diff"].values())


def test_niah(tmp_path):
    _run(niah, tmp_path, "--lengths", "256", "--depths", "0.0", "--variants", "single",
         "--kv-cache-dtypes", "fp8_e4m3", "--shards", "2")
    d = _json(tmp_path, "niah.json")
    assert [r["variant"] for r in d["summary"]] == ["single"]
    assert (tmp_path / "niah_heatmap.png").exists()


def test_prefix_reuse(tmp_path):
    _run(prefix_reuse, tmp_path, "--doc-tokens", "256", "--questions", "2",
         "--question-tokens", "8", "--answer-tokens", "2", "--shards", "1", "--chunk-size",
         "256")
    d = _json(tmp_path, "prefix_reuse.json")
    without, with_ = d["rows"]
    assert d["answers_equal"] == 2 and without["cached tokens"] == 0
    assert with_["cached tokens"] == 256 and with_["prefill tokens"] < without["prefill tokens"]


def test_overload(tmp_path):
    """One server process with a 64-token bound (the no-bound server is the same code with a
    bound of 0), four clients of one page each: one step program to compile. A deadline no
    run comes near, so nothing times out."""
    _run(overload, tmp_path, "--clients", "4", "--tokens", "64", "--chunk-size", "64",
         "--bounds", "64", "--deadline-s", "60")
    d = _json(tmp_path, "overload.json")
    (run,) = d["runs"]
    assert (run["max_queued_tokens"], run["bound_at_start"]) == (64, 64)
    assert run["completed"] >= 1 and run["completed"] + run["refused"] == 4
    assert run["timed_out"] == 0
    assert all(r["refusal_ms"] > 0 for r in run["records"] if r["outcome"] == "refused")
    assert "| 64 | 4 |" in (tmp_path / "overload.md").read_text()
    # `default` is the auto bound, labelled as such.
    assert overload.bound_label("default") == "auto (10 s of prefill)"
    assert overload.resolved_bound("default") is None


def test_profile(tmp_path):
    _run(profile, tmp_path, "--model", "small", "--shards", "1", "--lengths", "256",
         "--chunk-size", "128", "--repeats", "1", "--roofline-mib", "8", "--matmul-n", "64")
    rows = _json(tmp_path, "profile.json")["by_shards"]["1"]["rows"]
    assert sorted(r["kind"] for r in rows) == ["decode", "prefill"]
    assert (tmp_path / "profile.png").exists()


def test_recovery(tmp_path):
    _run(recovery, tmp_path, "--lengths", "256", "--modes", "snapshot", "--model", "small",
         "--shards", "1", "--chunk-size", "256")
    (row,) = _json(tmp_path, "recovery.json")["rows"]
    assert 0 < row["listening_s"] <= row["restored_s"] <= row["first_token_s"]


def test_report(tmp_path, capsys):
    """`bench all --quick` on two sections (kernel_error's programs are compiled above)."""
    _run(report, tmp_path, "--only", "capacity,kernel_error")
    text = (tmp_path / "report.md").read_text()
    assert "## Capacity" in text and "## fp8 cache error" in text
    assert "| glm-5.2 | fp8_e4m3 |" in text and "55296" in text and "1.90x" in text
    assert "![capacity](capacity/capacity.png)" in text
    assert "- capacity: ok" in text and "- kernel_error: ok" in text and "failed" not in text
    assert "cp-runtime bench kernel_error --quick --no-progress --out" in capsys.readouterr().out


def test_roofline(tmp_path):
    _run(roofline, tmp_path, "--shards", "2", "--mem-mib", "8", "--matmul-n", "64")
    r = _json(tmp_path, "roofline.json")["roofline"]
    assert r["devices"] == 2 and r["read_gb_per_s"] > 0


def test_selection(tmp_path):
    _run(selection, tmp_path, "--tokens", "256", "--recall-trials", "2", "--recall-length",
         "256", "--topks", "16")
    d = _json(tmp_path, "selection.json")
    assert d["tiny_seeds"] == 1 and d["tiny_tokens"] == 256          # --quick, explicit wins
    assert {r["index_topk"] for r in d["recall"]} == {16}


def test_serving(tmp_path):
    _run(serving, tmp_path, "--model", "small", "--page-size", "64", "--shards", "1",
         "--chunk-size", "128", "--uploads", "1", "--upload-tokens", "128", "--chats", "1",
         "--chat-prompt", "16", "--chat-tokens", "2", "--no-warmup")
    d = _json(tmp_path, "serving.json")
    assert d["decode_tokens"] == 2 and d["prefill_tokens"] == 128 + 16


def test_throughput(tmp_path):
    _run(throughput, tmp_path, "--model", "small", "--lengths", "256", "--shards", "2",
         "--kv-cache-dtypes", "fp8_e4m3", "--pool-factors", "1", "--decode-steps", "1",
         "--base-pages", "8", "--chunk-size", "256", "--dense-max-length", "0",
         "--roofline-mib", "8", "--matmul-n", "64")
    (row,) = _json(tmp_path, "throughput.json")["rows"]
    assert row["prefill_tok_per_s"] > 0 and row["decode_ms"] > 0


def test_tpu_model(tmp_path):
    _run(tpu_model, tmp_path)
    d = _json(tmp_path, "tpu_model.json")
    assert d["model"] == "glm-5.2" and d["compiler"] is None and d["results"]


@pytest.mark.slow             # TPU compiles through libtpu: ~3 min here even cut to one layer
def test_tpu_model_beside_the_compiler(tmp_path):
    from cp_runtime.aot.topology import has_libtpu

    if not has_libtpu():
        pytest.skip("needs libtpu (tpu extra)")
    _run(tpu_model, tmp_path, "--compiler", "--contexts", "8k", "--batches", "1",
         "--chunk-size", "1024")
    d = _json(tmp_path, "tpu_model.json")
    assert d["compiler"]["layers"] == 1 and d["compiler"]["rows"]
