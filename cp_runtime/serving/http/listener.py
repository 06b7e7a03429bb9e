"""Running the OpenAI-compatible app (cp_runtime.serving.http.openai_api) with uvicorn on the
server's own event loop, beside the session protocol's listener: one process, one engine,
two front doors.

uvicorn is driven by hand (startup, main loop, shutdown) rather than `uvicorn.run`, which would
want a loop and the signals of its own. The server's limits carry over:

    max_connections  HTTP connections open at once: the first `max_connections` hold a slot;
                     a request on any connection past them is answered 503 `unavailable` in
                     OpenAI's shape, with Retry-After, and the connection closed; /health and
                     /metrics are answered on such a connection all the same (a probe or a
                     scraper must not fail because clients fill the slots)
    idle_timeout_s   uvicorn's keep-alive timeout (silence between requests); it also caps the
                     read timeout below
    max_frame_bytes  the largest body (checked by the app, 413)

and one bound of this module's, the read timeout, min(READ_TIMEOUT_S, idle_timeout_s): a
request's line and headers must arrive whole within it of their first byte (of the
connection's opening, for its first request); its body is allowed that much plus a second per
MIN_BODY_BYTES_PER_S received; and the rest of a body the app answered without reading (a 413,
a 401) may take that much to drain. Past it the client is answered 408 in OpenAI's shape (when
no answer has begun) and the connection closed, so a client that trickles its request
(slowloris) holds a slot for a bounded time. uvicorn's h11 protocol has no such timeout of its
own: its keep-alive timer runs only between requests.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket

from cp_runtime.optional import require

require("uvicorn", "--http-port", "http")        # before the imports: the pip command, not
require("starlette", "--http-port", "http")      # a ModuleNotFoundError
require("prometheus_client", "--http-port", "http")

import h11  # noqa: E402 - uvicorn's own dependency, checked above with it
import uvicorn  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from uvicorn.protocols.http.h11_impl import H11Protocol  # noqa: E402

from cp_runtime.serving.backend import Backend  # noqa: E402
from cp_runtime.serving.http import openai_format as fmt  # noqa: E402
from cp_runtime.serving.http.openai_api import RETRY_AFTER_S, OpenAIApp  # noqa: E402

__all__ = ["HttpFront"]

log = logging.getLogger(__name__)

H11_MAX_HEADER_BYTES = 64 << 10                  # a request line plus headers, at most
# A real client sends its request head in one write, within a round trip; 10 s leaves room
# for a lossy link and still frees a slot held by a client that trickles bytes.
READ_TIMEOUT_S = 10
# A body slower than this on average (after the read timeout's grace) is a trickle, not an
# upload: 16 KiB/s (128 kbit/s) is far below any link that would carry a long prompt, and a
# body at least this fast is bounded by max_frame_bytes (64 MiB: 68 min at the worst).
MIN_BODY_BYTES_PER_S = 16 << 10
UNLIMITED_PATHS = frozenset({"/health", "/metrics"})   # answered past max_connections too
READING = {"head": "the request head", "body": "the request body",
           "rest": "the rest of an answered request's body"}    # what the read timeout bounds


class _Slots:
    """Which HTTP connections hold one of `limit` slots: the first `limit` open at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held: set = set()

    def take(self, connection) -> bool:
        if len(self._held) >= self.limit:
            return False
        self._held.add(connection)
        return True

    def give_back(self, connection) -> None:
        self._held.discard(connection)


class _BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with the connection limit and the read timeout of this module.

    The limit is decided when a connection opens (as the session protocol's is), and applied
    by the ASGI app each request of it runs: the app itself, or the 503 refusal. The read
    timeout is one timer, armed for what the connection is reading: a request head (deadline
    fixed at its first byte), a body (deadline pushed on by each chunk), or the rest of a body
    already answered (fixed); between requests uvicorn's keep-alive timer bounds the silence,
    and once a request is read whole the app answers in its own time."""

    def __init__(self, *args, slots: _Slots, read_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._slots, self._timeout_s = slots, read_timeout_s
        self._app, self.app = self.app, self._admit_or_refuse
        self._admitted = False
        self._timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None        # "head", "body" or "rest": what the timer bounds
        self._deadline = 0.0

    # -- the connection's life ------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._admitted = self._slots.take(self)
        self._watch(began=True)                 # a new connection owes us a request head

    def connection_lost(self, exc) -> None:
        self._slots.give_back(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(began=True, received=len(data))

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request starts here only if the client already sent part of it (pipelined).
        self._watch(began=bool(self.conn.trailing_data[0]))

    # -- the read timeout -----------------------------------------------------------------
    def _watch(self, began: bool, received: int = 0) -> None:
        """Arm, move or drop the timer for what h11 now waits for from the client."""
        state = self.conn.their_state
        if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()                      # the request is in whole: the app's turn
        elif state is h11.IDLE and not began:
            self._disarm()                      # between requests: the keep-alive timeout's
        elif state is h11.IDLE:
            self._arm_once("head")      # from the head's first byte: trickling does not extend it
        elif self.cycle.response_complete:
            self._arm_once("rest")      # answered already: drained for a while, not for ever
        elif self._reading != "body":
            self._arm("body", self.loop.time() + self._timeout_s)
        else:
            self._arm("body", self._deadline + received / MIN_BODY_BYTES_PER_S)

    def _arm_once(self, reading: str) -> None:
        if self._reading != reading:
            self._arm(reading, self.loop.time() + self._timeout_s)

    def _arm(self, reading: str, deadline: float) -> None:
        self._disarm()
        self._reading, self._deadline = reading, deadline
        self._timer = self.loop.call_at(deadline, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._reading = None, None

    def _timed_out(self) -> None:
        reading, self._timer = self._reading, None
        if self.transport.is_closing():
            return
        if reading == "body" and self.flow.read_paused:
            # uvicorn stopped reading (the app has not taken the body so far): not the client's
            # delay.
            self._arm("body", self.loop.time() + self._timeout_s)
            return
        log.info("HTTP connection from %s: %s not received within the read timeout (%s s); "
                 "closing it", _address(self.client), READING[reading], self._timeout_s)
        # A head has no answer under way; a body may have one begun (the app answers before
        # reading it all), and the rest of a body has had its answer: then it just closes.
        if reading == "head" or (reading == "body" and not self.cycle.response_started):
            self.transport.write(_timeout_response(reading, self._timeout_s))
        self._reading = None
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse (or a head over
        H11_MAX_HEADER_BYTES), in OpenAI's shape."""
        _, body = fmt.error_body("bad_request", msg)
        data = json.dumps(body, separators=(",", ":")).encode()
        for event in (h11.Response(status_code=400, reason=b"Bad Request",
                                   headers=[(b"content-type", b"application/json"),
                                            (b"content-length", b"%d" % len(data)),
                                            (b"connection", b"close")]),
                      h11.Data(data=data), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    # -- the connection limit -------------------------------------------------------------
    async def _admit_or_refuse(self, scope, receive, send) -> None:
        """The ASGI app of this connection's requests."""
        if self._admitted:
            await self._app(scope, receive, send)
        elif scope.get("path") in UNLIMITED_PATHS:
            await self._app(scope, receive, functools.partial(_closing, send))
        else:
            await self._refusal()(scope, receive, send)

    def _refusal(self) -> JSONResponse:
        limit = self._slots.limit
        status, body = fmt.error_body("unavailable", f"too many connections (max_connections="
                                                     f"{limit}); retry later")
        return JSONResponse(body, status_code=status,
                            headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})


async def _closing(send, message) -> None:
    """`send`, with `Connection: close` added to the response's head: a connection past the
    limit is served this one answer, then closed."""
    if message["type"] == "http.response.start":
        message = {**message, "headers": [*message.get("headers", []),
                                          (b"connection", b"close")]}
    await send(message)


def _timeout_response(reading: str, timeout_s: float) -> bytes:
    """A whole HTTP/1.1 408 in OpenAI's shape, written past h11 (no request to answer may
    have been parsed)."""
    _, body = fmt.error_body("bad_request", f"{READING[reading]} was not received within "
                                            f"{timeout_s} s; the connection is closed")
    data = json.dumps(body, separators=(",", ":")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(data)) + data


def _address(client) -> str:
    return "%s:%d" % client if client else "?"


class HttpFront:
    """The HTTP listener of a server (its `Backend`): `await start()` binds, `await close()`
    stops."""

    def __init__(self, backend: Backend, host: str, port: int):
        self.backend, self.host, self.port = backend, host, port
        self._uvicorn = None
        self._task: asyncio.Task | None = None
        self._sockets: list[socket.socket] = []

    async def start(self) -> tuple[str, int]:
        self.api = OpenAIApp(self.backend)
        limits = self.backend.limits
        protocol = functools.partial(
            _BoundedH11, slots=_Slots(limits.max_connections),
            read_timeout_s=min(READ_TIMEOUT_S, limits.idle_timeout_s))
        config = uvicorn.Config(
            self.api.app, lifespan="off", access_log=False, log_level="warning",
            http=protocol,                       # h11 even where httptools is installed
            ws="none",             # an upgrade would hand the connection past the limit's count
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
