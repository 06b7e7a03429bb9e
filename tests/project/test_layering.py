"""The layers of cp_runtime: which sub-package may import which, written once below and checked
over every import in the source tree (those inside functions too), and no circle of imports
between modules."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

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

# Inside serving: each sub-package (session/, http/, state/) or shared module (backend, errors,
# app, process) and the other pieces of serving it may import, read as in MAY_IMPORT. Durable
# state stands alone; the HTTP door sees the server only as a `backend.Backend` (and the
# protocol's error codes), never the server, its device loop or the state; `process` starts a
# server by its command line and imports nothing of the package.
SERVING_MAY_IMPORT = {
    "state": set(),
    "backend": set(),
    "errors": {"session.protocol"},
    "session": {"backend", "errors", "state"},
    "http": {"backend", "errors", "session.protocol"},
    "app": {"backend", "errors", "session", "http", "state"},
    "process": set(),
}
# The engine's modules the HTTP door may import: the requests, events and errors it submits
# and reads (the engine itself is behind the backend).
HTTP_MAY_IMPORT_FROM_ENGINE = {"cp_runtime.engine.requests"}


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


SERVING = {m: p for m, p in MODULES.items() if m.startswith("cp_runtime.serving.")}


def _serving_piece(module: str) -> str:
    """session, http, state, or a shared module's name: cp_runtime.serving.PIECE[...]."""
    return module.split(".")[2]


def test_the_serving_table_names_every_piece():
    assert {_serving_piece(m) for m in SERVING} == set(SERVING_MAY_IMPORT)


@pytest.mark.parametrize("module", sorted(SERVING))
def test_each_serving_module_imports_only_what_its_piece_allows(module):
    piece = _serving_piece(module)
    allowed = SERVING_MAY_IMPORT[piece]
    imported = {_known(m) or m for m in _imports(SERVING[module])}
    bad = sorted(m for m in imported if m.startswith("cp_runtime.serving.")
                 and _serving_piece(m) != piece and _serving_piece(m) not in allowed
                 and ".".join(m.split(".")[2:4]) not in allowed)
    if piece == "process":
        bad += sorted(imported)
    if piece == "http":
        bad += sorted(m for m in imported if _part(m) == "engine"
                      and m not in HTTP_MAY_IMPORT_FROM_ENGINE)
    assert not bad, f"{module} ({piece}) imports {bad}; {piece} may import {sorted(allowed)}"


def test_the_server_implements_the_http_doors_backend():
    """Every member of serving/backend.py's Backend is a method or property of the server, or
    an attribute its __init__ sets."""
    backend = _class(ROOT / "cp_runtime/serving/backend.py", "Backend")
    wanted = {n.name for n in backend.body if isinstance(n, (ast.FunctionDef,
                                                           ast.AsyncFunctionDef))}
    wanted |= {n.target.id for n in backend.body if isinstance(n, ast.AnnAssign)}
    server = _class(ROOT / "cp_runtime/serving/session/server.py", "Server")
    has = {n.name for n in server.body if isinstance(n, (ast.FunctionDef,
                                                       ast.AsyncFunctionDef))}
    init = next(n for n in server.body if getattr(n, "name", None) == "__init__")
    has |= {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for target in n.targets
            for t in ast.walk(target) if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert wanted and not wanted - has, sorted(wanted - has)


def _class(path: pathlib.Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(path.read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == name)


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
