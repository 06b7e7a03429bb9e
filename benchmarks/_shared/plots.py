"""PNG charts for the benchmarks: grouped bars and lines, written with matplotlib's Agg backend
(no display needed). matplotlib is the `bench` extra; it loads on first use (without it, a
clear error names the extra; `cp-runtime bench` checks for it before any work).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from cp_runtime.optional import require

__all__ = ["bar_chart", "line_chart", "stacked_bar_chart", "token_label"]


def _pyplot():
    """matplotlib.pyplot on the Agg backend (imported here: the `bench` extra is optional)."""
    require("matplotlib", "the benchmarks' plots", "bench")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def bar_chart(path: str | pathlib.Path,
              panels: Sequence[tuple[str, Sequence[str], dict[str, Sequence[float]]]],
              *, ylabel: str, title: str, log: bool = False) -> pathlib.Path:
    """Grouped bars in side-by-side panels, each (title, groups, {series: one value per
    group}): one group of bars per entry of `groups`, one bar per series, a series keeping its
    colour across panels. Each panel has its own y axis, so groups of very different sizes
    stay readable."""
    plt = _pyplot()
    widths = [max(2.5, 0.45 * len(groups) * max(1, len(series)))
              for _, groups, series in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0, sum(widths) + 1.5), 4.5),
                             squeeze=False, gridspec_kw={"width_ratios": widths})
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(name for _, _, series in panels for name in series))
    colors = {name: cycle[i % len(cycle)] for i, name in enumerate(names)}
    for ax, (panel_title, groups, series) in zip(axes[0], panels):
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series.items()):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, values, width, label=name, color=colors[name])
        ax.set_xticks(range(len(groups)), groups, fontsize="small")
        ax.set_title(panel_title, fontsize="medium")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    return _save(fig, path)


def stacked_bar_chart(path: str | pathlib.Path,
                      panels: Sequence[tuple[str, Sequence[str], dict[str, Sequence[float]],
                                             Sequence[float] | None]],
                      *, ylabel: str, title: str) -> pathlib.Path:
    """Side-by-side panels of stacked bars. Each panel is (title, bar labels, {segment: one
    value per bar}, totals per bar or None); segments stack in order and keep one colour across
    panels, and a total is drawn as a black tick across its bar (e.g. a measured whole beside
    the sum of its parts)."""
    plt = _pyplot()
    widths = [max(2.5, 0.9 * len(groups)) for _, groups, _, _ in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(widths) + 3.5, 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(name for _, _, series, _ in panels for name in series))
    colors = {name: cycle[i % len(cycle)] for i, name in enumerate(names)}
    for ax, (panel_title, groups, series, totals) in zip(axes[0], panels):
        bottom = [0.0] * len(groups)
        for name, values in series.items():
            ax.bar(range(len(groups)), values, 0.7, bottom=bottom, label=name, color=colors[name])
            bottom = [b + v for b, v in zip(bottom, values)]
        if totals is not None:
            ax.scatter(range(len(groups)), totals, marker="_", s=900, color="black", zorder=3,
                       label="whole (measured)")
        ax.set_xticks(range(len(groups)), groups, fontsize="small")
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    handles = {label: handles[label] for label in [*names, "whole (measured)"] if label in handles}
    axes[0][-1].legend(list(handles.values()), list(handles), loc="upper left",
                       bbox_to_anchor=(1.02, 1), fontsize="small")
    fig.suptitle(title)
    return _save(fig, path)


def token_label(n: float) -> str:
    """1024 -> '1K', 1048576 -> '1M' (binary prefixes, as context lengths are given)."""
    for size, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= size and n % size == 0:
            return f"{int(n) // size}{suffix}"
    return f"{n:g}"


def line_chart(path: str | pathlib.Path, lines: dict[str, tuple[Sequence[float], Sequence[float]]],
               *, xlabel: str, ylabel: str, title: str, logx: bool = True,
               dashed: Sequence[str] = (), groups: dict[str, str] | None = None) -> pathlib.Path:
    """One line per entry of `lines` (label -> (xs, ys)), markers at the measured points; the
    labels in `dashed` are drawn dashed, and labels mapped to the same `groups` entry share a
    colour. A log2 x axis is labelled in tokens (1K, 64K, 1M)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    groups = groups or {label: label for label in lines}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {g: cycle[i % len(cycle)] for i, g in enumerate(dict.fromkeys(groups.values()))}
    for label, (xs, ys) in lines.items():
        ax.plot(xs, ys, marker="o", label=label, linestyle="--" if label in dashed else "-",
                color=colors[groups.get(label, label)])
    if logx:
        ax.set_xscale("log", base=2)
        ticks = sorted({x for xs, _ in lines.values() for x in xs})
        ax.set_xticks(ticks, [token_label(x) for x in ticks])
        ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, path)
