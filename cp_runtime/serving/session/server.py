"""The server: asyncio (uvloop in `cp-runtime serve`) over TCP, msgpack frames, one `EngineLoop`.
The OpenAI HTTP door (cp_runtime.serving.http), when attached, runs on the same event loop and
engine, and reaches them only through the operations of cp_runtime.serving.backend.Backend,
which `Server` implements.

Each connection reads frames in order and runs each request as its own task, so a client may
have several requests in flight (on different sessions). Request ids are the client's; the
engine sees (connection, id), so clients never collide. Replies are written as they come; a
connection whose unread replies exceed `max_pending_bytes` is closed (a client that never reads
cannot make the server buffer without bound), and a closed connection cancels its requests.

Security: the server binds loopback unless told otherwise, and `cp-runtime serve` refuses
another address without an auth token. With a token, a connection's first request must be
`hello` carrying it; a wrong token is refused (compared in constant time) and the connection
closed.

A long upload (`Session.extend` past `UPLOAD_CHUNK` tokens) goes in several extends, the first
saying the upload's size (`upload`): the engine admits it whole or refuses it before anything
changes, and an upload whose part fails, or whose connection closes before its last part, is
undone (cp_runtime.engine.core, Uploads): the session is as it was before the upload.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import logging
import socket
import time

import numpy as np

from cp_runtime.engine.core import Engine
from cp_runtime.engine.requests import (Done, Extend, Failed, Generate, Progress, SamplingParams,
                                        Token)
from cp_runtime.serving.backend import OpenedSession, ServedModel, ServerLimits
from cp_runtime.serving.errors import Refused, error_code, session_limit_message
from cp_runtime.serving.session.activity import Activity, RequestRecord
from cp_runtime.serving.session.engine_loop import EngineLoop
from cp_runtime.serving.session.protocol import (OPS, PROTOCOL_VERSION, FrameError,
                                                 ProtocolError, decode_tokens, encode_frame,
                                                 read_frame)
from cp_runtime.serving.state.token_store import TokenStore

__all__ = ["Server"]

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
MAX_MESSAGE_CHARS = 1000          # an error message quoting a request is cut here


class Server:
    """Serves one engine. `start()` binds; `close()` stops accepting, fails what is in flight
    with `unavailable`, and stops the device loop."""

    def __init__(self, engine: Engine, *, model_name: str, tokenizer=None,
                 host: str = "127.0.0.1", port: int = 7777, auth_token: str | None = None,
                 limits: ServerLimits = ServerLimits(), state: TokenStore | None = None,
                 summary_interval_s: float = 60.0, chat_template=None,
                 strict_fields: bool = False):
        """summary_interval_s: seconds between the info summaries of what was served (0: none;
        an interval in which no request finished logs nothing). chat_template: the model's
        (cp_runtime.serving.http.chat_template), for HTTP's chat completions. strict_fields:
        HTTP refuses request fields it does not know (else ignores them, as vLLM does)."""
        self.engine, self.model_name, self.tokenizer = engine, model_name, tokenizer
        self.served = ServedModel(name=model_name, vocab_size=engine.model.vocab_size,
                                  max_model_len=engine.max_model_len, tokenizer=tokenizer,
                                  chat_template=chat_template)
        self.strict_fields = strict_fields
        self.state = state
        self.host, self.port, self.limits = host, port, limits
        self._token = auth_token.encode() if auth_token else None
        self._sinks: dict[tuple, asyncio.Queue] = {}
        self._connections: set[_Connection] = set()
        self._ids = itertools.count()
        self._started = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self.engine_loop = EngineLoop(engine, self._events_from_device)
        self.activity = Activity()
        self.summary_interval_s = summary_interval_s
        self._summaries: asyncio.Task | None = None
        # The OpenAI HTTP door (cp_runtime.serving.http.listener.HttpFront), started and closed
        # with the server; app.build_server attaches it for --http-port. None: no HTTP.
        self.http = None

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> tuple[str, int]:
        """Bind and start the device loop; returns the bound (host, port)."""
        self._loop = asyncio.get_running_loop()
        self.engine_loop.start()
        self._server = await asyncio.start_server(self._accept, self.host, self.port,
                                                  limit=1 << 20)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.port = port
        if self.http is not None:
            await self.http.start()
        if self.summary_interval_s > 0:
            self._summaries = self._loop.create_task(self._log_summaries())
        return host, port

    async def _log_summaries(self) -> None:
        while True:
            await asyncio.sleep(self.summary_interval_s)
            stats = await self.on_engine(lambda e: e.stats())
            line = self.activity.take_summary(self.summary_interval_s, stats)
            if line is not None:
                log.info("%s", line)

    async def close(self) -> None:
        if self._summaries is not None:
            self._summaries.cancel()
        if self._server is not None:
            self._server.close()
        if self.http is not None:
            await self.http.close()
        for conn in list(self._connections):
            conn.abort()
        await asyncio.get_running_loop().run_in_executor(None, self.engine_loop.stop, 30.0)
        await asyncio.sleep(0)                       # let failure events reach their tasks
        if self._server is not None:
            await self._server.wait_closed()

    # -- device thread -> event loop ---------------------------------------------------------
    def _events_from_device(self, events: list) -> None:
        self._loop.call_soon_threadsafe(self.route, events)

    def route(self, events: list) -> None:
        """Hand engine events to the requests waiting for them (on the event loop)."""
        for event in events:
            sink = self._sinks.get(event.request)
            if sink is not None:
                sink.put_nowait(event)

    async def on_engine(self, fn):
        """Run fn(engine) on the device thread and await its result."""
        return await asyncio.wrap_future(self.engine_loop.call(fn))

    async def request_events(self, request):
        """Submit an engine request and yield its events up to its Done; a Failed event
        raises (as the error code it carries). Every front door (the session protocol, HTTP)
        runs requests through here."""
        key = request.id
        sink: asyncio.Queue = asyncio.Queue()
        self._sinks[key] = sink
        try:
            await self.on_engine(lambda e: e.submit(request))
            while True:
                event = await sink.get()
                if isinstance(event, Failed):
                    raise Refused(event.code, event.message)
                yield event
                if isinstance(event, Done):
                    return
        finally:
            self._sinks.pop(key, None)

    async def cancel(self, request_id) -> None:
        """Stop an engine request whose client went away (no event follows)."""
        self._sinks.pop(request_id, None)
        try:
            await asyncio.shield(self.on_engine(lambda e: e.cancel(request_id)))
        except RuntimeError:                         # the engine loop has stopped
            pass

    # -- the HTTP door's operations (cp_runtime.serving.backend.Backend) --------------------
    @property
    def restoring(self) -> int:
        return self.engine_loop.restoring

    async def stats(self) -> dict:
        return await self.on_engine(lambda e: {**e.stats(), "restoring": e.restoring_sessions})

    async def open_session(self, prompt_ids, *, session: str | bool | None,
                           continue_at: int | None, reserve_tokens: int,
                           check_held) -> OpenedSession:
        limit = self.limits.max_sessions

        def open_session(engine: Engine) -> OpenedSession:
            held = 0
            if isinstance(session, str):
                found = engine.get(session)
                held = found.length if continue_at is None else min(continue_at, found.length)
            check_held(held)                         # a prompt that never fits: before all
            if isinstance(session, str) and continue_at is None:
                return OpenedSession(session, lives_on=True)
            if engine.open_sessions >= limit:
                raise Refused("capacity", session_limit_message(limit))
            if isinstance(session, str):
                return OpenedSession(_continue(engine, session, continue_at), lives_on=True)
            opened, cached = engine.open_cached(np.asarray(prompt_ids, np.int32),
                                                reserve_tokens, durable=session is True)
            return OpenedSession(opened.id, lives_on=session is True, cached=cached)

        return await self.on_engine(open_session)

    async def fork_ephemeral(self, session_id: str, count: int) -> list[str]:
        limit = self.limits.max_sessions

        def fork(engine: Engine) -> list[str]:
            if engine.open_sessions + count > limit:
                raise Refused("capacity", session_limit_message(limit))
            made = []
            try:
                for _ in range(count):
                    made.append(engine.fork(session_id, durable=False).id)
            except BaseException:
                for fork in made:
                    engine.close_session(fork)
                raise
            return made

        return await self.on_engine(fork)

    def end_run(self, *, generations, forks, ephemeral: str | None, retain: bool,
                kept: str | None):
        generations, forks = list(generations), list(forks)

        def end(engine: Engine) -> int | None:
            for generation in generations:
                engine.cancel(generation)              # nothing when it is done
            for fork in forks:
                if fork in engine.sessions:
                    engine.close_session(fork)
            if ephemeral is not None and ephemeral in engine.sessions:
                if retain:
                    engine.retain(ephemeral)
                else:
                    engine.close_session(ephemeral)
            if kept is not None and kept in engine.sessions:
                return engine.sessions[kept].length
            return None

        # Shielded: cancelling a wrapped future would cancel the call itself.
        return asyncio.shield(asyncio.wrap_future(self.engine_loop.call(end)))

    async def close_session(self, session_id: str, *, holding: int = 0) -> bool:
        def close(engine: Engine):
            if engine.get(session_id).length < holding:
                return None
            return engine.close_session(session_id)

        events = await self.on_engine(close)
        if events is None:
            return False
        self.route(events)
        return True

    # -- connections ------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(self, reader, writer, next(self._ids))
        sock = writer.get_extra_info("socket")
        if sock is not None:     # the kernel's buffer of unread replies is bounded too
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                            min(self.limits.max_pending_bytes, 1 << 22))
        if len(self._connections) >= self.limits.max_connections:
            conn.send({"id": None, "event": "error", "code": "unavailable",
                       "message": f"too many connections (max_connections="
                                  f"{self.limits.max_connections}); retry later"})
            await conn.finish()
            return
        self._connections.add(conn)
        try:
            await conn.run()
        finally:
            self.release(conn)

    def release(self, conn: "_Connection") -> None:
        """Free a connection's slot. A connection frees it before its socket closes: a client
        that sees the close and connects again at once must find the slot free."""
        self._connections.discard(conn)

    def authorized(self, token) -> bool:
        if self._token is None:
            return True
        given = token.encode() if isinstance(token, str) else b""
        return hmac.compare_digest(given, self._token)

    @property
    def requires_auth(self) -> bool:
        return self._token is not None

    def stats_extra(self) -> dict:
        """Server-side figures; call on the event loop's thread (its CPU time is measured)."""
        return {"connections": len(self._connections),
                "uptime_s": time.monotonic() - self._started,
                "server_cpu_s": time.thread_time()}


class _Connection:
    """One client: reads frames, runs each request as a task, writes replies."""

    def __init__(self, server: Server, reader, writer, number: int):
        self.server, self.reader, self.writer, self.number = server, reader, writer, number
        self.authorized = not server.requires_auth
        self.tasks: dict[object, asyncio.Task] = {}
        self.tokens_of: dict[object, int] = {}     # request id -> tokens uploaded or generated
        self.closed = False
        self.last_frame = time.monotonic()
        self.owner = ("connection", number)        # the owner of the uploads it begins
        self.uploads: set[str] = set()             # sessions it began an upload into

    def send(self, message: dict) -> None:
        if self.closed:
            return
        self.writer.write(encode_frame(message))
        if self.writer.transport.get_write_buffer_size() > self.server.limits.max_pending_bytes:
            log.warning("connection %d: client is not reading; closing it", self.number)
            self.abort()

    def abort(self) -> None:
        """Drop the connection now; its requests are cancelled."""
        if not self.closed:
            self.closed = True
            self.server.release(self)
            self.writer.transport.abort()
        for task in self.tasks.values():
            task.cancel()

    async def finish(self) -> None:
        """Flush what is buffered (for at most FLUSH_TIMEOUT_S: a client that does not read
        cannot hold the connection) and close."""
        self.closed = True
        self.server.release(self)
        try:
            await asyncio.wait_for(self.writer.drain(), FLUSH_TIMEOUT_S)
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), FLUSH_TIMEOUT_S)
        except (ConnectionError, OSError, asyncio.TimeoutError):
            self.writer.transport.abort()

    async def _close_when_idle(self) -> None:
        """Close the connection once it has had nothing in flight and sent no frame for
        `idle_timeout_s` (a client that connects and goes quiet must not hold a slot)."""
        timeout = self.server.limits.idle_timeout_s
        while not self.closed:
            await asyncio.sleep(min(timeout, 1.0))
            if not self.tasks and time.monotonic() - self.last_frame > timeout:
                log.info("connection %d: idle for %d s; closing it", self.number, timeout)
                self.abort()

    async def run(self) -> None:
        watchdog = asyncio.get_running_loop().create_task(self._close_when_idle())
        try:
            while not self.closed:
                try:
                    message = await read_frame(self.reader, self.server.limits.max_frame_bytes)
                    self.last_frame = time.monotonic()
                except ProtocolError as e:
                    self.last_frame = time.monotonic()
                    self.send({"id": None, "event": "error", "code": "bad_request",
                               "message": str(e)})
                    continue
                if message is None:
                    break
                self._start(message)
        except FrameError as e:
            self.send({"id": None, "event": "error", "code": "bad_request", "message": str(e)})
        except (ConnectionError, OSError):
            pass
        finally:
            watchdog.cancel()
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            await self._abort_uploads()
            await self.finish()

    async def _abort_uploads(self) -> None:
        """Undo the uploads this connection began and did not finish (all or nothing)."""
        if not self.uploads:
            return
        self.uploads.clear()
        try:
            self.server.route(await self.server.on_engine(
                lambda e: e.abort_uploads(self.owner)))
        except Exception:                            # noqa: BLE001 - the engine has stopped
            log.warning("connection %d: could not undo its open uploads", self.number)

    def _start(self, message: dict) -> None:
        rid = message.get("id")
        if not isinstance(rid, (int, str)) or isinstance(rid, bool):
            self.send({"id": None, "event": "error", "code": "bad_request",
                       "message": f"request needs an integer or string 'id', got {rid!r:.100}"})
            return
        if rid in self.tasks:
            self._error(rid, "bad_request", f"request id {rid!r} is already in flight")
            return
        self.tasks[rid] = asyncio.get_running_loop().create_task(self._serve(rid, message))

    def _error(self, rid, code: str, message: str) -> None:
        if len(message) > MAX_MESSAGE_CHARS:         # messages may quote the request
            message = message[:MAX_MESSAGE_CHARS] + "... (truncated)"
        self.send({"id": rid, "event": "error", "code": code, "message": message})

    async def _serve(self, rid, message: dict) -> None:
        t0, outcome = time.perf_counter(), "ok"
        try:
            op = message.get("op")
            if op not in OPS:
                raise Refused("bad_request", f"unknown op {op!r}; ops: {', '.join(OPS)}")
            if not self.authorized and op != "hello":
                raise Refused("unauthorized", "authenticate first: send hello with a token")
            handler = getattr(_Handlers, op)
            await handler(self, rid, message)
        except asyncio.CancelledError:
            # An accepted extend's tokens are in the session's log already: it runs on without
            # its client (cancelling it would leave the log ahead of the cache).
            outcome = "cancelled"
            await self._cancel(rid, in_engine=message.get("op") != "extend")
        except Exception as e:                       # noqa: BLE001 - answered, never fatal
            code = outcome = error_code(e)
            if code == "internal":
                log.exception("request %r failed", rid)
            self._error(rid, code, str(e))
            if code == "unauthorized" and message.get("op") == "hello":
                self.abort()
        finally:
            self.tasks.pop(rid, None)
            self._record(rid, message, outcome, (time.perf_counter() - t0) * 1e3)

    def _record(self, rid, message: dict, outcome: str, ms: float) -> None:
        session = message.get("session")
        self.server.activity.record(RequestRecord(
            connection=self.number, request=rid, op=str(message.get("op"))[:32],
            session=session[:64] if isinstance(session, str) else None,   # a client's text
            tokens=self.tokens_of.pop(rid, 0), ms=ms, outcome=outcome))

    async def _cancel(self, rid, in_engine: bool = True) -> None:
        key = (self.number, rid)
        if in_engine:
            await self.server.cancel(key)
        else:
            self.server._sinks.pop(key, None)

    async def stream(self, rid, request) -> dict:
        """Submit an engine request and forward its events; returns its Done info."""
        async for event in self.server.request_events(request):
            if isinstance(event, Progress):
                self.send({"id": rid, "event": "progress", "done": event.done,
                           "total": event.total})
            elif isinstance(event, Token):
                self.tokens_of[rid] = self.tokens_of.get(rid, 0) + 1
                self.send(self._token_event(rid, request, event))
            elif isinstance(event, Done):
                return event.info

    @staticmethod
    def _token_event(rid, request, event: Token) -> dict:
        out = {"id": rid, "event": "token", "token": event.token, "index": event.index}
        if request.sampling.logprobs:
            out["logprob"] = event.logprob
        if request.sampling.top_logprobs:
            out["top_logprobs"] = [list(pair) for pair in event.top]
        return out

    def done(self, rid, **fields) -> None:
        self.send({**fields, "id": rid, "event": "done"})


def _session_field(message: dict) -> str:
    session = message.get("session")
    if not isinstance(session, str):
        raise Refused("bad_request", f"'session' must be a session id string, got {session!r}")
    return session


class _Handlers:
    """One coroutine per op: (connection, request id, message)."""

    @staticmethod
    async def hello(conn: _Connection, rid, message: dict) -> None:
        if not conn.server.authorized(message.get("token")):
            raise Refused("unauthorized", "wrong or missing token")
        conn.authorized = True
        server, engine = conn.server, conn.server.engine
        rt = engine.runtime
        conn.done(rid, version=PROTOCOL_VERSION, model=server.model_name,
                  vocab_size=engine.model.vocab_size, text=server.tokenizer is not None,
                  shards=rt.num_shards, page_size=rt.page_size,
                  pages_per_shard=rt.pages_per_shard, kv_cache_dtype=rt.kv_cache_dtype,
                  capacity_tokens=rt.num_shards * rt.pages_per_shard * rt.page_size,
                  max_model_len=engine.max_model_len,
                  limits=dataclasses.asdict(server.limits))

    @staticmethod
    async def create(conn: _Connection, rid, message: dict) -> None:
        limit = conn.server.limits.max_sessions

        def create(engine: Engine):
            if engine.open_sessions >= limit:
                raise Refused("capacity", session_limit_message(limit))
            return engine.create_session().id

        conn.done(rid, session=await conn.server.on_engine(create))

    @staticmethod
    async def extend(conn: _Connection, rid, message: dict) -> None:
        session = _session_field(message)
        upload = message.get("upload")
        try:
            if upload is not None and (not isinstance(upload, int) or isinstance(upload, bool)
                                       or upload < 1):
                raise Refused("bad_request", f"'upload' must be the upload's tokens in all, a "
                                             f"positive integer, got {upload!r:.100}")
            if "text" in message:
                tokens = _encode_text(conn.server.tokenizer, message["text"])
            else:
                tokens = decode_tokens(message.get("tokens"))
            limit = conn.server.limits.max_tokens_per_request
            if len(tokens) > limit:
                raise Refused("bad_request", f"{len(tokens)} tokens in one extend exceed "
                                              f"max_tokens_per_request={limit}; send them in "
                                              "parts")
            conn.tokens_of[rid] = len(tokens)
            if upload is not None:
                conn.uploads.add(session)
            info = await conn.stream(rid, Extend(id=(conn.number, rid), session=session,
                                                 tokens=tokens, upload=conn.owner,
                                                 upload_total=upload))
        except Exception as e:                       # noqa: BLE001 - raised again below
            if session not in conn.uploads:
                raise
            # A part of this connection's upload failed: the whole upload is undone.
            events, length = await conn.server.on_engine(
                lambda engine: engine.abort_upload(session, conn.owner))
            conn.server.route(events)
            if length is None:
                raise
            raise Refused(error_code(e), f"{e}; the upload was undone: session {session} "
                                         f"holds its {length:,} tokens as before") from e
        conn.done(rid, **info)

    @staticmethod
    async def abort(conn: _Connection, rid, message: dict) -> None:
        """Undo this connection's open upload into the session (a client that gives up)."""
        session = _session_field(message)

        def abort(engine: Engine):
            engine.get(session)                      # NotFound for no such session
            events, length = engine.abort_upload(session, conn.owner)
            return events, length, engine.get(session).length
        events, undone, length = await conn.server.on_engine(abort)
        conn.server.route(events)
        conn.uploads.discard(session)
        conn.done(rid, length=length, aborted=undone is not None)

    @staticmethod
    async def generate(conn: _Connection, rid, message: dict) -> None:
        session = _session_field(message)
        try:
            sampling = SamplingParams(**{k: message[k] for k in SAMPLING_FIELDS if k in message})
        except TypeError as e:
            raise Refused("bad_request", str(e)) from None
        request = Generate(id=(conn.number, rid), session=session, sampling=sampling)
        info = await conn.stream(rid, request)
        tokenizer = conn.server.tokenizer
        if tokenizer is not None:
            generated = await conn.server.on_engine(
                lambda e: e.get(session).tokens[-info["tokens"]:])
            info = {**info, "text": tokenizer.decode(generated)}
        conn.done(rid, **info)

    @staticmethod
    async def fork(conn: _Connection, rid, message: dict) -> None:
        session = _session_field(message)
        limit = conn.server.limits.max_sessions

        def fork(engine: Engine):
            if engine.open_sessions >= limit:
                raise Refused("capacity", session_limit_message(limit))
            return engine.fork(session).id

        conn.done(rid, session=await conn.server.on_engine(fork))

    @staticmethod
    async def info(conn: _Connection, rid, message: dict) -> None:
        session = _session_field(message)
        conn.done(rid, **await conn.server.on_engine(lambda e: e.info(session)))

    @staticmethod
    async def close(conn: _Connection, rid, message: dict) -> None:
        session = _session_field(message)
        events = await conn.server.on_engine(lambda e: e.close_session(session))
        conn.server.route(events)
        conn.done(rid)

    @staticmethod
    async def snapshot(conn: _Connection, rid, message: dict) -> None:
        session = _session_field(message)
        store = conn.server.state
        if store is None:
            raise Refused("bad_request", "this server keeps no state: start it with "
                                          "--state-dir to take snapshots")
        tokens, rows = await conn.server.on_engine(lambda e: e.export_session(session))
        rt = conn.server.engine.runtime
        meta = {"model": conn.server.engine.model.name, "kv_cache_dtype": rt.kv_cache_dtype}
        path = await asyncio.get_running_loop().run_in_executor(
            None, store.write_snapshot, session, tokens, rows, meta)
        conn.done(rid, path=str(path), length=len(tokens), cached=rows.num_tokens)

    @staticmethod
    async def sessions(conn: _Connection, rid, message: dict) -> None:
        store = conn.server.state
        damaged = store.damaged if store is not None else {}

        def listing(engine: Engine):
            return [{"session": s.id, "length": s.length, "restoring": engine._restoring(s),
                     **({"damaged": damaged[s.id]["reason"]} if s.id in damaged else {})}
                    for s in engine.sessions.values() if s.durable]

        conn.done(rid, sessions=await conn.server.on_engine(listing),
                  unrestored=list(store.unrestored) if store is not None else [])

    @staticmethod
    async def stats(conn: _Connection, rid, message: dict) -> None:
        stats = await conn.server.on_engine(lambda e: e.stats())
        conn.done(rid, **stats, **conn.server.stats_extra())


def _encode_text(tokenizer, text) -> list[int]:
    if tokenizer is None:
        raise Refused("bad_request", "this model has no tokenizer: send token ids")
    if not isinstance(text, str):
        raise Refused("bad_request", f"'text' must be a string, got {type(text).__name__}")
    return tokenizer.encode(text)


def _continue(engine: Engine, session_id: str, length: int) -> str:
    """The session a run continuing `session_id` from `length` tokens goes on in: the session
    itself when nothing moved it on since, else a fork at that length."""
    session = engine.get(session_id)
    if length > session.length:
        raise LookupError(f"no response at {length} tokens of session {session_id}")
    if length == session.length and session.busy is None:
        return session_id                       # nothing moved it on: go on in place
    return engine.fork(session_id, length).id
