"""`cp-runtime compile`: its JSON, its refusals, and (slow) the whole GLM-5.2 on tpu7x-16."""

from __future__ import annotations

import json

import pytest

from cp_runtime.aot import topology
from cp_runtime.cli import main

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


@needs_libtpu
@pytest.mark.slow
def test_the_whole_glm_5_2_decode_and_prefill_fit_a_tpu7x_16_slice(capsys):
    """All 78 layers, sharded bf16 weights (86.5 GiB a device: the loader's fp8 weights are
    another issue's), and the pool the rest of HBM holds (1536 pages of 64 a shard)."""
    code = main(["compile", "--model", "glm-5.2", "--pages-per-shard", "1536", "--programs",
                 "decode,prefill_fill", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    for row in out["programs"]:
        assert row["compiled"], row["error"]
        assert row["peak_bytes"] <= out["hbm_bytes_per_device"], row
        assert row["alias_bytes"] == out["pool_bytes_per_device"], row
    assert out["weight_bytes_per_device"] == out["capacity_weight_bytes_per_device"]
