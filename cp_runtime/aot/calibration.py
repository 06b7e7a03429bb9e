"""The compiler's estimates calibrated by a real chip.

`cp-runtime bench chip --trace` on a TPU records, per traced step (`prefill chunk at 128k`,
`decode B=8`) and step phase, the device ms the profiler measured and the compiler's estimate
of the same program for that chip (benchmarks/_shared/chip_trace.py, `estimated_phase_ms`).
Their ratio, measured / estimated, says how far the cost model is off for that kind of work on
a real TPU. `compile --matrix --calibration CHIP_JSON` prints each TPU7x estimate beside itself
times that ratio: a forecast corrected by a measurement on another chip, still a forecast.
"""

from __future__ import annotations

import json
import pathlib
import re

__all__ = ["Calibration", "load_calibration"]

_DECODE = re.compile(r"^decode B=(\d+)$")


class Calibration:
    """measured / estimated per (step kind, batch, phase), read from a `bench chip` JSON."""

    def __init__(self, rows: list[dict], source: str):
        self.source = source
        self.decode: dict[int, dict[str, float]] = {}
        self.prefill: dict[str, float] = {}
        for row in rows:
            ratio = row.get("measured_over_estimate")
            if not ratio:
                continue
            found = _DECODE.match(row["step"])
            if found:
                self.decode.setdefault(int(found.group(1)), {})[row["phase"]] = ratio
            elif row["step"].startswith("prefill"):
                self.prefill[row["phase"]] = ratio
        if not self.decode and not self.prefill:
            raise ValueError(f"{source} holds no calibration: run `cp-runtime bench chip "
                             "--trace` on a TPU")

    def ratio(self, program: str, batch: int, phase: str) -> float | None:
        """measured / estimated for a phase of a matrix case (its program and batch): decode
        at the nearest batch the chip ran, prefill from its traced chunk; None if the chip
        gave none for that phase."""
        if program.startswith("decode"):
            if not self.decode:
                return None
            nearest = min(self.decode, key=lambda b: (abs(b - batch), b))
            return self.decode[nearest].get(phase)
        return self.prefill.get(phase)


def load_calibration(path: str | pathlib.Path) -> Calibration:
    """The calibration in a `bench chip` JSON (OUT/chip.json)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--calibration {path}: cannot read it as bench chip's JSON ({e})"
                         ) from None
    device = data.get("device", {}).get("kind", "a chip")
    return Calibration(data.get("phases", []), f"{path} ({device})")
