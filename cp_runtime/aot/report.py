"""Compile programs for compile-only TPU devices and tabulate what the compiler reports.

Per program: compiled or the compiler's error (its whole message and code), compile seconds, and
per device the argument / output / alias / temp bytes (`memory_analysis`), the peak (arguments +
outputs - aliased + temporaries) against the device's HBM, the arguments held in host memory
(a latent cache there, `latent_memory` "host"), and the compiler's flops, bytes
accessed and time estimate (`cost_analysis`; `optimal_seconds`, None where the compiler gives
none or a negative placeholder), and the compiler's figures per step phase (cp_runtime.aot.phases:
instructions, estimated cycles, XLA's HBM bytes and MXU flops, kernels, collectives and their
bytes; `phases` summed over the layers, `layer_phases` per layer and phase).
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
import time

import jax
import numpy as np

from cp_runtime.aot.phases import layer_figures, sum_figures
from cp_runtime.aot.roofline import TPU7X_DEVICE, compiler_clock_hz
from cp_runtime.aot.programs import Program

__all__ = ["FIELDS", "compile_figures", "compile_program", "format_error", "format_phases",
           "format_row", "format_table", "format_case", "per_device_bytes", "table_header"]

FIELDS = ("name", "compiled", "error", "error_code", "compile_s", "argument_bytes",
          "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes", "host_argument_bytes",
          "flops",
          "bytes_accessed", "optimal_seconds", "weight_argument_bytes", "pool_argument_bytes",
          "phases", "layer_phases")


def per_device_bytes(tree, memory_kind: str | None = None) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest share);
    with `memory_kind` ("device", "pinned_host"), of the arrays held there only."""
    total = 0
    for x in jax.tree.leaves(tree):
        if memory_kind is not None and _memory_kind(x) != memory_kind:
            continue
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _memory_kind(x) -> str:
    kind = getattr(x.sharding, "memory_kind", None)
    return "device" if kind in (None, "device") else kind


def _error_code(message: str) -> str | None:
    """`E1001` style codes where XLA gives one, else the status word (`INTERNAL`, ...)."""
    found = re.search(r"\bE\d{4}\b", message)
    if found:
        return found.group(0)
    status = re.match(r"\s*([A-Z_]{4,}):", message)
    return status.group(1) if status else None


def _message(error: Exception) -> str:
    """The exception's whole message; the type named unless the message opens with its status
    word (XLA's `RESOURCE_EXHAUSTED: ...`), which says more than `JaxRuntimeError`."""
    text = str(error).strip()
    if re.match(r"[A-Z_]{4,}:", text):
        return text
    return f"{type(error).__name__}: {text}"


ERROR_LINES = 40      # lines of an error the table prints; --json holds the whole message


def format_error(message: str, indent: int = 4, width: int = 100,
                 lines: int = ERROR_LINES) -> str:
    """An error message for a table: every line wrapped at `width`, indented, never cut inside
    a line; a message longer than `lines` lines (a Mosaic error may carry a kernel's whole IR)
    ends with how many lines more --json holds."""
    pad = " " * indent
    source = message.strip().splitlines() or [""]
    out = []
    for line in source[:lines]:
        out += textwrap.wrap(line, width - indent, initial_indent=pad, subsequent_indent=pad,
                             break_long_words=False, break_on_hyphens=False) or [""]
    if len(source) > lines:
        out.append(f"{pad}... {len(source) - lines} more lines (--json prints the whole "
                   "message)")
    return "\n".join(out)


def compile_program(program: Program, device) -> dict:
    """`compile_figures` of a program, with its weight and pool argument bytes per device."""
    out = compile_figures(program.name, program.fn, program.args, program.kwargs, device)
    out["weight_argument_bytes"] = per_device_bytes([program.args[i]
                                                     for i in program.weight_args])
    out["pool_argument_bytes"] = per_device_bytes([program.args[i] for i in program.pool_args])
    return out


def compile_figures(name: str, fn, args: tuple, kwargs: dict, device) -> dict:
    """Lower and compile jitted `fn(*args, **kwargs)` with `device` as the default device
    (Pallas reads the TPU generation from it); the figures of the module docstring, or the
    error."""
    out = dict.fromkeys(FIELDS)
    out["name"] = name
    t0 = time.perf_counter()
    try:
        with jax.default_device(device):
            compiled = fn.lower(*args, **kwargs).compile()
    except Exception as error:  # noqa: BLE001 - the compiler's refusal is the result
        out.update(compiled=False, error=_message(error), error_code=_error_code(str(error)),
                   compile_s=round(time.perf_counter() - t0, 2))
        return out
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    seconds = cost.get("optimal_seconds")
    out.update(
        compiled=True,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        peak_bytes=int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                       - mem.alias_size_in_bytes + mem.temp_size_in_bytes),
        host_argument_bytes=int(mem.host_argument_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        optimal_seconds=float(seconds) if seconds is not None and seconds >= 0 else None,
    )
    by_layer = layer_figures(compiled.as_text(), compiler_clock_hz(device))
    out["phases"] = {name: dataclasses.asdict(f) for name, f in sum_figures(by_layer).items()}
    out["layer_phases"] = [{"layer": layer, "phase": name, **dataclasses.asdict(f)}
                           for (layer, name), f in by_layer.items()]
    return out


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _short(x, unit: str = "") -> str:
    if x is None:
        return "-"
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def table_header() -> str:
    """The program table's heading and rule (`format_row` writes its lines)."""
    head = (f"{'program':<20} {'ok':<3} {'compile':>8} {'args GiB':>9} {'out GiB':>8} "
            f"{'alias GiB':>9} {'temp GiB':>9} {'peak GiB':>9} {'of HBM':>7} {'flops':>9} "
            f"{'bytes':>9} {'est. time':>10}")
    return f"{head}\n{'-' * len(head)}"


def format_row(r: dict, hbm_bytes: int) -> str:
    """One program's line of the table; a failure's is its error code, then the compiler's
    whole message below it (`format_error`)."""
    if not r["compiled"]:
        code = r["error_code"] or "error"
        message = r["error"].removeprefix(f"{code}: ")      # the code is on the row
        return (f"{r['name']:<20} {'no':<3} {r['compile_s']:>7.1f}s  {code}\n"
                f"{format_error(message)}")
    est = "-" if r["optimal_seconds"] is None else f"{r['optimal_seconds'] * 1e3:.3f} ms"
    return (f"{r['name']:<20} {'yes':<3} {r['compile_s']:>7.1f}s {_gib(r['argument_bytes']):>9} "
            f"{_gib(r['output_bytes']):>8} {_gib(r['alias_bytes']):>9} "
            f"{_gib(r['temp_bytes']):>9} {_gib(r['peak_bytes']):>9} "
            f"{r['peak_bytes'] / hbm_bytes:>6.1%} {_short(r['flops']):>9} "
            f"{_short(r['bytes_accessed'], 'B'):>9} {est:>10}")


def format_table(rows: list[dict], hbm_bytes: int) -> str:
    """The heading and one line per program (`format_row`)."""
    return "\n".join([table_header(), *(format_row(r, hbm_bytes) for r in rows)])


def format_phases(rows: list[dict]) -> str:
    """Per compiled program with step phases, one line per phase that ran: entry instructions,
    the compiler's estimated cycles and their share of the program's, Pallas kernel calls with
    their estimated flops and bytes, collectives and their result bytes per device."""
    head = (f"{'program':<16} {'phase':<17} {'instr':>6} {'est. cycles':>12} {'share':>6} "
            f"{'kernels':>7} {'k. flops':>9} {'k. bytes':>9} {'collectives':>11} "
            f"{'coll. bytes':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        phases = r.get("phases") or {}
        total = sum(f["cycles"] for f in phases.values())
        if not r["compiled"] or set(k for k, f in phases.items() if f["instructions"]) <= {"other"}:
            continue
        for name, f in phases.items():
            if f["instructions"] or f["collectives"]:
                share = f["cycles"] / total if total else 0.0
                lines.append(f"{r['name']:<16} {name:<17} {f['instructions']:>6} "
                             f"{f['cycles']:>12,} {share:>6.1%} {f['kernels']:>7} "
                             f"{_short(f['kernel_flops']):>9} "
                             f"{_short(f['kernel_bytes'], 'B'):>9} {f['collectives']:>11} "
                             f"{_short(f['collective_bytes'], 'B'):>11}")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f}" if seconds < 1 else f"{seconds * 1e3:,.0f}"


def format_case(row: dict, calibration=None) -> str:
    """One case of `compile --matrix` (cp_runtime.aot.cases): per phase, the estimate (the
    TensorCore's part, the collectives', what of those the schedule has work beside), the
    floor, what bounds it and the fraction, and the compiled flops and bytes, all per device
    and at the whole model's size; with a `calibration` (cp_runtime.aot.calibration), also
    the estimate times the chip's measured / estimated for that phase."""
    scaled = (f"scaled from {row['layers_compiled']} compiled"
              if row["layers_compiled"] != row["layers_of_model"] else "as compiled")
    title = (f"{row['case']}: {row['layers_of_model']} layers, {scaled}; attention "
             f"{row.get('attention', '-')}")
    if not row["compiled"]:
        return f"{title}\n  did not compile:\n{format_error(row['error'])}"
    head = (f"{'phase':<17} {'est. ms':>10} {'TC ms':>10} {'ICI ms':>9} {'hidden':>9} "
            f"{'floor ms':>10} {'bound':>5} {'floor/est':>9} {'GFLOP':>10} {'HBM GB':>9} "
            f"{'ICI GB':>8}" + (f" {'chip-cal. ms':>12}" if calibration else ""))
    lines = [title, head, "-" * len(head)]
    calibrated = 0.0
    for name, p in row["phases"].items():
        if not (p["instructions"] or p["collectives"]):
            continue
        flops = p["mxu_flops"] + p["kernel_flops"]
        hbm = p["xla_bytes"] + p["kernel_bytes"]
        fraction = "-" if p["fraction"] is None else f"{p['fraction']:.2f}"
        lines.append(
            f"{name:<17} {_ms(p['seconds']):>10} {_ms(p['xla_s'] + p['kernel_s']):>10} "
            f"{_ms(p['collective_s']):>9} {_ms(p.get('hidden_s', 0.0)):>9} "
            f"{_ms(p['floor_s']):>10} {p['bound']:>5} "
            f"{fraction:>9} {flops / 1e9:>10,.1f} {hbm / 1e9:>9,.2f} "
            f"{p['ici_bytes'] / 1e9:>8,.3f}" + _calibrated(calibration, row, name, p))
        if calibration:
            ratio = calibration.ratio(row["program"], row["batch"], name)
            calibrated += p["seconds"] * (ratio or 1.0)
    lines.append(f"{'total':<17} {_ms(row['seconds']):>10} {'':>10} {'':>9} {'':>9} "
                 f"{_ms(row['floor_s']):>10} {'':>5} {row['floor_s'] / row['seconds']:>9.2f}"
                 + (f" {'':>10} {'':>9} {'':>8} {_ms(calibrated):>12}" if calibration else ""))
    if calibration:
        lines.append(f"chip-cal.: each phase's estimate times measured / estimated on "
                     f"{calibration.source} (a phase it did not run: as estimated); a "
                     "forecast, not a TPU7x measurement")
    if "overlapped_s" in row:
        lines.append(f"overlapped: {_ms(row['overlapped_s'])} ms if each collective ran beside "
                     "the work the schedule runs while it moves (`hidden`)")
    lines.append(_unpriced_line(row["phases"]))
    if row.get("with_unpriced_s") is not None and any(
            p.get("unpriced") for p in row["phases"].values()):
        lines.append(f"with the unpriced work at its least bytes at the HBM rate (sorts and "
                     f"scatters on the TensorCore, SparseCore calls beside it, replayed in the "
                     f"schedule's order): {_ms(row['with_unpriced_s'])} ms")
    return "\n".join(lines)


def _calibrated(calibration, row: dict, name: str, p: dict) -> str:
    if not calibration:
        return ""
    ratio = calibration.ratio(row["program"], row["batch"], name)
    return f" {_ms(p['seconds'] * ratio):>12}" if ratio else f" {'-':>12}"


def _unpriced_line(phases: dict) -> str:
    """What the estimates leave out: work XLA:TPU gives no price (cp_runtime.aot.phases,
    `unpriced`), per phase, and the least it costs: its bytes at the HBM rate."""
    found = {name: p.get("unpriced", 0) for name, p in phases.items() if p.get("unpriced")}
    if not found:
        return "unpriced: none (every instruction that does work carries a price)"
    nbytes = sum(p.get("unpriced_bytes", 0) for p in phases.values())
    each = ", ".join(f"{name} {n:,.0f}" for name, n in found.items())
    return (f"unpriced (sorts, rewritten scatters, SparseCore calls; in no estimate above): "
            f"{each}; they move at least {nbytes / 1e9:,.1f} GB, "
            f"{_ms(nbytes / TPU7X_DEVICE.hbm_bytes_per_s)} ms at the HBM rate")
