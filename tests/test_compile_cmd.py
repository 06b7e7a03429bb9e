"""`cp-runtime compile`: its JSON, its refusals, its weight figures against capacity's, its
figures per step phase, and (slow) the whole GLM-5.2 on tpu7x-16."""

from __future__ import annotations

import json

import pytest

from cp_runtime.aot import topology
from cp_runtime.aot.deploy import CompilePlan, compile_plan
from cp_runtime.cli.compile import print_result
from cp_runtime.cli.main import main
from cp_runtime.model.phases import PHASES

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
                 "page_copy,row_export_latent,row_import", "--json"])
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
                 "--json"])
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
    for name in ("cache_write", "indexer", "sparse_attention"):       # our Pallas kernels
        assert phases[name]["kernels"] and phases[name]["kernel_bytes"] > 0, name
    assert phases["selection"]["collectives"] and phases["merge"]["collectives"]
    assert phases["dense"]["collectives"] == 0        # whole weights: no gathers in the MLP
    assert sum(f["cycles"] for f in phases.values()) > 0
    assert all(f["instructions"] for name, f in phases.items()
               if name not in ("other", *gathers))
    layers = {r["layer"] for r in result["programs"][0]["layer_phases"]}
    assert layers == {None, 0, 1, 2, 3}          # tiny's 4 layers, and what runs outside them
