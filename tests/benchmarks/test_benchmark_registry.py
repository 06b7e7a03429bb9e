"""The benchmark suite's shape: one table of benchmarks (benchmarks/registry.py) that the CLI,
`bench all` and the tests read, every entry point in it, no entry point importing another (the
code they share lives in benchmarks/_shared/), and no two files of the project with one name."""

import ast
import collections
import pathlib

import pytest

from cp_runtime.benchmarks import registry
from cp_runtime.benchmarks import suite_report
from cp_runtime.cli.main import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
PACKAGE = "cp_runtime.benchmarks"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(BENCH).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


SOURCES = {_module_name(p): p for p in sorted(BENCH.rglob("*.py"))}
ENTRY_POINTS = {b.qualified_module: b.name for b in registry.BENCHMARKS}


def _tree(module: str) -> ast.Module:
    return ast.parse(SOURCES[module].read_text())


def _imports(module: str) -> set[str]:
    """Every module of the suite that `module` imports, at its top or inside a function:
    `import a.b`, `from a import b` (b a module or a name in a) and relative imports."""
    package = module if SOURCES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in SOURCES}


def _defines(module: str, *names: str) -> bool:
    top = {n.name for n in _tree(module).body if isinstance(n, ast.FunctionDef)}
    return set(names) <= top


# -- the table ------------------------------------------------------------------------------
def test_the_table_names_each_benchmark_once_with_a_module_and_a_purpose():
    names = [b.name for b in registry.BENCHMARKS]
    assert len(names) == len(set(names)) and names == list(registry.names())
    assert len({b.module for b in registry.BENCHMARKS}) == len(names), "one module, one name"
    for b in registry.BENCHMARKS:
        assert b.qualified_module in SOURCES, f"{b.name}: no module {b.module}"
        assert b.purpose and "\n" not in b.purpose and len(b.purpose) <= 90, b.name
    assert registry.get("all").module == "suite_report"
    with pytest.raises(KeyError, match="known: niah"):
        registry.get("nope")


def test_every_entry_point_is_in_the_table_and_nothing_else_looks_like_one():
    """A module with a `main` and a `build_parser` is a benchmark, so it is in the table; the
    table's modules are exactly those."""
    looks_like = {m for m in SOURCES if _defines(m, "main", "build_parser")}
    assert looks_like == set(ENTRY_POINTS), looks_like ^ set(ENTRY_POINTS)


def test_the_shared_code_is_in_its_private_folder_and_no_entry_point_is():
    for module in ENTRY_POINTS:
        assert "._shared" not in module, module
    helpers = {m for m in SOURCES if m not in ENTRY_POINTS and m != f"{PACKAGE}.registry"
               and not SOURCES[m].name == "__init__.py"}
    for module in helpers:
        assert "._shared." in module or ".hand_model." in module, \
            f"{module} is no benchmark: it belongs in benchmarks/_shared/ (or hand_model/)"


def test_the_cli_offers_exactly_the_table():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    bench = sub.choices["bench"]
    (name,) = [a for a in bench._actions if a.dest == "name"]
    assert list(name.choices) == list(registry.names())
    assert all(b.purpose in bench.format_help() for b in registry.BENCHMARKS)


def test_bench_all_runs_benchmarks_of_the_table():
    assert {s.name for s in suite_report.SECTIONS} <= set(registry.names())


def test_chip_runs_as_a_module_on_a_tpu_host():
    """`python -m cp_runtime.benchmarks.chip`, and it draws no plot (no `bench` extra there)."""
    chip = registry.get("chip")
    assert chip.qualified_module == f"{PACKAGE}.chip" and not chip.plots
    assert 'if __name__ == "__main__":' in SOURCES[chip.qualified_module].read_text()


def test_no_other_list_of_the_benchmarks():
    """No literal list of most benchmark names outside the registry (a second table to keep in
    step); a test's few names for a parametrization are not one."""
    names = set(registry.names())
    files = [*(ROOT / "cp_runtime").rglob("*.py"), *BENCH.rglob("*.py"),
             *(ROOT / "tests").rglob("*.py")]
    for path in files:
        if path == BENCH / "registry.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                strings = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                assert len(strings & names) <= len(names) // 2, \
                    f"{path.relative_to(ROOT)}:{node.lineno} lists the benchmarks again"


# -- imports --------------------------------------------------------------------------------
@pytest.mark.parametrize("module", sorted(SOURCES))
def test_no_module_of_the_suite_imports_an_entry_point(module):
    """An entry point takes shared code from benchmarks/_shared/, never from another entry
    point; to run another benchmark it goes through the registry (`registry.run(name)`)."""
    bad = sorted(m for m in _imports(module) if m in ENTRY_POINTS and m != module)
    assert not bad, f"{module} imports the entry point(s) {bad}"


def test_the_import_scan_sees_imports():
    assert f"{PACKAGE}._shared.bench_parser" in _imports(f"{PACKAGE}.niah")
    assert f"{PACKAGE}.hand_model.tpu_compiler" in _imports(f"{PACKAGE}.hand_model.tpu_model")
    assert f"{PACKAGE}.registry" in _imports(f"{PACKAGE}.profile")


def test_the_hand_model_imports_no_measurement():
    """The hand model is arithmetic: of the suite, it imports only itself and the shared
    argument base, results table and work counts."""
    allowed = {f"{PACKAGE}._shared.{m}" for m in ("bench_parser", "results", "minimum_work")}
    for module in (m for m in SOURCES if ".hand_model" in m):
        outside = {m for m in _imports(module) if ".hand_model" not in m} - allowed
        assert not outside, f"{module} imports {sorted(outside)}"


# -- file names -----------------------------------------------------------------------------
def test_no_two_files_of_the_project_share_a_name():
    """A file's name says its job: two files called x.py with different jobs mislead whoever
    searches for x.py (package __init__.py files aside)."""
    folders = ("cp_runtime", "kernels", "cluster", "benchmarks")
    paths = [p for f in folders for p in (ROOT / f).rglob("*.py") if p.name != "__init__.py"]
    by_name = collections.defaultdict(list)
    for path in paths:
        by_name[path.name].append(path.relative_to(ROOT).as_posix())
    shared = {name: sorted(where) for name, where in by_name.items() if len(where) > 1}
    assert not shared, shared
