"""Shared benchmark plumbing: the machine description, JSON output, table printing. Command-line
flags and their types (`parse_length` included) live in cp_runtime.cli.args."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time

import jax

from cp_runtime.cli.args import parse_length  # re-exported; the one copy is in cli.args
from cp_runtime.parallel.devices import init_cpu_devices  # re-exported

__all__ = ["ServeProcess", "apply_quick", "init_cpu_devices", "init_shard_devices", "machine",
           "parse_length", "print_table", "quick_help", "write_json"]


def init_shard_devices(parser: argparse.ArgumentParser, shards: int) -> None:
    """init_cpu_devices(shards) for a benchmark's `--shards`; too few devices is a usage error
    (parser.error exits 2) rather than a traceback."""
    try:
        init_cpu_devices(shards)
    except ValueError as e:
        parser.error(f"--shards {shards}: {e}")


def quick_help(values: dict[str, tuple[str, str]], dest: str) -> str:
    """The help's note on a flag that `--quick` changes: 'unset: 8k,128k; --quick: 8k'."""
    default, quick = values[dest]
    return f"unset: {default}; --quick: {quick}"


def apply_quick(parser: argparse.ArgumentParser, args: argparse.Namespace,
                values: dict[str, tuple[str, str]]) -> None:
    """Fill each flag of `values` (dest -> (default, --quick value), as typed on a command
    line) that was left unset: its --quick value under `--quick`, else its default, parsed by
    the flag's own type. An explicit flag wins over both."""
    actions = {a.dest: a for a in parser._actions}
    for dest, (default, quick) in values.items():
        if getattr(args, dest) is None:
            kind = actions[dest].type or str
            setattr(args, dest, kind(quick if args.quick else default))


def machine() -> dict:
    """What the figures were measured on."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "device_kind": jax.devices()[0].device_kind,
    }


def write_json(path: str | pathlib.Path, payload: dict) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=str))
    return path


def print_table(rows: list[dict], columns: list[str], title: str | None = None) -> None:
    if title:
        print(title)
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


class ServeProcess:
    """`cp-runtime serve FLAGS --port 0` as a subprocess (no auth token from the environment;
    `env` adds variables to it); `address` is the HOST:PORT of its `listening on` line, `proc`
    the process. `http_address` is the HOST:PORT of its `http listening on` line when FLAGS
    hold `--http-port`, else None."""

    def __init__(self, flags: list[str], timeout_s: float = 600.0,
                 env: dict[str, str] | None = None):
        self.command = [sys.executable, "-m", "cp_runtime.cli.main", "serve", *flags, "--port", "0"]
        self._log = tempfile.TemporaryFile(mode="w+t")
        env = {**{k: v for k, v in os.environ.items() if k != "CP_RUNTIME_TOKEN"}, **(env or {})}
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        self.http_address: str | None = None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("http listening on "):      # printed before `listening on`
                self.http_address = line.split()[-1]
            if line.startswith("listening on "):
                self.address = line.split()[-1]
                return
            if not line and self.proc.poll() is not None:
                break
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"the server did not start:\n{self.stderr()}")

    def stderr(self) -> str:
        """The last 4,000 characters the server wrote to stderr."""
        self._log.seek(0)
        return self._log.read()[-4000:]

    def kill(self) -> None:
        """kill -9, as a crash would."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
