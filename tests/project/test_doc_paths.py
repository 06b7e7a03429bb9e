"""Every dotted `cp_runtime.` name that the README, the docs, the configs or a docstring or comment
names resolves to a module or an attribute of one, so a moved module leaves no old path behind."""

import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("README.md", "docs/*.md", "configs/**/*.toml", "cp_runtime/**/*.py", "kernels/*.py",
           "cluster/*.py", "benchmarks/**/*.py")
DOTTED = re.compile(r"\bcp_runtime(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
NOT_MODULES = {"cp_runtime.serving.requests"}      # a logger's name (serving/session/activity.py)


def _names() -> dict[str, str]:
    """Each dotted name, with the first file that names it."""
    found = {}
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            for name in DOTTED.findall(path.read_text()):
                found.setdefault(name.rstrip("."), str(path.relative_to(ROOT)))
    return found


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return all((obj := getattr(obj, attr, None)) is not None for attr in parts[i:])
    return False


NAMES = _names()


def test_the_scan_finds_names():
    assert len(NAMES) > 50 and "cp_runtime.engine.step" in NAMES


@pytest.mark.parametrize("name", sorted(set(NAMES) - NOT_MODULES))
def test_a_named_path_resolves(name):
    assert _resolves(name), f"{NAMES[name]} names {name}, which does not resolve"
