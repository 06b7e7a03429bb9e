"""Packaging: the wheel claims one import name and ships its configs, every package and the docs
that --help cites. (Which package may import which: tests/project/test_layering.py.)"""

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
    for package in ("kernels", "benchmarks", "benchmarks/_shared", "benchmarks/hand_model",
                    "cluster"):
        assert f"cp_runtime/{package}/__init__.py" in names
    for init in (ROOT / "cp_runtime").rglob("__init__.py"):    # pyproject lists every package
        assert init.relative_to(ROOT).as_posix() in names, init
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

    from cp_runtime.benchmarks import registry
    from cp_runtime.cli.main import main

    text = io.StringIO()
    commands = [[], ["serve"], ["demo"], ["capacity"], ["compile"], ["bench"],
                *(["bench", b] for b in registry.names())]
    for argv in commands:
        with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
            main([*argv, "--help"])
    return set(re.findall(r"docs/[a-z_]+\.md", text.getvalue()))
