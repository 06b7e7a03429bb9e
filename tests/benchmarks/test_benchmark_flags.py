"""Every benchmark's command line: shared flag names (cp_runtime.cli.args), help text with
defaults, and bad input answered by an argparse usage error (exit 2, the flag named) before any
work is done."""

import argparse

import jax
import pytest

from cp_runtime.benchmarks import registry
from cp_runtime.cli import args as cli_args
from cp_runtime.config import model_names

# Shared flags' common defaults (cp_runtime.cli.args): a benchmark whose default differs says
# why in its help.
COMMON = {"--chunk-size": (cli_args.add_chunk_size, 1024),
          "--page-size": (cli_args.add_page_size, 16),
          "--backend": (cli_args.add_backend, "auto"),
          "--kv-cache-dtype": (cli_args.add_kv_cache_dtype, "fp8_e4m3")}
# Old spellings that the shared flags replaced.
RETIRED = ("--chunk", "--dtypes", "--tiny-model")
# Benchmarks that sweep shard counts take a list; the others one count.
SHARD_SWEEPS = ("collectives", "niah", "profile", "throughput")

# Every benchmark, by its `cp-runtime bench NAME` name: the registry's table, the only list.
BENCHMARKS = registry.names()


def _module(name: str):
    return registry.load(name)


def _options(name: str) -> dict[str, argparse.Action]:
    parser = _module(name).build_parser()
    return {o: a for a in parser._actions for o in a.option_strings}


@pytest.fixture(autouse=True)
def _jax_started():
    """JAX has its 16 devices before any benchmark asks for some (a later count is refused)."""
    jax.devices()


# -- help and names -------------------------------------------------------------------------
@pytest.mark.parametrize("name", BENCHMARKS)
def test_help_shows_every_flag_and_its_default(name, capsys):
    with pytest.raises(SystemExit) as e:
        _module(name).main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert f"cp-runtime bench {name}" in text and "(default:" in text
    parser = _module(name).build_parser()
    assert parser.formatter_class is cli_args.HelpFormatter
    for action in parser._actions:
        assert action.help, f"{name} {action.option_strings} has no help"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_shared_flag_names_and_types(name):
    opts = _options(name)
    assert not set(RETIRED) & set(opts), f"{name} still has {set(RETIRED) & set(opts)}"
    assert "--out" in opts and opts["--out"].metavar == "DIR"
    if "--model" in opts:                                        # a config name, never a path
        assert opts["--model"].choices == model_names()
    if "--checkpoint" in opts:
        assert opts["--checkpoint"].metavar == "DIR"
    if "--shards" in opts:
        want = cli_args.positive_int_list if name in SHARD_SWEEPS else cli_args.positive_int
        assert opts["--shards"].type is want
    if "--page-size" in opts:
        assert opts["--page-size"].type is cli_args.positive_int
    if "--chunk-size" in opts:
        assert opts["--chunk-size"].type is cli_args.length
    if "--lengths" in opts:
        assert opts["--lengths"].type is cli_args.length_list
    if "--kv-cache-dtypes" in opts:
        assert opts["--kv-cache-dtypes"].metavar == "D[,D...]"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_has_quick_and_no_progress(name):
    opts = _options(name)
    for flag in ("--quick", "--no-progress"):
        assert flag in opts and opts[flag].default is False and opts[flag].help, (name, flag)


def _common(flag: str, action: argparse.Action) -> tuple[object, str]:
    """(common default, the help the shared helper gives it) of a shared flag."""
    if flag == "--shards":
        sweep = action.type is cli_args.positive_int_list
        add, default = ((cli_args.add_shard_counts, "16") if sweep else
                        (cli_args.add_shards, 16))
    else:
        add, default = COMMON[flag]
    p = argparse.ArgumentParser()
    add(p, default)
    return default, next(a.help for a in p._actions if flag in a.option_strings)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_default_that_differs_says_why(name):
    """The common default keeps the shared helper's help; any other default adds its reason."""
    opts = _options(name)
    for flag in [*COMMON, "--shards"]:
        if flag not in opts:
            continue
        default, common_help = _common(flag, opts[flag])
        help_ = opts[flag].help
        if opts[flag].default == default:
            assert help_ == common_help, (name, flag)
        else:
            assert help_.startswith(common_help) and help_ != common_help, \
                f"{name} {flag}: its own default, and no why"


def test_niah_model_is_a_config_and_checkpoint_a_directory():
    opts = _options("niah")
    assert opts["--model"].default == "recall" and opts["--checkpoint"].default is None


# -- bad input ------------------------------------------------------------------------------
BAD = [
    # (benchmark, argv, the flag the message names)
    *[(n, ["--shards", "0"], "--shards") for n in ("merge", "million", "niah", "all",
                                                   "roofline", "throughput")],
    ("niah", ["--shards", "1,0"], "--shards"),
    ("throughput", ["--shards", "16,x"], "--shards"),
    ("merge", ["--shards", "1,16"], "--shards"),                # one count only
    ("merge", ["--shards", "64"], "--shards"),                  # more than the 16 devices
    *[(n, ["--lengths", ""], "--lengths") for n in ("niah", "throughput")],
    ("niah", ["--lengths", "8k,"], "--lengths"),
    ("throughput", ["--lengths", "2q"], "--lengths"),
    *[(n, ["--page-size", "0"], "--page-size") for n in ("million", "niah", "selection",
                                                        "throughput")],
    *[(n, ["--page-size", "24"], "--page-size") for n in ("million", "niah", "selection",
                                                         "throughput")],
    ("throughput", ["--page-size", "48"], "--page-size"),       # small's index_topk is 256
    ("selection", ["--page-size", "48"], "--page-size"),        # tiny's index_topk is 64
    ("million", ["--page-size", "128", "--model", "tiny"], "--page-size"),
    ("niah", ["--page-size", "128"], "--page-size"),            # recall's index_topk is 64
    ("niah", ["--lengths", "8"], "--lengths"),                  # below the page size
    ("throughput", ["--lengths", "32,2k"], "--lengths"),
    ("throughput", ["--pool-length", "32"], "--pool-length"),
    ("million", ["--tokens", "32"], "--tokens"),
    ("selection", ["--tokens", "8"], "--tokens"),
    ("selection", ["--recall-length", "8"], "--recall-length"),
    ("capacity", ["--hbm-gib", "inf"], "--hbm-gib"),
    ("capacity", ["--hbm-gib", "-1"], "--hbm-gib"),
    ("capacity", ["--hbm-gib", "nan"], "--hbm-gib"),
    ("capacity", ["--weights-gib", "-1"], "--weights-gib"),
    ("capacity", ["--weights-gib", "200"], "--weights-gib"),    # more than --hbm-gib
    ("capacity", ["--devices", "0"], "--devices"),
    ("capacity", ["--devices", "16"], "--devices"),             # without --hbm-gib
    ("capacity", ["--topology", "tpu7x-8", "--devices", "8", "--hbm-gib", "96"], "--topology"),
    ("capacity", ["--topology", "tpu9"], "--topology"),
    ("capacity", ["--reserve-gib", "96"], "--reserve-gib"),      # all of a device
    ("merge", ["--gather-gib", "0"], "--gather-gib"),
    ("merge", ["--prefill-tokens", "0"], "--prefill-tokens"),
    ("collectives", ["--rounds", "0"], "--rounds"),
    ("million", ["--tokens", "0"], "--tokens"),
    ("recovery", ["--lengths", "8k,"], "--lengths"),
    ("dispatch", ["--steps", "0"], "--steps"),
    ("tpu_model", ["--compiler-layers", "0"], "--compiler-layers"),
    ("capacity", ["--models", "nope"], "--models"),
    *[(n, ["--model", "nope"], "--model") for n in ("kernel_error", "million", "niah",
                                                    "selection", "throughput")],
    ("niah", ["--model", "tiny"], "--model"),                   # not the recall layout
    ("niah", ["--checkpoint", "/nonexistent/ckpt"], "--checkpoint"),
    *[(n, ["--kv-cache-dtypes", "fp9"], "--kv-cache-dtypes") for n in ("capacity", "kernels",
                                                                       "niah", "throughput")],
    ("kernels", ["--kv-cache-dtypes", "f32"], "--kv-cache-dtypes"),
    ("million", ["--kv-cache-dtype", "fp9"], "--kv-cache-dtype"),
    *[(n, ["--chunk-size", "0"], "--chunk-size") for n in ("million", "niah", "throughput")],
    ("niah", ["--depths", "0"], "--depths"),
    ("niah", ["--depths", "0.5,2"], "--depths"),
    ("niah", ["--variants", "nope"], "--variants"),
    ("niah", ["--max-batch", "0"], "--max-batch"),
    *[(n, ["--backend", "nope"], "--backend") for n in ("kernel_error", "niah", "throughput")],
    ("kernel_error", ["--seeds", "0"], "--seeds"),
    ("kernels", ["--kernels", "nope"], "--kernels"),
    ("kernels", ["--mode", "compiled"], "--mode"),              # no TPU here
    ("merge", ["--repeats", "0"], "--repeats"),
    ("roofline", ["--mem-mib", "-1"], "--mem-mib"),
    ("selection", ["--topks", "24"], "--topks"),
    ("selection", ["--siblings", "8"], "--siblings"),
    ("throughput", ["--pool-factors", "0"], "--pool-factors"),
    ("throughput", ["--dense-max-length", "x"], "--dense-max-length"),
    ("throughput", ["--decode-steps", "0"], "--decode-steps"),
    ("all", ["--only", "nope"], "--only"),
    ("profile", ["--shards", "16,0"], "--shards"),
    ("profile", ["--lengths", "8"], "--lengths"),               # below the page size
    ("profile", ["--page-size", "48"], "--page-size"),          # small's index_topk is 256
    ("profile", ["--repeats", "0"], "--repeats"),
    ("profile", ["--merge", "nope"], "--merge"),
    ("decode", ["--rounds", "0"], "--rounds"),
    ("decode", ["--long", "4k"], "--short"),                    # not below --long
    ("decode", ["--page-size", "48"], "--page-size"),
    ("decode", ["--batch", "x"], "--batch"),
    ("overload", ["--clients", "32,0"], "--clients"),
    ("overload", ["--tokens", "0"], "--tokens"),
    ("overload", ["--deadline-s", "0"], "--deadline-s"),
    ("overload", ["--bounds", "0,most"], "--bounds"),
    ("overload", ["--page-size", "24"], "--page-size"),
    ("overload", ["--chunk-size", "100"], "--chunk-size"),      # not a multiple of the page
    ("overload", ["--pages-per-shard", "8"], "--pages-per-shard"),  # 64 sessions need more
    ("moe_layouts", ["--groups", "3"], "--groups"),             # does not divide 16 shards
    ("moe_layouts", ["--groups", "1,x"], "--groups"),
    ("moe_layouts", ["--capacity-factor", "0.5"], "--capacity-factor"),
    ("chip", ["--contexts", "32"], "--contexts"),               # below the 64-token page
    ("chip", ["--batches", "1,0"], "--batches"),
    ("chip", ["--layers", "5", "--model", "tiny"], "--layers"),  # tiny has 4
    ("chip", ["--budget-s", "-1"], "--budget-s"),
    ("chip", ["--selection", "pages"], "--selection"),
]


def _usage_error(name: str, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        _module(name).main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "usage:" in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("name,argv,flag", BAD, ids=[f"{n}{' '.join(a)}" for n, a, _ in BAD])
def test_bad_flag_is_a_usage_error(name, argv, flag, capsys, tmp_path):
    err = _usage_error(name, [*argv, "--out", str(tmp_path / "out")], capsys)
    assert flag in err
    assert not (tmp_path / "out").exists(), "flags are checked before --out is created"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_out_that_is_a_file_is_a_usage_error(name, capsys, tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    err = _usage_error(name, ["--out", str(path)], capsys)
    assert f"--out {path}" in err and "not a directory" in err


@pytest.mark.parametrize("name", BENCHMARKS)
def test_unknown_flag_is_a_usage_error(name, capsys, tmp_path):
    assert "--dtypes" in _usage_error(name, ["--dtypes", "bf16", "--out", str(tmp_path)], capsys)


def test_lengths_take_k_and_m_suffixes():
    assert cli_args.length_list("2k,1m,300") == [2048, 1 << 20, 300]
    assert cli_args.nonnegative_length("0") == 0
    assert cli_args.positive_int_list("1,16") == [1, 16]
    assert cli_args.finite_nonnegative_float("0") == 0.0
    for bad in ("-1", "inf", "nan", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli_args.finite_nonnegative_float(bad)
