"""The command line's vocabulary: help that prints defaults as typed, serve's argument groups,
`serve --config FILE` under flags, errors that name the flag, and the runtime files that ship."""

import argparse
import logging

import pytest

from cp_runtime.cli.args import HelpFormatter, format_length, length, length_list
from cp_runtime.cli.main import build_parser, main, serve_runtime, typed_flags
from cp_runtime.config import (CONFIG_DIR, ConfigError, check_runtime_for_model,
                               load_model_config, load_runtime_config)
from cp_runtime.serving.session.activity import Activity, RequestRecord

RUNTIME_FILES = sorted((CONFIG_DIR / "runtime").glob("*.toml"))


def _help(p: argparse.ArgumentParser) -> str:
    return " ".join(p.format_help().split())


def test_defaults_print_as_typed():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--lengths", type=length_list, default=[8192, 131072], help="lengths")
    p.add_argument("--chunk", type=length, default=1 << 20, help="chunk")
    p.add_argument("--kinds", default=("log", "snapshot"), help="kinds")
    p.add_argument("--reserve", default=None, help="reserve (default: 10%% of HBM)")
    p.add_argument("--flag", action="store_true", help="a switch")
    text = _help(p)
    assert "(default: 8k,128k)" in text and "(default: 1m)" in text
    assert "(default: log,snapshot)" in text
    assert text.count("default") == 4          # the three above and reserve's own, once
    assert "None" not in text and "False" not in text
    assert [format_length(n) for n in (5000, 8192, 3 << 20)] == ["5000", "8k", "3m"]


def test_serve_help_is_grouped_and_says_what_each_limit_does():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    groups = [g.title for g in serve._action_groups]
    for title in ("model", "cache", "parallelism", "scheduling", "server and limits", "state",
                  "executor"):
        assert title in groups, title
    text = _help(serve)
    assert "limit:" not in text
    assert "sessions open at once; create or fork past it is refused with capacity" in text
    assert "(default: None)" not in text


@pytest.mark.parametrize("argv, flag", [
    (["--page-size", "24"], "--page-size 24"),
    # Page selection only: token selection takes any aligned page size, and would go on to
    # build the whole model.
    (["--model", "glm-5.2", "--selection", "page", "--page-size", "48"], "--page-size 48"),
    (["--shards", "16", "--merge", "head_scatter", "--weights", "replicated"], "--merge"),
    (["--shards", "16", "--expert-groups", "3"], "--expert-groups 3 must divide --shards 16"),
    (["--expert-groups", "4", "--weights", "replicated"],
     "--expert-groups 4 splits the experts over the shards: it needs --weights 'sharded'"),
    (["--shards", "16", "--prefill-expert-groups", "3"],
     "--prefill-expert-groups 3 must divide --shards 16"),
    (["--shards", "16", "--expert-groups", "4", "--prefill-expert-groups", "8"],
     "--prefill-expert-groups 8 regroups experts held in one group: it needs "
     "--expert-groups 1, not 4"),
])
def test_serve_errors_name_the_flag(argv, flag, capsys):
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and "page_size=" not in err and "field '" not in err, err


def test_config_file_under_typed_flags(tmp_path):
    """serve defaults < the file < flags typed on the command line (even at their default)."""
    path = tmp_path / "rt.toml"
    path.write_text('model = "tiny"\npage_size = 32\nchunk_size = 256\nmax_batch = 4\n')
    parser = build_parser()
    argv = ["serve", "--config", str(path), "--max-batch", "8", "--shards", "4"]
    args = parser.parse_args(argv)
    runtime = serve_runtime(args, typed_flags(parser, argv))
    assert (runtime.page_size, runtime.chunk_size) == (32, 256)       # from the file
    assert (runtime.max_batch, runtime.num_shards) == (8, 4)          # typed; 8 is the default
    assert runtime.pages_per_shard == args.pages_per_shard            # serve's default


def test_max_queued_tokens_flag_and_file(tmp_path, capsys):
    """--max-queued-tokens: unset, the runtime's auto default (16 chunks before any measured
    rate); 0, no bound; k suffixes;
    a --config file may set it and a typed flag overrides the file."""
    parser = build_parser()
    runtime = serve_runtime(parser.parse_args(["serve", "--chunk-size", "256"]), set())
    assert runtime.max_queued_tokens is None and runtime.admission_bound == 16 * 256
    for typed, want in (("0", 0), ("8k", 8192)):
        args = parser.parse_args(["serve", "--max-queued-tokens", typed])
        assert serve_runtime(args, set()).admission_bound == want
    path = tmp_path / "rt.toml"
    path.write_text('model = "tiny"\nmax_queued_tokens = 5000\n')
    for argv, want in ((["serve", "--config", str(path)], 5000),
                       (["serve", "--config", str(path), "--max-queued-tokens", "0"], 0)):
        args = parser.parse_args(argv)
        assert serve_runtime(args, typed_flags(parser, argv)).admission_bound == want
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-queued-tokens", "-1"])
    assert "--max-queued-tokens" in capsys.readouterr().err
    text = _help(parser._subparsers._group_actions[0].choices["serve"])
    assert "0: no bound (default: what the engine prefills in 10 s at its measured rate, at " \
           "least 16 chunks)" in " ".join(text.split())


def test_a_bad_config_file_is_named(tmp_path, capsys):
    path = tmp_path / "rt.toml"
    path.write_text("page_size = 24\n")
    assert main(["serve", "--port", "0", "--config", str(path)]) == 2
    assert str(path) in capsys.readouterr().err


@pytest.mark.parametrize("path", RUNTIME_FILES, ids=lambda p: p.name)
def test_every_shipped_runtime_file_runs_its_model(path):
    runtime = load_runtime_config(path)
    check_runtime_for_model(load_model_config(runtime.model), runtime, path)
    args = build_parser().parse_args(["serve", "--config", str(path)])
    served = serve_runtime(args, set())
    for field in ("model", "page_size", "num_shards", "pages_per_shard", "weights",
                  "latent_memory", "latent_device_pages"):
        assert getattr(served, field) == getattr(runtime, field), field


def test_hbm_pages_without_a_host_cache_are_refused_by_their_flag(capsys):
    assert main(["serve", "--port", "0", "--latent-device-pages", "4"]) == 2
    assert "--latent-device-pages 4 needs --latent-memory 'host'" in capsys.readouterr().err


def test_bench_without_a_name_lists_them(capsys):
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "niah" in err and "all" in err and "rest" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("cp-runtime ")


def test_request_lines_and_summary(caplog):
    activity = Activity()
    with caplog.at_level(logging.DEBUG, logger="cp_runtime.serving.requests"):
        activity.record(RequestRecord(1, 7, "extend", "s-1", 2000, 812.4, "ok"))
        activity.record(RequestRecord(1, 8, "generate", "s-1", 16, 90.0, "ok"))
        activity.record(RequestRecord(2, 1, "create", None, 0, 0.3, "capacity"))
    assert "request conn=1 id=7 extend session=s-1 tokens=2000 ms=812.4 ok" in caplog.text
    stats = {"pages_used_per_shard": [3, 5], "pages_per_shard": 64, "sessions": 2,
             "requests": 1, "tokens_per_s": 123.0}
    line = activity.take_summary(60, stats)
    assert line.startswith("last 60 s: 3 requests (1 refused: capacity 1), 2,000 tokens in, "
                           "16 out; 2 sessions")
    assert "max 5 of 64" in line
    assert activity.take_summary(60, stats) is None         # nothing since: no line


def test_runtime_errors_keep_their_file(tmp_path):
    path = tmp_path / "rt.toml"
    path.write_text('model = "glm-5.2"\nselection = "page"\npage_size = 48\n')
    with pytest.raises(ConfigError, match=str(path)):
        load_runtime_config(path, model=load_model_config("glm-5.2"))
