"""Running the OpenAI-compatible app (cp_runtime.serving.openai_api) with uvicorn on the
server's own event loop, beside the session protocol's listener: one process, one engine,
two front doors.

uvicorn is driven by hand (startup, main loop, shutdown) rather than `uvicorn.run`, which would
want a loop and the signals of its own. The server's limits carry over: `max_connections` is
uvicorn's concurrency limit (one more is answered 503), `idle_timeout_s` its keep-alive
timeout, `max_frame_bytes` the largest body (checked by the app, 413).
"""

from __future__ import annotations

import asyncio
import socket

from cp_runtime.optional import require

__all__ = ["HttpFront"]

H11_MAX_HEADER_BYTES = 64 << 10                  # a request line plus headers, at most


class HttpFront:
    """The HTTP listener of a `Server`: `await start()` binds, `await close()` stops."""

    def __init__(self, server, host: str, port: int):
        require("uvicorn", "--http-port", "http")
        require("starlette", "--http-port", "http")
        require("prometheus_client", "--http-port", "http")
        self.server, self.host, self.port = server, host, port
        self._uvicorn = None
        self._task: asyncio.Task | None = None
        self._sockets: list[socket.socket] = []

    async def start(self) -> tuple[str, int]:
        import uvicorn

        from cp_runtime.serving.openai_api import OpenAIApp

        self.api = OpenAIApp(self.server)
        limits = self.server.limits
        config = uvicorn.Config(
            self.api.app, lifespan="off", access_log=False, log_level="warning",
            limit_concurrency=limits.max_connections,
            timeout_keep_alive=limits.idle_timeout_s,
            h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES)
        config.load()
        self._uvicorn = uvicorn.Server(config)
        self._uvicorn.lifespan = config.lifespan_class(config)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._sockets = [sock]
        await self._uvicorn.startup(sockets=self._sockets)
        self._task = asyncio.get_running_loop().create_task(self._uvicorn.main_loop())
        self.port = sock.getsockname()[1]
        return self.host, self.port

    async def close(self) -> None:
        if self._uvicorn is None:
            return
        self._uvicorn.should_exit = True
        if self._task is not None:
            await self._task
        await self._uvicorn.shutdown(sockets=self._sockets)
