"""The README's commands run as written. Every fenced block of README.md is one test: a
`bash` or `python` block runs; a block that cannot run here says so with a marker, an HTML
comment on the line just before its fence, and any other block without one fails:

    <!-- readme-test: skip (why) -->                  not run: installs, benchmarks, minutes
    <!-- readme-test: serve -->                       a bash block holding one `cp-runtime
                                                      serve ...` line: it must print
                                                      `listening on`, then end cleanly
                                                      (exit 0) on SIGINT, as Ctrl-C does
    <!-- readme-test: python, with a server: FLAGS -->  a python block run against
                                                      `cp-runtime serve FLAGS`; the block's
                                                      addresses (`127.0.0.1:PORT` of --port
                                                      and --http-port) become the server's,
                                                      which listens on free ports

Blocks run from the repository's root, in a fresh interpreter or shell with this environment's
`cp-runtime` first on PATH, each within RUN_LIMIT_S (a block the README runs should take
under a minute here; the limit leaves room for a loaded machine).
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys

import pytest

from cp_runtime.serving.process import ServerProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN_LIMIT_S = 300
MARKER = re.compile(r"<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
RUNNABLE = ("bash", "python")


def readme_blocks(text: str) -> list[dict]:
    """Each fenced block: {line (of its fence, 1-based), lang, body, marker (or None)}."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"README.md:{i + 1}: a fence that never closes"
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        blocks.append({"line": i + 1, "lang": fence.group(1), "marker":
                       marker.group(1) if marker else None,
                       "body": "\n".join(lines[i + 1:end])})
        i = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text())


def test_the_scan_finds_the_blocks_and_the_markers():
    assert len(BLOCKS) >= 6
    assert {b["lang"] for b in BLOCKS} >= {"bash", "python"}
    kinds = {(b["marker"] or "").split(" ")[0].rstrip(",") for b in BLOCKS}
    assert {"", "skip", "serve", "python"} <= kinds, kinds


def _env() -> dict[str, str]:
    """This environment's scripts first on PATH; no token of the user's."""
    env = {k: v for k, v in os.environ.items() if k != "CP_RUNTIME_TOKEN"}
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env["PATH"]])
    return env


def _run(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done


def _commands(body: str) -> list[str]:
    """A bash block's command lines (comments and blank lines dropped, continuations joined)."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line.split("#", 1)[0].strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _served_flags(flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """`flags` with --port and --http-port on free ports, and {the README's HOST:PORT: which
    address of the server replaces it}."""
    out, addresses, i = [], {}, 0
    while i < len(flags):
        if flags[i] in ("--port", "--http-port") and i + 1 < len(flags):
            addresses[f"127.0.0.1:{flags[i + 1]}"] = flags[i]
            out += [flags[i], "0"]
            i += 2
            continue
        out.append(flags[i])
        i += 1
    return out, addresses


def _serve(block: dict) -> None:
    (command,) = _commands(block["body"])
    words = shlex.split(command)
    assert words[:2] == ["cp-runtime", "serve"], command
    flags, _ = _served_flags(words[2:])
    server = ServerProcess(flags, env=_env(), startup_s=RUN_LIMIT_S)
    try:
        assert server.address.startswith("127.0.0.1:")
    finally:
        code = server.stop(signal.SIGINT)
    assert code == 0, server.log()[-3000:]


def _python_with_server(block: dict, flags_text: str) -> None:
    flags, addresses = _served_flags(shlex.split(flags_text))
    with ServerProcess(flags, env=_env(), startup_s=RUN_LIMIT_S) as server:
        code = block["body"]
        for written, flag in addresses.items():
            actual = server.address if flag == "--port" else server.http_address
            assert written in code, (written, code)
            code = code.replace(written, actual)
        _run([sys.executable, "-c", code])


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b['line']}-{b['lang'] or 'text'}"
                                               for b in BLOCKS])
def test_a_readme_block_runs_or_says_why_not(block):
    marker = block["marker"]
    if marker is not None and marker.startswith("skip"):
        why = re.fullmatch(r"skip \((.+)\)", marker)
        assert why, f"README.md:{block['line']}: a skip marker says why: skip (why)"
        pytest.skip(f"README.md:{block['line']}: {why.group(1)}")
    if marker == "serve":
        return _serve(block)
    if marker is not None and marker.startswith("python, with a server:"):
        assert block["lang"] == "python", block["line"]
        return _python_with_server(block, marker.split(":", 1)[1])
    assert marker is None, f"README.md:{block['line']}: unknown marker {marker!r}"
    assert block["lang"] in RUNNABLE, (
        f"README.md:{block['line']}: a ```{block['lang']} block is neither run here nor "
        "marked: mark it <!-- readme-test: skip (why) --> or make it a bash or python block")
    if block["lang"] == "python":
        _run([sys.executable, "-c", block["body"]])
    else:
        _run(["bash", "-euo", "pipefail", "-c", block["body"]])
