"""Packaging and layering: the wheel claims one import name and ships its configs; the runtime
imports neither the benchmarks nor the cluster code, and lower layers never import upper ones."""

import ast
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "cp_runtime"


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _modules(folder: pathlib.Path):
    return sorted(folder.glob("*.py"))


@pytest.mark.parametrize("path", _modules(RUNTIME) + _modules(RUNTIME / "engine")
                         + _modules(RUNTIME / "serving"), ids=lambda p: p.name)
def test_the_runtime_imports_no_benchmark_and_no_cluster_code(path):
    bad = {m for m in _imports(path)
           if m.split(".")[:2] in (["cp_runtime", "benchmarks"], ["cp_runtime", "cluster"])
           or m.split(".")[0] in ("benchmarks", "cluster", "kernels")}
    assert not bad, f"{path.name} imports {bad}"


@pytest.mark.parametrize("lower, upper", [(RUNTIME / "engine", "cp_runtime.serving")]
                         + [(p, "cp_runtime.engine") for p in _modules(RUNTIME)
                            if p.name not in ("cli.py", "demo.py")]
                         + [(p, "cp_runtime.serving") for p in _modules(RUNTIME)
                            if p.name not in ("cli.py", "demo.py", "__init__.py")],
                         ids=lambda x: getattr(x, "name", x))
def test_lower_layers_do_not_import_upper_ones(lower, upper):
    paths = _modules(lower) if lower.is_dir() else [lower]
    for path in paths:
        bad = {m for m in _imports(path) if m == upper or m.startswith(upper + ".")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_wheel_claims_one_import_name_and_ships_configs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("cp_runtime-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"cp_runtime"}
    for config in ("models/glm-5.2.toml", "models/tiny.toml", "runtime/local.toml"):
        assert f"cp_runtime/configs/{config}" in names
    for package in ("kernels", "benchmarks", "cluster", "engine", "serving"):
        assert f"cp_runtime/{package}/__init__.py" in names
    assert "cp_runtime/kernels/native/indexer_page_scores.cc" in names   # built on first use
    cited = _docs_cited_by_help()
    assert cited, "no docs/NAME.md found in the helps: the scan is broken"
    for doc in cited:                                     # --help's references resolve
        assert f"cp_runtime/{doc}" in names, doc


def _docs_cited_by_help() -> set[str]:
    """Every docs/NAME.md that `cp-runtime ... --help` (and a benchmark's) names."""
    import contextlib
    import io
    import re

    from cp_runtime.cli.main import BENCHMARKS, main

    text = io.StringIO()
    commands = [[], ["serve"], ["demo"], ["capacity"], ["compile"],
                *(["bench", b] for b in BENCHMARKS)]
    for argv in commands:
        with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
            main([*argv, "--help"])
    return set(re.findall(r"docs/[a-z_]+\.md", text.getvalue()))
