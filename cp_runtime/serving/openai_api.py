"""The OpenAI-compatible HTTP front door (`cp-runtime serve --http-port PORT`): a Starlette app
on the same `Server`, so the same engine, device loop, auth token and limits as the session
protocol (docs/http.md).

    GET  /v1/models            the served model
    POST /v1/completions       prompt (text or token ids) -> completion; `stream` as
                               server-sent events ending in `data: [DONE]`
    POST /v1/chat/completions  messages, rendered with the checkpoint's chat template
    POST /v1/responses         a stored response that lives on as a session;
                               `previous_response_id` continues it (openai_responses)
    DELETE /v1/responses/{id}  closes the session a stored response lives in
    POST /tokenize             text -> token ids
    POST /detokenize           token ids -> text
    GET  /health               200 while serving, 503 while sessions are being restored
    GET  /metrics              Prometheus exposition (cp_runtime.serving.metrics)

A stateless completion runs in an ephemeral session of its own: a fork of the live session
holding the longest cached prefix of its prompt (cp_runtime.engine.prefix_cache), extended with
the rest, generated from, and kept afterwards as a prefix-cache entry; a client that goes away
mid-request cancels it, and its session is closed, its pages back at once.
Errors have OpenAI's shape, `{"error": {"message", "type", "code", "param"}}`, with the
session protocol's codes mapped to HTTP statuses (openai_format.ERROR_STATUS); a retryable one
(RETRYABLE_CODES: what waiting can fix) carries `Retry-After`. A request that can never fit
(the session's tokens, the prompt and `max_tokens` past `max_model_len`) is 400
`context_length_exceeded` in vLLM's words, naming both numbers. With an auth token, every
endpoint but /health and /metrics needs `Authorization: Bearer TOKEN` (probes and scrapers
need none).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cp_runtime.engine.requests import BadRequest, Done, Extend, Generate
from cp_runtime.serving import openai_format as fmt
from cp_runtime.serving import openai_responses as resp
from cp_runtime.serving.errors import Refused, error_code, session_limit_message
from cp_runtime.serving.metrics import Metrics
from cp_runtime.serving.protocol import RETRYABLE_CODES

if TYPE_CHECKING:                       # the server starts this app: a type, not an import
    from cp_runtime.serving.server import Server

__all__ = ["OpenAIApp"]

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


class _HttpError(Exception):
    def __init__(self, code: str, message: str, status: int | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.code, self.status, self.param = code, status, param


def _endpoint(name: str, *, auth: bool = True):
    """Wrap a handler: auth, errors in OpenAI's shape, and the request counter."""

    def wrap(handler):
        @functools.wraps(handler)
        async def run(self: "OpenAIApp", request: Request) -> Response:
            try:
                if auth:
                    self._check_auth(request)
                response = await handler(self, request)
            except Exception as e:               # noqa: BLE001 - answered, never fatal
                response = self._error_response(e)
            self.metrics.requests.labels(name, str(response.status_code)).inc()
            return response
        return run
    return wrap


class OpenAIApp:
    """`.app` is the ASGI app serving `server`'s engine over HTTP."""

    def __init__(self, server: Server):
        self.server = server
        self.metrics = Metrics()
        self._ids = itertools.count()
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{rid}", self.delete_response, methods=["DELETE"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ])

    # -- plumbing ---------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if not self.server.requires_auth:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not self.server.authorized(token.strip()):
            raise _HttpError("unauthorized", "wrong or missing token: send "
                                             "'Authorization: Bearer TOKEN'")

    def _served(self) -> dict:
        """What every request parser checks a body against: the served model's name, its
        tokenizer (None without a checkpoint) and vocabulary size."""
        return {"model": self.server.model_name, "tokenizer": self.server.tokenizer,
                "vocab_size": self.server.engine.model.vocab_size}

    async def _json(self, request: Request):
        limit = self.server.limits.max_frame_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise _HttpError("bad_request", f"a body of {declared} bytes exceeds "
                                            f"max_frame_bytes={limit}", status=413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _HttpError("bad_request", f"the body exceeds max_frame_bytes={limit}",
                                 status=413)
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise _HttpError("bad_request", f"the body is not valid JSON ({e})") from None

    def _error_response(self, e: Exception) -> Response:
        param = None
        if isinstance(e, _HttpError):
            code, status, param = e.code, e.status, e.param
        elif isinstance(e, LookupError):
            code, status = "not_found", None
        elif isinstance(e, ClientDisconnect):
            code, status = "bad_request", None
        else:
            code, status = error_code(e), None
        message = str(e)
        if code == "internal":
            log.error("HTTP request failed", exc_info=e)
            message = f"internal error ({type(e).__name__}); see the server's log"
        default_status, body = fmt.error_body(code, message, param)
        # What waiting can fix: pages held by other sessions, a full queue, a rebuild.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if code in RETRYABLE_CODES else None
        return JSONResponse(body, status_code=status or default_status, headers=headers)

    # -- endpoints --------------------------------------------------------------------------
    @_endpoint("models")
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.server.model_name, "object": "model", "created": 0,
            "owned_by": "cp-runtime", "max_model_len": self.server.engine.max_model_len}]})

    @_endpoint("tokenize")
    async def tokenize(self, request: Request) -> Response:
        body = await self._json(request)
        tokenizer = self._tokenizer()
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str):
            raise BadRequest("/tokenize needs 'prompt', a string")
        ids = tokenizer.encode(prompt)
        return JSONResponse({"tokens": ids, "count": len(ids)})

    @_endpoint("detokenize")
    async def detokenize(self, request: Request) -> Response:
        body = await self._json(request)
        tokenizer = self._tokenizer()
        ids = body.get("tokens") if isinstance(body, dict) else None
        vocab = self.server.engine.model.vocab_size
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              and 0 <= t < vocab for t in ids)):
            raise BadRequest(f"/detokenize needs 'tokens', a list of ids in [0, {vocab})")
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    def _tokenizer(self):
        if self.server.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send and read token ids")
        return self.server.tokenizer

    @_endpoint("health", auth=False)
    async def health(self, request: Request) -> Response:
        """Read from what the device loop publishes after each step: a probe never waits for a
        step (seconds for a long prefill chunk, minutes for a first compile)."""
        restoring = self.server.engine_loop.restoring
        if restoring:
            return JSONResponse({"status": "restoring", "sessions_restoring": restoring},
                                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ok"})

    @_endpoint("metrics", auth=False)
    async def metrics_text(self, request: Request) -> Response:
        def stats(engine):
            return {**engine.stats(), "restoring": engine.restoring_sessions}

        text = self.metrics.render(await self.server.on_engine(stats))
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @_endpoint("completions")
    async def completions(self, request: Request) -> Response:
        received = time.perf_counter()
        req = fmt.parse_completion(await self._json(request), **self._served())
        return await self._respond(req, received, COMPLETION)

    @_endpoint("chat")
    async def chat(self, request: Request) -> Response:
        received = time.perf_counter()
        req = fmt.parse_chat(await self._json(request), **self._served(),
                             template=self.server.chat_template)
        return await self._respond(req, received, CHAT)

    @_endpoint("responses")
    async def responses(self, request: Request) -> Response:
        received = time.perf_counter()
        req = resp.parse_response(await self._json(request), **self._served(),
                                  template=self.server.chat_template)
        self._check_prompt(req.completion)
        run = _Completion(self, req.completion, received)
        first = await run.start()
        head = {"model": self.server.model_name, "created": fmt.now(), "req": req}
        item_id = fmt.new_id("msg")
        if req.completion.stream:
            return _Stream(self._response_events(run, first, head, item_id))
        text, ids, finish = "", [], None
        async with contextlib.aclosing(run.pieces(first)) as pieces:
            async for piece in pieces:
                text, ids = text + piece.text, ids + piece.ids
                finish = piece.finish_reason or finish
        return JSONResponse(self._response(run, head, item_id, text, ids, finish))

    def _response(self, run: "_Completion", head: dict, item_id: str, text: str,
                  ids: list[int], finish: str | None) -> dict:
        """The finished response object: stored, its id names its session's end."""
        stored = run.kept is not None and run.length is not None
        rid = resp.response_id(run.kept, run.length) if stored else fmt.new_id("resp")
        return resp.response_object(
            rid=rid, **head, text=text, finish_reason=finish, usage_=run.usage(),
            item_id=item_id, token_ids=ids if run.req.return_token_ids else None,
            session=run.kept if stored else None)

    async def _response_events(self, run: "_Completion", first, head: dict, item_id: str):
        """Server-sent events of a streamed response (`event:` lines name each type)."""
        stream = resp.ResponseStream(item_id)
        start = resp.response_object(rid=fmt.new_id("resp"), **head, status="in_progress")
        for event in stream.opening(start):
            yield _sse_event(event)
        ids, finish = [], None
        async with contextlib.aclosing(run.pieces(first)) as pieces:
            async for piece in pieces:
                ids += piece.ids
                finish = piece.finish_reason or finish
                if piece.text or piece.ids:
                    yield _sse_event(stream.delta(
                        piece.text, piece.ids if run.req.return_token_ids else None))
        final = self._response(run, head, item_id, stream.text, ids, finish)
        for event in stream.closing(final):
            yield _sse_event(event)

    @_endpoint("responses")
    async def delete_response(self, request: Request) -> Response:
        """Close the session a stored response lives in (and so every response continued
        in place from it)."""
        rid = request.path_params["rid"]
        session, length = resp.parse_id(rid)

        def close(engine):
            if engine.get(session).length < length:
                raise LookupError(f"no response {rid!r}")
            return engine.close_session(session)
        self.server.route(await self.server.on_engine(close))
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    def _check_prompt(self, req: fmt.CompletionRequest) -> None:
        limit = self.server.limits.max_tokens_per_request
        if len(req.prompt_ids) > limit:
            raise BadRequest(f"a prompt of {len(req.prompt_ids)} tokens exceeds "
                             f"max_tokens_per_request={limit}")

    async def _respond(self, req: fmt.CompletionRequest, received: float,
                       shape: "_Shape") -> Response:
        self._check_prompt(req)
        head = {"rid": fmt.new_id(shape.prefix), "model": self.server.model_name,
                "created": fmt.now()}
        run = _Completion(self, req, received)
        first = await run.start()                # errors before any token are plain HTTP
        if req.stream:
            return _Stream(self._events(run, first, head, shape))
        text, ids, logprobs, finish = "", [], [], None
        async with contextlib.aclosing(run.pieces(first)) as pieces:
            async for piece in pieces:
                text += piece.text
                ids += piece.ids
                logprobs += piece.logprobs
                finish = piece.finish_reason or finish
        return JSONResponse(run.tagged(shape.whole(
            **head, text=text, finish_reason=finish, usage_=run.usage(),
            token_ids=ids if req.return_token_ids else None,
            prompt_ids=req.prompt_ids if req.return_token_ids else None,
            logprobs=shape.logprobs(run.token_texts(ids), logprobs, 0) if req.logprobs
            else None)))

    async def _events(self, run: "_Completion", first, head: dict, shape: "_Shape"):
        """Server-sent events of a streamed completion."""
        req, offset, opening = run.req, 0, True
        async with contextlib.aclosing(run.pieces(first)) as pieces:
            async for piece in pieces:
                chunk = shape.chunk(
                    **head, text=piece.text, finish_reason=piece.finish_reason,
                    token_ids=piece.ids if req.return_token_ids else None,
                    logprobs=(shape.logprobs(run.token_texts(piece.ids), piece.logprobs,
                                             offset) if req.logprobs else None),
                    prompt_ids=req.prompt_ids if req.return_token_ids and opening else None,
                    **shape.first(opening))
                if opening:
                    chunk = run.tagged(chunk)
                offset, opening = offset + len(piece.text), False
                yield _sse(chunk)
        if req.include_usage:
            yield _sse(shape.chunk(**head, usage_=run.usage()))
        yield b"data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True)
class _Shape:
    """How one endpoint shapes its answers (OpenAI's completion or chat objects)."""

    prefix: str
    whole: Callable[..., dict]
    chunk: Callable[..., dict]
    logprobs: Callable[[list[str], list[float], int], dict]
    first: Callable[[bool], dict]            # extra fields of the first streamed chunk


COMPLETION = _Shape("cmpl", fmt.completion_object, fmt.completion_chunk, fmt.logprobs_object,
                    lambda first: {})
CHAT = _Shape("chatcmpl", fmt.chat_object, fmt.chat_chunk,
              lambda texts, lps, offset: fmt.chat_logprobs(texts, lps),
              lambda first: {"role": first})


class _Stream(StreamingResponse):
    """Server-sent events whose generator is closed when the response ends, however it ends.
    Starlette ends the stream of a client that left by cancelling it (ASGI 2.3's disconnect
    message) or, under ASGI 2.4, at a failed send, after which it drops the generator
    unclosed; closing it here ends the generation and returns its pages at once, not
    whenever the generator is collected."""

    def __init__(self, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _sse_event(obj: dict) -> bytes:
    return b"event: " + obj["type"].encode() + b"\n" + _sse(obj)


class _Piece:
    """Generated text released to the client: its token ids, their logprobs, and the finish
    reason on the last piece."""

    def __init__(self, text: str, ids: list[int], logprobs: list[float],
                 finish_reason: str | None = None):
        self.text, self.ids, self.logprobs = text, ids, logprobs
        self.finish_reason = finish_reason


class _Completion:
    """One completion (or response): open its session, prefill what of the prompt it does not
    hold, stream the generation, release text up to stop strings, and at the end keep or close
    its session (`close`), whatever happens."""

    def __init__(self, front: OpenAIApp, req: fmt.CompletionRequest, received: float):
        self.front, self.server, self.req = front, front.server, req
        self.received = received
        self.key = ("http", next(front._ids))
        self.session: str | None = None         # an ephemeral session (prefix cache)
        self.kept: str | None = None            # a session that lives on
        self.cached = 0                         # prompt tokens it held already
        self.finished = False                   # ran to its end (its session may stay)
        self.length: int | None = None          # the kept session's length at the end
        self.generated: list[int] = []
        self.released = 0                       # characters of the text sent so far
        self.tokenizer = self.server.tokenizer
        stops = req.stop_strings
        self.hold = max((len(s) for s in stops), default=1) - 1

    async def start(self):
        """Open the session (below), prefill what of the prompt it does not hold, and wait
        for the first generated token (or the end); errors up to here are raised, not
        streamed."""
        target = await self.server.on_engine(self._open)
        try:
            rest = np.asarray(self.req.prompt_ids[self.cached:], np.int32)
            if len(rest):
                async for _ in self.server.request_events(
                        Extend(id=self.key + ("prompt",), session=target, tokens=rest)):
                    pass
            self.front.metrics.prompt_tokens.inc(len(self.req.prompt_ids))
            self.front.metrics.cached_tokens.inc(self.cached)
            self.events = self.server.request_events(Generate(
                id=self.key + ("generate",), session=target, sampling=self.req.sampling))
            return await self.events.__anext__()
        except BaseException:
            await self.close()
            raise

    def _open(self, engine) -> str:
        """On the engine's thread: the session to run in. A new one forks the live session
        holding the longest cached prefix of its prompt (or starts empty): a stateless
        request's is ephemeral and kept afterwards as a prefix-cache entry, `session: true`'s
        lives on. A session id continues that session, from `continue_at` in a fork when it
        has moved on since."""
        named, at = self.req.session, self.req.continue_at
        held = 0
        if isinstance(named, str):
            session = engine.get(named)
            held = session.length if at is None else min(at, session.length)
        too_long = fmt.context_length_error(self.req, engine.max_model_len, held)
        if too_long is not None:                     # never fits: no wait can help
            raise _HttpError("context_length_exceeded", too_long[0], param=too_long[1])
        if isinstance(named, str) and at is None:
            self.kept = named
            return named
        limit = self.server.limits.max_sessions
        if engine.open_sessions >= limit:
            raise Refused("capacity", session_limit_message(limit))
        if isinstance(named, str):
            self.kept = self._continue(engine, named, at)
            return self.kept
        tokens = len(self.req.prompt_ids) + self.req.sampling.max_tokens
        session, self.cached = engine.open_cached(np.asarray(self.req.prompt_ids, np.int32),
                                                  tokens, durable=named is True)
        if named is True:
            self.kept = session.id
        else:
            self.session = session.id
        return session.id

    @staticmethod
    def _continue(engine, session_id: str, length: int) -> str:
        session = engine.get(session_id)
        if length > session.length:
            raise LookupError(f"no response at {length} tokens of session {session_id}")
        if length == session.length and session.busy is None:
            return session_id                       # nothing moved it on: go on in place
        return engine.fork(session_id, length).id

    async def pieces(self, first):
        """The generation as _Pieces of released text, from its first event."""
        try:
            event, last = first, None
            while True:
                if isinstance(event, Done):
                    tail, stopped = self._release(final=True)
                    self.finished = True
                    yield _Piece(tail, [], [], "stop" if stopped else
                                 event.info["finish_reason"])
                    return
                now = time.perf_counter()
                if last is None:
                    self.front.metrics.ttft.observe(now - self.received)
                else:
                    self.front.metrics.itl.observe(now - last)
                last = now
                self.generated.append(event.token)
                self.front.metrics.generated_tokens.inc()
                text, stopped = self._release()
                self.finished = stopped
                yield _Piece(text, [event.token], [event.logprob], "stop" if stopped else None)
                if stopped:
                    return
                event = await self.events.__anext__()
        finally:
            await self.close()

    def _text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.generated)

    def _release(self, final: bool = False) -> tuple[str, bool]:
        """Text that can go to the client now, and whether a stop string ended it: unless
        `final`, a tail that may be the start of a stop string, or of a character still being
        decoded, waits."""
        text = self._text()
        for stop in self.req.stop_strings:
            at = text.find(stop, max(0, self.released - len(stop) + 1))
            if at >= 0:
                out, self.released = text[self.released: at], at
                return out, True
        safe = len(text) - (0 if final else self.hold)
        while not final and safe > self.released and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.released:
            return "", False
        out, self.released = text[self.released: safe], safe
        return out, False

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (its id as text for a model without a tokenizer)."""
        if self.tokenizer is None:
            return [str(t) for t in ids]
        return [self.tokenizer.decode([t]) for t in ids]

    def tagged(self, answer: dict) -> dict:
        """`answer` with the extension field `session` when the session lives on."""
        return {**answer, "session": self.kept} if self.kept is not None else answer

    def usage(self) -> dict:
        return fmt.usage(len(self.req.prompt_ids), len(self.generated), self.cached)

    async def close(self) -> None:
        """End the generation if it still runs; keep the ephemeral session of a request that
        ran to its end as a prefix-cache entry, or close it (a client that left: its queued
        work ends, its pages go back); a kept session stays, idle, and its length is read.
        The engine's part is handed over before anything is awaited, and shielded: a client
        that left cancels every await here (Starlette's cancel scope), and cancelling a
        wrapped future would cancel the call itself."""
        events, self.events = getattr(self, "events", None), None
        session, self.session = self.session, None
        keep, generation, kept = self.finished, self.key + ("generate",), self.kept

        def end(engine):
            engine.cancel(generation)                  # nothing when it is done
            if session is not None and session in engine.sessions:
                if keep:
                    engine.retain(session)
                else:
                    engine.close_session(session)
            if kept is not None and kept in engine.sessions:
                return engine.sessions[kept].length
        ended = asyncio.shield(asyncio.wrap_future(self.server.engine_loop.call(end)))
        if events is not None:
            with contextlib.suppress(RuntimeError):     # already running: it ends with us
                await events.aclose()
        with contextlib.suppress(Exception):
            self.length = await ended
