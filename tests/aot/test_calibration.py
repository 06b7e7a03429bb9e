"""`compile --matrix --calibration`: the chip's measured / estimated per phase (a `bench chip`
JSON) scales the matrix's TPU7x estimates, decode by the nearest batch the chip ran."""

import json

import pytest

from cp_runtime.aot.calibration import load_calibration
from cp_runtime.aot.report import format_case
from cp_runtime.cli.main import main


def _chip_json(path, phases):
    path.write_text(json.dumps({"device": {"kind": "TPU v5 lite"}, "phases": phases}))
    return path


def _phase(step, phase, ratio):
    return {"step": step, "phase": phase, "device_ms": 2.0 * ratio, "estimated_ms": 2.0,
            "measured_over_estimate": ratio}


def _row(program, batch, seconds):
    phases = {name: {"instructions": 10, "collectives": 0, "mxu_flops": 1e9, "kernel_flops": 0,
                     "xla_bytes": 1e9, "kernel_bytes": 0, "ici_bytes": 0, "fraction": 0.5,
                     "seconds": s, "xla_s": s, "kernel_s": 0.0, "collective_s": 0.0,
                     "floor_s": s / 2, "bound": "HBM"}
              for name, s in seconds.items()}
    return {"case": f"{program} case", "program": program, "batch": batch, "compiled": True,
            "layers_compiled": 3, "layers_of_model": 3, "phases": phases,
            "seconds": sum(seconds.values()), "floor_s": sum(seconds.values()) / 2}


def test_ratios_go_to_the_nearest_batch_and_the_prefill_chunk(tmp_path):
    cal = load_calibration(_chip_json(tmp_path / "chip.json", [
        _phase("decode B=1", "indexer", 3.0), _phase("decode B=8", "indexer", 5.0),
        _phase("decode B=8", "dense", 1.5), _phase("prefill chunk at 128k", "indexer", 7.0),
        {"step": "decode B=8", "phase": "other", "device_ms": 1.0}]))     # no estimate
    assert cal.ratio("decode", 1, "indexer") == 3.0
    assert cal.ratio("decode", 32, "indexer") == 5.0                       # nearest: 8
    assert cal.ratio("decode", 32, "other") is None
    assert cal.ratio("prefill_logits", 1, "indexer") == 7.0
    assert cal.ratio("prefill_logits", 1, "dense") is None
    text = format_case(_row("decode", 32, {"indexer": 2e-3, "dense": 4e-3, "other": 1e-3}),
                       cal)
    lines = {line.split()[0]: line.split() for line in text.splitlines()[1:] if line.strip()}
    assert lines["phase"][-2:] == ["chip-cal.", "ms"]
    assert float(lines["indexer"][-1]) == pytest.approx(10.0)             # 2 ms x 5
    assert float(lines["dense"][-1]) == pytest.approx(6.0)                # 4 ms x 1.5
    assert lines["other"][-1] == "-"
    assert float(lines["total"][-1]) == pytest.approx(10.0 + 6.0 + 1.0)   # other as estimated
    assert "chip-cal." not in format_case(_row("decode", 1, {"indexer": 2e-3}))


def test_a_file_without_calibration_or_without_matrix_is_refused(tmp_path, capsys):
    empty = _chip_json(tmp_path / "chip.json", [{"step": "decode B=1", "phase": "dense",
                                                 "device_ms": 1.0}])
    with pytest.raises(ValueError, match="holds no calibration"):
        load_calibration(empty)
    with pytest.raises(ValueError, match="cannot read it"):
        load_calibration(tmp_path / "missing.json")
    assert main(["compile", "--calibration", str(empty)]) == 2
    assert "give --matrix too" in capsys.readouterr().err
