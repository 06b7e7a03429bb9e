"""The layers of cp_runtime: which sub-package may import which, written once below and checked
over every import in the source tree (those inside functions too), and no circle of imports
between modules."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Where each part of the `cp_runtime` namespace lives in the repository.
PARTS = {"weights": "cp_runtime/weights", "cache": "cp_runtime/cache",
         "parallel": "cp_runtime/parallel", "model": "cp_runtime/model",
         "engine": "cp_runtime/engine", "cluster": "cluster", "aot": "cp_runtime/aot",
         "serving": "cp_runtime/serving", "cli": "cp_runtime/cli"}

# The ground floor: modules any part may import, which import nothing above the ground.
GROUND = {"config", "dtypes", "platform", "optional", "kernels"}

# What each part may import besides itself and the ground; read a row as "imports only ...".
# `cluster` is the Ray executor (an engine Executor on worker processes); `aot` compiles the
# engine's programs for a TPU; both serve `cli`, and neither may reach the server.
MAY_IMPORT = {
    "weights": set(),
    "cache": {"weights"},
    "parallel": {"weights", "cache"},
    "model": {"weights", "cache", "parallel"},
    "engine": {"weights", "cache", "parallel", "model"},
    "cluster": {"weights", "cache", "parallel", "model", "engine"},
    "aot": {"weights", "cache", "parallel", "model", "engine"},
    "serving": {"weights", "cache", "parallel", "model", "engine"},
    "cli": {"weights", "cache", "parallel", "model", "engine", "aot", "serving", "root"},
}
# `cp_runtime/__init__.py`, the public face: the clients and their errors, nothing else.
ROOT_MAY_IMPORT = {"serving"}


def _module_name(path: pathlib.Path) -> str:
    """cp_runtime.engine.core for cp_runtime/engine/core.py; kernels/ and cluster/ install as
    cp_runtime.kernels and cp_runtime.cluster."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] != "cp_runtime":
        parts.insert(0, "cp_runtime")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[pathlib.Path]:
    folders = [ROOT / "cp_runtime", ROOT / "kernels", ROOT / "cluster"]
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def _imports(path: pathlib.Path) -> set[str]:
    """Every cp_runtime module `path` imports, at its top or inside a function; not those under
    `if TYPE_CHECKING:`, which name a type and never run."""
    names = set()
    for node in ast.walk(_without_type_checking(ast.parse(path.read_text()))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}   # `from pkg import mod`
    return {n for n in names if n == "cp_runtime" or n.startswith("cp_runtime.")}


def _without_type_checking(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                   "typing.TYPE_CHECKING"):
            node.body = []
    return tree


def _part(module: str) -> str:
    """The layer a cp_runtime module belongs to: a key of MAY_IMPORT, a GROUND name, `root` (the
    package itself) or `benchmarks`."""
    pieces = module.split(".")
    return "root" if len(pieces) == 1 else pieces[1]


MODULES = {_module_name(p): p for p in _sources()}


def _known(module: str) -> str | None:
    """`module` if it is a module of the tree, else its longest prefix that is (a name imported
    from a module: `cp_runtime.cli.main.main`), None if it is neither."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def test_the_table_names_every_part_and_every_part_exists():
    parts = {_part(m) for m in MODULES}
    assert parts == set(PARTS) | GROUND | {"root"}, parts ^ (set(PARTS) | GROUND | {"root"})
    for folder in PARTS.values():
        assert (ROOT / folder / "__init__.py").exists(), folder


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_imports_only_what_its_layer_allows(module):
    part = _part(module)
    if part in GROUND:
        allowed = {part} | ({"dtypes"} if part == "config" else set())
    elif part == "root":
        allowed = ROOT_MAY_IMPORT
    else:
        allowed = {part} | GROUND | MAY_IMPORT[part]
    imported = {_known(m) or m for m in _imports(MODULES[module])}
    bad = sorted(m for m in imported if _part(m) not in allowed)
    assert not bad, f"{module} ({part}) imports {bad}; {part} may import {sorted(allowed)}"


def test_no_module_imports_the_benchmarks():
    for module, path in MODULES.items():
        bad = [m for m in _imports(path) if _part(m) == "benchmarks"]
        assert not bad, f"{module} imports {bad}"


def test_no_circle_of_imports():
    graph = {m: {k for k in map(_known, _imports(p)) if k and k != m}
             for m, p in MODULES.items()}
    graph = {m: {k for k in deps if not _is_parent_package(k, m)} for m, deps in graph.items()}
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            circle = on_path[on_path.index(module):] + [module]
            pytest.fail("circle of imports: " + " -> ".join(circle))
        if module in done:
            return
        on_path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def _is_parent_package(package: str, module: str) -> bool:
    """Importing cp_runtime.engine.core runs cp_runtime/engine/__init__.py first, so a package's
    own modules naming the package (`from cp_runtime.engine import x`) are not a circle."""
    return module.startswith(package + ".")
