"""`cp-runtime compile`: its JSON, its refusals, its weight figures against capacity's, its
figures per step phase, what a newcomer sees (the pool sized for the model, rows as programs
finish, a status line, whole errors, no libtpu noise), and (slow) the whole GLM-5.2 on
tpu7x-16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cp_runtime.aot import topology
from cp_runtime.aot.deploy import CompilePlan, compile_plan, session_pages
from cp_runtime.aot.report import format_error
from cp_runtime.cli.compile import print_result
from cp_runtime.cli.main import main
from cp_runtime.model.scopes import PHASES
from cp_runtime.platform import tpu_chips_present

JSON_FIELDS = ("name", "compiled", "error", "compile_s", "argument_bytes", "output_bytes",
               "alias_bytes", "temp_bytes", "peak_bytes", "flops", "bytes_accessed",
               "optimal_seconds")
needs_libtpu = pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu (tpu extra)")


def test_without_libtpu_it_exits_2_naming_the_extra(monkeypatch, capsys):
    # The one stand-in here: libtpu is installed wherever the rest of this file runs.
    monkeypatch.setattr(topology, "has_libtpu", lambda: False)
    assert main(["compile", "--layers", "1"]) == 2
    assert "tpu extra" in capsys.readouterr().err


def test_unknown_programs_and_topologies_are_usage_errors(capsys):
    assert main(["compile", "--programs", "decode,warp"]) == 2
    assert "'warp' is not one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compile", "--topology", "tpu7x-12"])


@needs_libtpu
@pytest.mark.parametrize("name, devices", [("tpu7x-8", 8), ("tpu7x-16", 16), ("tpu7x-32", 32)])
def test_every_known_topology_gives_its_devices(name, devices):
    found = topology.compile_only_devices(name)
    assert len(found) == devices and {d.device_kind for d in found} == {"TPU7x"}


@needs_libtpu
def test_json_has_every_field_and_the_pool_is_aliased(capsys):
    code = main(["compile", "--model", "deepseek-v3.2", "--layers", "1", "--programs",
                 "page_copy,row_export_latent,row_import", "--pages-per-shard", "capacity",
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("programs", "pool_bytes_per_device", "weight_bytes_per_device",
                "capacity_weight_bytes_per_device", "hbm_bytes_per_device", "topology",
                "devices"):
        assert key in out, key
    assert out["topology"] == "tpu7x-16" and out["devices"] == 16 and out["layers"] == 1
    rows = {p["name"]: p for p in out["programs"]}
    assert set(rows) == {"page_copy", "row_export_latent", "row_import"}
    for row in rows.values():
        assert all(f in row for f in JSON_FIELDS) and row["compiled"], row
    for name in ("page_copy", "row_import"):       # in place: no copy of the pool
        assert rows[name]["alias_bytes"] == out["pool_bytes_per_device"], rows[name]
        assert rows[name]["temp_bytes"] < 0.01 * out["pool_bytes_per_device"], rows[name]


@needs_libtpu
def test_the_table_says_what_was_cut(capsys):
    assert main(["compile", "--model", "glm-5.2", "--layers", "1", "--programs",
                 "page_copy"]) == 0
    printed = capsys.readouterr().out
    assert "cut to its first 1 of 78 layers at full width" in printed
    assert "page_copy" in printed and "TPU7x" in printed


def _weight_figures(model: str, dtype: str, layers: int | None) -> dict:
    """A compile plan's report with no program compiled: the weight arguments' bytes and the
    capacity rule's, as `compile --json` prints them."""
    return compile_plan(CompilePlan(model=model, layers=layers, weight_dtype=dtype,
                                    pages_per_shard=64, programs=()))


def _check_weight_figures(out: dict) -> None:
    compiled, rule = out["weight_bytes_per_device"], out["capacity_weight_bytes_per_device"]
    assert out["weights"] == "sharded"
    assert abs(compiled - rule) <= 0.01 * rule, (compiled, rule)


@needs_libtpu
@pytest.mark.parametrize("model", ["glm-5.2", "deepseek-v3.2"])
def test_capacity_and_compiled_weights_agree_on_cut_models(model):
    """The weight arguments the programs take (their shardings' shard shapes, block scales
    included) against the bytes `cp-runtime capacity` subtracts: within 1%. Four layers are
    sharded as the whole model is; their fp8 weights are 0.56-0.58 of bf16 (the bf16 embedding
    and lm head weigh more beside 4 layers than beside 78). The compiler's own argument bytes
    are checked in test_tpu_compile."""
    fp8, bf16 = (_weight_figures(model, dtype, 4) for dtype in ("fp8", "bf16"))
    for out in (fp8, bf16):
        _check_weight_figures(out)
    assert fp8["weight_bytes_per_device"] < 0.6 * bf16["weight_bytes_per_device"]


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("model", ["glm-5.2", "deepseek-v3.2"])
def test_capacity_and_compiled_weights_agree_on_whole_models(model):
    """The whole models: within 1%, and fp8 about half of bf16 (measured 0.5015, 0.5016)."""
    fp8, bf16 = (_weight_figures(model, dtype, None) for dtype in ("fp8", "bf16"))
    for out in (fp8, bf16):
        _check_weight_figures(out)
    assert 0.49 < fp8["weight_bytes_per_device"] / bf16["weight_bytes_per_device"] < 0.52


@needs_libtpu
@pytest.mark.slow
def test_the_whole_glm_5_2_decode_and_prefill_fit_a_tpu7x_16_slice(capsys):
    """All 78 layers, sharded fp8 weights as the checkpoint holds them (43.6 GiB a device),
    and the pool capacity sizes for the rest of HBM."""
    code = main(["compile", "--model", "glm-5.2", "--programs", "decode,prefill_fill",
                 "--pages-per-shard", "capacity", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    for row in out["programs"]:
        assert row["compiled"], row["error"]
        assert row["peak_bytes"] <= out["hbm_bytes_per_device"], row
        assert row["alias_bytes"] == out["pool_bytes_per_device"], row
    assert out["weight_bytes_per_device"] == out["capacity_weight_bytes_per_device"]


@needs_libtpu
def test_phases_split_the_compiled_decode_step_by_named_scope(capsys):
    """Each step phase's instructions are found in the compiled module by their named scope:
    the kernels in theirs, the collectives in selection and merge, and the phases' cycles add
    up to the module's."""
    # One compile: `cp-runtime compile --phases` prints this result with `print_result`.
    result = compile_plan(CompilePlan(model="tiny", page_size=16, pages_per_shard=4096,
                                      context=4096, programs=("decode",)))
    print_result(result, phases=True, topology_name="tpu7x-16")
    table = capsys.readouterr().out
    lines = {tuple(line.split()[:2]) for line in table.splitlines()}
    gathers = ("q_gather", "kv_gather")      # tiny's weights are whole: no head gathers
    for name in PHASES:
        assert (("decode", name) in lines) == (name not in gathers), (name, table)
    assert "estimates at the compiler's clock" in table
    phases = result["programs"][0]["phases"]
    for name in ("cache_write", "sparse_attention"):       # our Pallas kernels
        assert phases[name]["kernels"] and phases[name]["kernel_bytes"] > 0, name
    # Token selection (the default) scores its candidates in XLA (kernels/token_candidates.py).
    assert phases["indexer"]["instructions"] and not phases["indexer"]["kernels"]
    assert phases["selection"]["collectives"] and phases["merge"]["collectives"]
    assert phases["dense"]["collectives"] == 0        # whole weights: no gathers in the MLP
    assert sum(f["cycles"] for f in phases.values()) > 0
    assert all(f["instructions"] for name, f in phases.items()
               if name not in ("other", *gathers))
    layers = {r["layer"] for r in result["programs"][0]["layer_phases"]}
    assert layers == {None, 0, 1, 2, 3}          # tiny's 4 layers, and what runs outside them


@needs_libtpu
def test_the_default_pool_is_what_the_sessions_take_not_all_of_hbm(capsys):
    """Without --pages-per-shard a toy or cut model's pool holds --max-batch sessions of
    --context tokens (it filled 86 GiB for tiny, and 6 of 8 programs ran out of HBM);
    `--pages-per-shard capacity` is the pool that fills HBM."""
    assert main(["compile", "--model", "tiny", "--layers", "1", "--programs",
                 "row_export_indexer", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = session_pages(CompilePlan(model="tiny"), 16)
    assert want == 8 * ((1 << 20) // 64 // 16 + 1)
    assert (out["pages_per_shard"], out["pool_rule"]) == (want, "sessions")
    assert out["capacity_pages_per_shard"] > 100 * want
    assert out["pool_bytes_per_device"] < 2 ** 30 and out["programs"][0]["compiled"]
    full = compile_plan(CompilePlan(model="tiny", layers=1, pages_per_shard="capacity",
                                    programs=()))
    assert full["pages_per_shard"] == out["capacity_pages_per_shard"]
    assert full["pool_rule"] == "capacity" and full["pool_bytes_per_device"] > 80 * 2 ** 30
    # Where capacity fits fewer pages than the sessions take, the pool is capacity's.
    few = compile_plan(CompilePlan(model="tiny", layers=1, max_batch=1 << 13,
                                   pages_per_shard="sessions", programs=()))
    assert few["pool_rule"] == "capacity"
    assert few["pages_per_shard"] == few["capacity_pages_per_shard"]


@needs_libtpu
def test_each_row_prints_as_its_program_finishes(monkeypatch):
    """The summary and the table's heading come before the first compile, a status line on
    stderr names each program as it starts, and its row reaches stdout before the next one
    starts."""
    events = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def write(self, text):
            if text.strip():
                events.append((self.name, text))

        def flush(self):
            pass

        def isatty(self):
            return False

    monkeypatch.setattr(sys, "stdout", Recorder("out"))
    monkeypatch.setattr(sys, "stderr", Recorder("err"))
    names = ["row_export_latent", "row_export_indexer"]          # the executor's order
    assert main(["compile", "--model", "tiny", "--layers", "1", "--programs",
                 ",".join(names)]) == 0
    order = []
    for stream, text in events:
        if stream == "out" and "program " in text and "est. time" in text:
            order.append("heading")
        for i, name in enumerate(names):
            if stream == "err" and f"[{i + 1}/2] compiling {name} ..." in text:
                order.append(f"start {name}")
            if stream == "out" and text.startswith(f"{name} ") and " yes " in text:
                order.append(f"row {name}")
    assert order == ["heading", *(f"{e} {n}" for n in names for e in ("start", "row"))], events
    assert "2 of 2 programs compiled in" in "".join(t for s, t in events if s == "out")


@needs_libtpu
def test_a_compile_error_prints_whole(capsys):
    """A program that runs out of HBM (tiny's pool at capacity's 86 GiB, copied by page_copy)
    shows the compiler's whole message in the table, as --json holds it, and what to do."""
    argv = ["compile", "--model", "tiny", "--layers", "1", "--programs", "page_copy",
            "--pages-per-shard", "capacity"]
    assert main([*argv, "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["programs"][0]["error"]
    assert error.startswith("RESOURCE_EXHAUSTED: ") and error.endswith(".")
    assert main(argv) == 1
    table = capsys.readouterr().out
    row = table.split("page_copy ", 1)[1]
    message, after = row.split("\n\n", 1)
    assert message.split()[2:] == error.replace(":", "", 1).split(), table   # no, seconds
    assert "RESOURCE_EXHAUSTED: the program needs more HBM" in after


def test_format_error_wraps_lines_whole_and_says_what_it_left():
    sentence = "the total memory required for HLO temporaries exceeds available HBM. " * 4
    text = format_error(sentence, indent=2, width=60)
    assert all(len(line) <= 60 and line.startswith("  ") for line in text.splitlines())
    assert text.split() == sentence.split()
    many = "\n".join(f"line {i}" for i in range(50))
    shown = format_error(many, lines=10).splitlines()
    assert shown[9].strip() == "line 9"
    assert shown[10].strip() == "... 40 more lines (--json prints the whole message)"


@needs_libtpu
@pytest.mark.skipif(tpu_chips_present(), reason="libtpu's start-up is hidden only without TPUs")
def test_libtpu_start_up_noise_is_hidden_without_a_tpu():
    """libtpu's start-up page (no TPU_ACCELERATOR_TYPE, `E0000 ... INVALID_ARGUMENT` about
    worker hostnames) is printed to fd 2 by C++; a fresh process shows none of it."""
    # Without the suite's persistent compilation cache too: a cache entry written by another
    # backend makes JAX warn as it reads it, which is not libtpu's noise.
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")}
    done = subprocess.run([sys.executable, "-m", "cp_runtime.cli.main", "compile", "--model",
                           "tiny", "--layers", "1", "--programs", "row_export_indexer"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "row_export_indexer   yes" in done.stdout
    for noise in ("E0000", "INVALID_ARGUMENT", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES",
                  "InitGoogle", "host bounds"):
        assert noise not in done.stderr, done.stderr
    assert done.stderr.strip() == "[1/1] compiling row_export_indexer ...", done.stderr
