"""`cp-runtime bench serving` end to end: a real server process, concurrent clients, the JSON."""

import json

import pytest

from cp_runtime.benchmarks import serving

TINY = ["--uploads", "1", "--upload-tokens", "256", "--chats", "2", "--chat-prompt", "32",
        "--chat-tokens", "4", "--chat-turns", "2", "--think-ms", "0", "--chat-stagger-ms", "0",
        "--upload-delay-ms", "0", "--chunk-size", "128", "--shards", "4", "--no-warmup",
        "--no-progress"]


@pytest.mark.slow             # kept out of the default suite for its time budget
def test_serving_benchmark_tiny_run_over_both_apis(tmp_path):
    # One server: the session protocol's run (the top level, as with --api session), then the
    # same workload with the chats over HTTP.
    assert serving.main([*TINY, "--api", "both", "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "serving.json").read_text())
    assert (tmp_path / "serving.png").stat().st_size > 0
    assert d["prefill_tokens"] == 256 + 2 * 2 * 32 and d["decode_tokens"] == 2 * 2 * 4
    assert d["ttft_samples"] == 4 and d["itl_samples"] == 4 * 3 and d["prompt_samples"] == 4
    for name in ("ttft", "itl", "prompt"):
        assert 0 < d[f"{name}_p50_ms"] <= d[f"{name}_p99_ms"] <= d[f"{name}_max_ms"]
    assert d["tokens_per_s"] > 0 and d["uploads"][0]["tokens"] == 256
    e = d["engine"]
    assert e["steps"] > 0 and e["decode_tokens"] == d["decode_tokens"]
    assert 0 <= e["host_share"] <= 1 and e["device_ms_per_step"] > 0
    assert d["server"]["hello"]["shards"] == 4 and "machine" in d
    assert d["runs"]["session"]["ttft_p50_ms"] == d["ttft_p50_ms"]
    h = d["runs"]["http"]
    assert h["prefill_tokens"] == d["prefill_tokens"] and h["decode_tokens"] == 2 * 2 * 4
    assert h["ttft_samples"] == 4 and h["itl_samples"] == 4 * 3 and h["prompt_samples"] == 0
    # Later turns continued their sessions: the server prefilled what it did over the session
    # protocol, no conversation resent.
    assert h["engine"]["prefill_tokens"] == e["prefill_tokens"]
    assert h["engine"]["decode_tokens"] == 2 * 2 * 4
    assert h["stats_after"]["sessions"] == 0             # the kept sessions were closed
    for run in (d, h):
        assert 0 < run["turn_p50_ms"] <= run["turn_p99_ms"]
        assert run["engine"]["host_cpu_ms_per_token"] > 0
    assert {row["measure"] for row in d["comparison"]} >= {"TTFT p50 ms", "host CPU ms/token"}


def test_workload_sizes_the_pool():
    w = serving.Workload(uploads=1, upload_tokens=1024, chats=2, chat_prompt=32, chat_tokens=4,
                         chat_turns=2, think_ms=0, chat_stagger_ms=0, upload_delay_ms=0)
    # 1025 tokens = 65 pages -> 5 per shard of 16; each chat 73 tokens = 5 pages -> 1; +1 each
    assert serving.pages_per_shard_for(w, 16, 16) == 6 + 2 + 2


@pytest.mark.parametrize("argv,flag", [(["--upload-tokens", "0"], "--upload-tokens"),
                                       (["--chats", "-1"], "--chats"),
                                       (["--address", "nohost"], "--address"),
                                       (["--chunk-size", "100"], "--chunk-size"),
                                       (["--pages-per-shard", "1"], "--pages-per-shard"),
                                       (["--uploads", "0", "--chats", "0"], "--uploads"),
                                       (["--api", "grpc"], "--api"),
                                       (["--address", "127.0.0.1:7777", "--api", "http"],
                                        "--http-address")])
def test_bad_flags_are_usage_errors(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        serving.main([*argv, "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
