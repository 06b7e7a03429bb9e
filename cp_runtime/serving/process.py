"""`cp-runtime serve` as a child process: started, waited for until it listens, stopped. The one
way the tests, the benchmarks and a notebook start a real server.

    with ServerProcess(["--model", "tiny", "--shards", "16"]) as server:
        with Client(server.address) as client:
            ...

The server binds port 0 (unless the flags name `--port`), compiles each step program on first
use (unless they name `--precompile`), and prints `listening on HOST:PORT`,
after `http listening on HOST:PORT` when `--http-port` is given; both addresses are read from
there. Its stderr goes to a temporary file (a pipe nobody reads would stall a chatty server),
which `log()` reads back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["SERVE_COMMAND", "ServerProcess"]

SERVE_COMMAND = (sys.executable, "-m", "cp_runtime.cli.main", "serve")
TOKEN_ENV = "CP_RUNTIME_TOKEN"


class ServerProcess:
    """A `cp-runtime serve FLAGS` child process that is listening.

    env: variables added to this process's environment, which is passed on without
    CP_RUNTIME_TOKEN (a user's token must not change what a test or benchmark measures; pass it
    in `env` to set one). startup_s: how long to wait for the `listening on` line before the
    process is killed and RuntimeError names what it wrote.
    address: the session protocol's HOST:PORT; http_address: the OpenAI door's, or None.
    """

    def __init__(self, flags: list[str] | tuple[str, ...], *, env: dict[str, str] | None = None,
                 startup_s: float = 600.0):
        port = [] if "--port" in flags else ["--port", "0"]
        # Many short-lived servers: each program compiles on first use unless the flags ask
        # for the start-up compile.
        precompile = [] if "--precompile" in flags else ["--precompile", "none"]
        self.command = [*SERVE_COMMAND, *flags, *port, *precompile]
        self._log = tempfile.TemporaryFile()
        environment = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env={**environment, **(env or {})})
        self.http_address: str | None = None
        self.address = self._wait_listening(startup_s)
        # Drain stdout from here on, so a server that prints never blocks on a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def _wait_listening(self, startup_s: float) -> str:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("http listening on "):      # printed before `listening on`
                self.http_address = line.split()[-1]
            if line.startswith("listening on "):
                return line.split()[-1]
            if not line and self.proc.poll() is not None:
                break
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(f"the server did not start (exit code {self.proc.returncode}):\n"
                           f"{self.log()[-4000:]}")

    def log(self) -> str:
        """Everything the server has written to stderr so far."""
        fd = self._log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig` (SIGTERM: a clean shutdown) and wait; SIGKILL after timeout_s. Returns the
        exit code (0 for a clean shutdown)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """kill -9, as a crash would."""
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
