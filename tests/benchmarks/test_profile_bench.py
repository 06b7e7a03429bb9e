"""cp-runtime bench profile (benchmarks/profile.py): every phase of a decode step and a prefill
chunk is timed and accounted for, the JSON and PNG are written, --model-tpu prints the TPU
model table, and the minimum work follows the step's shapes."""

import json

import jax
import pytest

from cp_runtime.benchmarks import profile
from cp_runtime.config import load_model_config

# % of a measured peak. Above 100 is possible (a phase whose minimum bytes stay in cache), not
# this far above it.
SANE_PCT = 1000.0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny profile: S = 2, one length, small roofline arrays (well under 30 s)."""
    jax.devices()      # JAX starts with the session's 16 devices before --shards 2 asks for some
    out = tmp_path_factory.mktemp("profile")
    argv = ["--model", "tiny", "--shards", "2", "--lengths", "256", "--page-size", "16",
            "--chunk-size", "64", "--repeats", "1", "--roofline-mib", "8", "--matmul-n", "128",
            "--no-progress", "--model-tpu", "--out", str(out)]
    return out, argv


@pytest.mark.slow             # kept out of the default suite for its time budget
def test_tiny_profile_has_every_phase(tiny_run, capsys):
    out, argv = tiny_run
    assert profile.main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "profile.json").read_text())
    assert (out / "profile.png").stat().st_size > 0
    assert data["machine"]["devices"] >= 2 and data["method"].startswith("timed sub-programs")
    rows = data["by_shards"]["2"]["rows"]
    assert sorted((r["kind"], r["length"]) for r in rows) == [("decode", 256), ("prefill", 256)]
    for row in rows:
        want = profile.DECODE_PHASES if row["kind"] == "decode" else profile.PREFILL_PHASES
        assert [p["phase"] for p in row["phases"]] == list(want)
        for p in row["phases"]:
            assert p["seconds"] > 0, p
            assert 0 <= p["bw_pct"] < SANE_PCT and 0 <= p["flop_pct"] < SANE_PCT, p
        assert row["whole_step_s"] > 0 and row["program_s"] > 0
        assert row["phases_sum_s"] == pytest.approx(sum(p["seconds"] for p in row["phases"]))
    # the tables name every phase, the shard count, and the whole step beside the sum
    for label in dict(profile.PHASES).values():
        assert label in printed
    assert "whole step (engine)" in printed and "sum of phases" in printed
    # --model-tpu: the tpu_model table, from that module
    assert "glm-5.2 on tpu7x-16" in printed and "decode 1M B=1" in printed
    assert (out / "tpu_model.json").exists()


def test_prefill_drops_what_the_step_drops():
    """A prefill chunk returns only the cache: the last layer's attention is not run."""
    tiny = load_model_config("tiny")          # full, shared, full, shared
    decode = profile.step_shape("decode", 4096, 1024)
    prefill = profile.step_shape("prefill", 4096, 1024)
    assert decode.live_layers(tiny) == ((0, 1, 2, 3), (0, 1))
    assert prefill.live_layers(tiny) == ((0, 1, 2), (0, 1))
    assert (prefill.start, decode.start) == (3072, 4095)


def test_minimum_work_follows_the_shapes():
    small = load_model_config("small")        # one full layer, one shared; K = 4 pages of 64
    common = dict(page_size=64, kv_cache_dtype="fp8_e4m3", param_bytes=4)
    short, long = (profile.phase_work(small, profile.step_shape("decode", n, 1024), shards=16,
                                      **common) for n in (8192, 65536))
    # the indexer reads every earlier page's keys: 8x the context, 8x the bytes (to a page)
    assert long["indexer"].bytes / short["indexer"].bytes == pytest.approx(8, rel=0.01)
    # attention reads the own page and K selected ones whatever the context
    assert long["attention"].bytes == short["attention"].bytes
    assert short["host"].bytes == short["host"].flops == 0
    # the dense layers are replicated on every shard: 8x the shards, 8x the work
    two = profile.phase_work(small, profile.step_shape("decode", 8192, 1024), shards=2, **common)
    assert short["dense"].flops == pytest.approx(8 * two["dense"].flops)
    assert set(short) == set(profile.DECODE_PHASES)


@pytest.mark.slow             # kept out of the default suite for its time budget
def test_decode_bench_runs_every_comparison(tmp_path):
    """cp-runtime bench decode at tiny sizes: every configuration timed in every round, the
    checks computed from them."""
    from cp_runtime.benchmarks import decode

    jax.devices()      # JAX starts with the session's 16 devices before --shards 2 asks for some
    argv = ["--model", "tiny", "--shards", "1", "--page-size", "16", "--short", "64",
            "--long", "512", "--pool-context", "128", "--batch", "2", "--rounds", "1",
            "--steps", "2", "--roofline-mib", "8", "--out", str(tmp_path)]
    assert decode.main(argv) == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    names = {r["configuration"] for r in data["rows"]}
    assert names == {"context 64", "context 512", "pool 1x", "pool 4x", "batch 2",
                     "without merge", "flat gathers", "staged gathers"}
    assert all(0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in data["rows"]
               if r["part"] != "host")
    checks = data["checks"]
    assert checks["extra_bytes"] > 0 and checks["long_bound_ms"] > checks["short_step_ms"]
    assert 0 < checks["pool_4x_over_1x"] and checks["batch_host_ms"] > 0
    assert checks["merge_share_min"] <= checks["merge_share"] <= checks["merge_share_max"]
    assert checks["gathers_flat_over_engine"] > 0 and checks["gathers_staged_over_engine"] > 0
