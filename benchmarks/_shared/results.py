"""Shared benchmark plumbing: the machine description, JSON output, table printing. Command-line
flags and their types (`parse_length` included) live in cp_runtime.cli.args, the benchmarks'
argument base (`--quick`, shared flags and their checks) in benchmarks/_shared/bench_parser.py."""

from __future__ import annotations

import json
import os
import pathlib
import platform

import jax

from cp_runtime.cli.args import parse_length  # re-exported; the one copy is in cli.args
from cp_runtime.parallel.devices import init_cpu_devices  # re-exported

__all__ = ["init_cpu_devices", "machine", "parse_length", "print_table", "write_json"]


def machine() -> dict:
    """What the figures were measured on."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
    }


def write_json(path: str | pathlib.Path, payload: dict) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=str))
    return path


def print_table(rows: list[dict], columns: list[str], title: str | None = None) -> None:
    if title:
        print(title)
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
