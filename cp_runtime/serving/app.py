"""Putting a server together: weights source + runtime config -> engine -> server, run either as
the `cp-runtime serve` process (uvloop, SIGINT/SIGTERM end it cleanly) or embedded in a thread
of another program (`cp-runtime demo`, tests).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import socket
import sys
import threading
import time

import uvloop

from cp_runtime.config import RuntimeConfig
from cp_runtime.engine.core import Engine
from cp_runtime.engine.executor import LocalExecutor
from cp_runtime.engine.precompile import compile_at_startup
from cp_runtime.model.source import WeightsSource
from cp_runtime.serving.backend import ServerLimits
from cp_runtime.serving.http.chat_template import load_chat_template
from cp_runtime.serving.session.server import Server
from cp_runtime.serving.state.recovery import restore_sessions
from cp_runtime.serving.state.token_store import TokenStore

__all__ = ["EmbeddedServer", "build_server", "check_bind", "check_port_free", "is_loopback",
           "serve_forever"]

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except socket.gaierror:
            return False
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_bind(host: str, auth_token: str | None) -> None:
    """Refuse to bind a non-loopback address without an auth token."""
    if not is_loopback(host) and not auth_token:
        raise ValueError(f"binding {host} would expose the server beyond this machine: give "
                         "--auth-token (or set CP_RUNTIME_TOKEN), or bind 127.0.0.1")


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Refuse a port something else already listens on, before anything is loaded (the server
    binds it for real only once the model is up). Port 0 asks for any free port."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"{flag} {port}: cannot listen on {host}:{port} "
                             f"({e.strerror}); give another {flag}, or 0 for any free one"
                             ) from None


def build_server(source: WeightsSource, runtime: RuntimeConfig, *, host: str = "127.0.0.1",
                 port: int = 7777, auth_token: str | None = None,
                 limits: ServerLimits = ServerLimits(), seed: int | None = None,
                 state: TokenStore | None = None, executor_factory=None,
                 summary_interval_s: float = 60.0, http_port: int | None = None,
                 strict_fields: bool = False, precompile: str = "auto") -> Server:
    """Load the weights, build the engine on local devices, and wrap it in a (not yet started)
    server. With a token store, the sessions it holds come back (their caches rebuilt from
    their logs by prefills queued before the first connection). `executor_factory(source,
    runtime) -> Executor` replaces the local executor (its workers load the weights: this
    process reads only the config and the tokenizer). `summary_interval_s`: seconds between
    the server's info summaries (0: none). `http_port`: also serve the OpenAI-compatible HTTP
    API there (None: not); `strict_fields`: it refuses unknown request fields (else ignores
    them). `precompile`: "plain" or "all" compiles the step programs of
    cp_runtime.engine.precompile before returning, so no request waits for a compile; "none"
    leaves each to its first use; "auto": plain on TPUs, none on CPUs (where a program
    compiles in seconds and the grid of them would take minutes)."""
    check_bind(host, auth_token)
    t0 = time.perf_counter()
    if executor_factory is None:
        loaded = source.load()
        config, tokenizer = loaded.config, loaded.tokenizer
        executor = LocalExecutor(loaded.config, runtime, loaded.weights)
    else:
        config = source.config()
        tokenizer = source.tokenizer(config)
        executor = executor_factory(source, runtime)
    ready = getattr(executor, "runtime", runtime)          # weight mode and dtype resolved
    log.info("%s: weights (%s, %s) and a pool of %d pages of %d a shard over %d shards ready "
             "in %.1f s", source.name, ready.weights, ready.weight_dtype,
             runtime.pages_per_shard, runtime.page_size, runtime.num_shards,
             time.perf_counter() - t0)
    engine = Engine(config, runtime, executor, seed=seed, journal=state)
    if precompile == "auto":
        precompile = "plain" if executor.platform == "tpu" else "none"
    if precompile != "none":
        compile_at_startup(executor, runtime, sampling=precompile,
                           max_context=engine.max_model_len, progress=sys.stderr.isatty())
    if state is not None:
        t0 = time.perf_counter()
        restore_sessions(engine, state)
        log.info("%s: sessions brought back in %.1f s (caches not restored from a snapshot "
                 "are prefilled as the engine steps)", state.dir, time.perf_counter() - t0)
    server = Server(engine, model_name=source.name, tokenizer=tokenizer, host=host,
                    port=port, auth_token=auth_token, limits=limits, state=state,
                    summary_interval_s=summary_interval_s, strict_fields=strict_fields,
                    chat_template=load_chat_template(source.checkpoint, tokenizer)
                    if http_port is not None else None)
    if http_port is not None:
        from cp_runtime.serving.http.listener import HttpFront   # the `http` extra
        server.http = HttpFront(server, host, http_port)
    return server


async def _serve_until_signalled(server: Server, started: float | None) -> None:
    host, port = await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if started is not None:
        log.info("listening on %s:%d, %.1f s after start-up began", host, port,
                 time.perf_counter() - started)
    if server.http is not None:
        print(f"http listening on {server.http.host}:{server.http.port}", flush=True)
    print(f"listening on {host}:{port}", flush=True)
    await stop.wait()
    print("shutting down", file=sys.stderr, flush=True)
    await server.close()


def serve_forever(server: Server, started: float | None = None) -> None:
    """Run `server` on uvloop until SIGINT or SIGTERM; prints `listening on HOST:PORT` once it
    accepts connections (and logs the seconds since `started`, a time.perf_counter())."""
    uvloop.run(_serve_until_signalled(server, started))


class EmbeddedServer:
    """A server on an event loop in a background thread of this process."""

    def __init__(self, server: Server):
        self.server = server
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="cp-runtime-server")

    def start(self) -> str:
        """Start serving; returns "HOST:PORT"."""
        self._thread.start()
        host, port = asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result()
        return f"{host}:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "EmbeddedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
