"""The output of `cp-runtime bench profile` (profile.py): the roofline table, one table per
(kind, length) with the shard counts side by side, and the stacked-bar plot of phase times
beside each whole engine step.
"""

from __future__ import annotations

import pathlib

from cp_runtime.benchmarks._shared.plots import stacked_bar_chart, token_label
from cp_runtime.benchmarks._shared.profile_work import DECODE_PHASES, LABELS, PREFILL_PHASES
from cp_runtime.benchmarks._shared.results import machine, print_table

__all__ = ["plot", "print_tables"]


def _ms(seconds: float) -> float:
    return 1000 * seconds


def _summary_rows(row: dict) -> list[tuple[str, float]]:
    return [("sum of device phases", row["device_phases_s"]),
            ("device program (whole)", row["program_s"]),
            ("sum of phases", row["phases_sum_s"]),
            ("whole step (engine)", row["whole_step_s"])]


def print_tables(result: dict, args) -> None:
    info = machine()
    print_table([{"shards": s, **r["roofline"]} for s, r in result["by_shards"].items()],
                ["shards", "read_gb_per_s", "copy_gb_per_s", "matmul_n", "matmul_gflop_per_s"],
                title=f"roofline (measured in this run): {info['processor']}, "
                      f"{info['cpu_count']} cores, backend {info['backend']}")
    shards = list(result["by_shards"])
    for kind in ("decode", "prefill"):
        for length in args.lengths:
            rows = {s: next(r for r in result["by_shards"][s]["rows"]
                            if (r["kind"], r["length"]) == (kind, length)) for s in shards}
            print()
            print_table(_comparison(rows, shards), _columns(shards),
                        title=_title(kind, length, rows[shards[0]], args))


def _title(kind: str, length: int, row: dict, args) -> str:
    what = (f"decode step at {token_label(length)} (1 row)" if kind == "decode" else
            f"prefill chunk at {token_label(length)} ({row['queries']} tokens)")
    return (f"{what}: {args.model}, {args.kv_cache_dtype}, page {args.page_size}; ms, minimum "
            "MB and MFLOP, % of the measured bandwidth and matmul rate")


def _columns(shards: list[int]) -> list[str]:
    cols = ["phase"] + [f"S={s} ms" for s in shards]
    if len(shards) > 1:
        cols.append(f"S={shards[0]}/S={shards[-1]}")
    for s in shards:
        cols += [f"S={s} MB", f"S={s} MFLOP", f"S={s} bw%", f"S={s} flop%"]
    return cols


def _comparison(rows: dict[int, dict], shards: list[int]) -> list[dict]:
    """One table row per phase (then the sums), the shard counts side by side."""
    first, last = shards[0], shards[-1]
    out = []
    for i, phase in enumerate(rows[first]["phases"]):
        line = {"phase": phase["label"]}
        for s in shards:
            p = rows[s]["phases"][i]
            line |= {f"S={s} ms": _ms(p["seconds"]), f"S={s} MB": p["min_bytes"] / 1e6,
                     f"S={s} MFLOP": p["min_flops"] / 1e6, f"S={s} bw%": p["bw_pct"],
                     f"S={s} flop%": p["flop_pct"]}
        line[f"S={first}/S={last}"] = (rows[first]["phases"][i]["seconds"]
                                       / rows[last]["phases"][i]["seconds"])
        out.append(line)
    for j, (label, _) in enumerate(_summary_rows(rows[first])):
        line = {"phase": label}
        for s in shards:
            line[f"S={s} ms"] = _ms(_summary_rows(rows[s])[j][1])
        line[f"S={first}/S={last}"] = (_summary_rows(rows[first])[j][1]
                                       / _summary_rows(rows[last])[j][1])
        out.append(line)
    return out


def plot(result: dict, path: pathlib.Path, model: str) -> pathlib.Path:
    """Stacked bars of phase ms, one bar per (length, S); decode and prefill in two panels,
    a black tick at each whole engine step."""
    panels = []
    for kind in ("decode", "prefill"):
        rows = [r for s in result["by_shards"] for r in result["by_shards"][s]["rows"]
                if r["kind"] == kind]
        rows.sort(key=lambda r: (r["length"], -r["shards"]))
        keys = DECODE_PHASES if kind == "decode" else PREFILL_PHASES
        series = {LABELS[k]: [_ms(next(p["seconds"] for p in r["phases"] if p["phase"] == k))
                              for r in rows] for k in keys}
        groups = [f"{token_label(r['length'])}\nS={r['shards']}" for r in rows]
        panels.append((f"{kind} {'step' if kind == 'decode' else 'chunk'}", groups, series,
                       [_ms(r["whole_step_s"]) for r in rows]))
    return stacked_bar_chart(path, panels, ylabel="ms", title=f"{model}: time per phase "
                             "(bars) and whole engine step (ticks)")

