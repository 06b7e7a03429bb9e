"""Markdown for the benchmarks' write-ups (`cp-runtime bench all`'s report.md, `bench overload`'s
overload.md): a GitHub table of result rows."""

from __future__ import annotations

__all__ = ["markdown_table"]


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "x".join(map(str, v))
    return "" if v is None else str(v).replace("|", "\\|")


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A GitHub markdown table of `rows` (columns: the given ones, else every key in order)."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
