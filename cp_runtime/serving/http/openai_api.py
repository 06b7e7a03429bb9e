"""The OpenAI-compatible HTTP front door (`cp-runtime serve --http-port PORT`): a Starlette app
on the same server, so the same engine, device loop, auth token and limits as the session
protocol (docs/http.md), reached through the server's small interface
(cp_runtime.serving.backend.Backend), never its engine.

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
    GET  /metrics              Prometheus exposition (cp_runtime.serving.http.metrics)

A stateless completion runs in an ephemeral session of its own: a fork of the live session
holding the longest cached prefix of its prompt (cp_runtime.engine.prefix_cache), extended with
the rest, generated from, and kept afterwards as a prefix-cache entry; a client that goes away
mid-request cancels it, and its session is closed, its pages back at once. With `n` > 1 the
prompt is prefilled once: choice 0 generates in that session and each other choice in a fork
of it (sharing its pages), with seed + i when a seed is given; the forks are closed at the end.
The model's end-of-sequence token (`eos_ids`) ends a generation unless `ignore_eos`; the text
of a stop id (it, or one of `stop_token_ids`) is left out of the text, as vLLM leaves it out,
and stays in `token_ids`.
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
from typing import Callable

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cp_runtime.engine.requests import BadRequest, Done, Extend, Generate, Token
from cp_runtime.serving.backend import Backend
from cp_runtime.serving.errors import error_code
from cp_runtime.serving.http import openai_format as fmt
from cp_runtime.serving.http import openai_responses as resp
from cp_runtime.serving.http.metrics import Metrics
from cp_runtime.serving.session.protocol import RETRYABLE_CODES

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


def eos_ids(tokenizer, template) -> tuple[int, ...]:
    """The model's end-of-sequence ids: its tokenizer's `eos_token_id` where it has one, else
    the id of the EOS token text the chat template was read with (tokenizer_config.json's
    `eos_token`); () when neither is known."""
    if tokenizer is None:
        return ()
    known = getattr(tokenizer, "eos_token_id", None)
    if isinstance(known, int) and not isinstance(known, bool):
        return (known,)
    text = getattr(template, "eos_token", "") or ""
    if not text:
        return ()
    inner = getattr(tokenizer, "tokenizer", None)
    found = inner.token_to_id(text) if hasattr(inner, "token_to_id") else None
    if found is None:
        ids = tokenizer.encode(text)
        found = ids[0] if len(ids) == 1 else None
    return () if found is None else (int(found),)


class OpenAIApp:
    """`.app` is the ASGI app serving `backend`'s engine over HTTP. With the server's
    `strict_fields`, a body naming a field no endpoint knows is refused (400) rather than
    ignored."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.metrics = Metrics()
        self.strict = bool(backend.strict_fields)
        self.eos = eos_ids(backend.served.tokenizer, backend.served.chat_template)
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
        if not self.backend.requires_auth:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not self.backend.authorized(token.strip()):
            raise _HttpError("unauthorized", "wrong or missing token: send "
                                             "'Authorization: Bearer TOKEN'")

    def _served(self) -> dict:
        """What every request parser checks a body against: the served model's name, its
        tokenizer (None without a checkpoint), vocabulary size and EOS ids, and whether
        unknown fields are refused."""
        served = self.backend.served
        return {"model": served.name, "tokenizer": served.tokenizer,
                "vocab_size": served.vocab_size, "strict": self.strict,
                "eos": self.eos}

    async def _json(self, request: Request):
        limit = self.backend.limits.max_frame_bytes
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
        param = getattr(e, "param", None)
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
            "id": self.backend.served.name, "object": "model", "created": 0,
            "owned_by": "cp-runtime", "max_model_len": self.backend.served.max_model_len}]})

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
        vocab = self.backend.served.vocab_size
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                              and 0 <= t < vocab for t in ids)):
            raise BadRequest(f"/detokenize needs 'tokens', a list of ids in [0, {vocab})")
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    def _tokenizer(self):
        tokenizer = self.backend.served.tokenizer
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: send and read token ids")
        return tokenizer

    @_endpoint("health", auth=False)
    async def health(self, request: Request) -> Response:
        """Read from what the device loop publishes after each step: a probe never waits for a
        step (seconds for a long prefill chunk, minutes for a first compile)."""
        restoring = self.backend.restoring
        if restoring:
            return JSONResponse({"status": "restoring", "sessions_restoring": restoring},
                                status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ok"})

    @_endpoint("metrics", auth=False)
    async def metrics_text(self, request: Request) -> Response:
        text = self.metrics.render(await self.backend.stats())
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
                             template=self.backend.served.chat_template)
        return await self._respond(req, received, CHAT)

    @_endpoint("responses")
    async def responses(self, request: Request) -> Response:
        received = time.perf_counter()
        req = resp.parse_response(await self._json(request), **self._served(),
                                  template=self.backend.served.chat_template)
        self._check_prompt(req.completion)
        run = _Completion(self, req.completion, received)
        await run.start()
        head = {"model": self.backend.served.name, "created": fmt.now(), "req": req}
        item_id = fmt.new_id("msg")
        if req.completion.stream:
            return _Stream(self._response_events(run, head, item_id), run)
        await run.finish()
        choice = run.choices[0]
        return JSONResponse(self._response(run, head, item_id, choice.text, choice.generated,
                                           choice.finish_reason))

    def _response(self, run: "_Completion", head: dict, item_id: str, text: str,
                  ids: list[int], finish: str | None) -> dict:
        """The finished response object: stored, its id names its session's end."""
        stored = run.kept is not None and run.length is not None
        rid = resp.response_id(run.kept, run.length) if stored else fmt.new_id("resp")
        return resp.response_object(
            rid=rid, **head, text=text, finish_reason=finish, usage_=run.usage(),
            item_id=item_id, token_ids=ids if run.req.return_token_ids else None,
            session=run.kept if stored else None)

    async def _response_events(self, run: "_Completion", head: dict, item_id: str):
        """Server-sent events of a streamed response (`event:` lines name each type)."""
        try:
            stream = resp.ResponseStream(item_id)
            start = resp.response_object(rid=fmt.new_id("resp"), **head, status="in_progress")
            for event in stream.opening(start):
                yield _sse_event(event)
            async with contextlib.aclosing(run.pieces()) as pieces:
                async for _, piece in pieces:
                    if piece.text or piece.ids:
                        yield _sse_event(stream.delta(
                            piece.text, piece.ids if run.req.return_token_ids else None))
        finally:
            await run.close()
        choice = run.choices[0]
        final = self._response(run, head, item_id, stream.text, choice.generated,
                               choice.finish_reason)
        for event in stream.closing(final):
            yield _sse_event(event)

    @_endpoint("responses")
    async def delete_response(self, request: Request) -> Response:
        """Close the session a stored response lives in (and so every response continued
        in place from it)."""
        rid = request.path_params["rid"]
        session, length = resp.parse_id(rid)
        if not await self.backend.close_session(session, holding=length):
            raise LookupError(f"no response {rid!r}")
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    def _check_prompt(self, req: fmt.CompletionRequest) -> None:
        limit = self.backend.limits.max_tokens_per_request
        if len(req.prompt_ids) > limit:
            raise BadRequest(f"a prompt of {len(req.prompt_ids)} tokens exceeds "
                             f"max_tokens_per_request={limit}")

    async def _respond(self, req: fmt.CompletionRequest, received: float,
                       shape: "_Shape") -> Response:
        self._check_prompt(req)
        head = {"rid": fmt.new_id(shape.prefix), "model": self.backend.served.name,
                "created": fmt.now()}
        run = _Completion(self, req, received)
        await run.start()                        # errors before any token are plain HTTP
        if req.stream:
            return _Stream(self._events(run, head, shape), run)
        await run.finish()
        choices = [shape.choice(
            index=c.index, text=c.text, finish_reason=c.finish_reason,
            token_ids=c.generated if req.return_token_ids else None,
            logprobs=shape.logprobs(run.token_texts(c.generated), c.logprobs, 0,
                                    run.top_texts(c.tops)) if req.logprobs else None)
            for c in run.choices]
        return JSONResponse(run.tagged(shape.whole(
            **head, choices=choices, usage_=run.usage(),
            prompt_ids=req.prompt_ids if req.return_token_ids else None)))

    async def _events(self, run: "_Completion", head: dict, shape: "_Shape"):
        """Server-sent events of a streamed completion: a chunk per released piece of any
        choice (its `index` saying whose)."""
        req, opening = run.req, True
        offsets, fresh = [0] * req.n, [True] * req.n
        try:
            async with contextlib.aclosing(run.pieces()) as pieces:
                async for choice, piece in pieces:
                    i = choice.index
                    delta = shape.delta(
                        index=i, text=piece.text, finish_reason=piece.finish_reason,
                        token_ids=piece.ids if req.return_token_ids else None,
                        logprobs=(shape.logprobs(run.token_texts(piece.ids), piece.logprobs,
                                                 offsets[i], run.top_texts(piece.tops))
                                  if req.logprobs else None),
                        **shape.first(fresh[i]))
                    chunk = shape.chunk(
                        **head, choices=[delta],
                        prompt_ids=req.prompt_ids if req.return_token_ids and opening
                        else None)
                    if opening:
                        chunk = run.tagged(chunk)
                    offsets[i] += len(piece.text)
                    opening = fresh[i] = False
                    yield _sse(chunk)
        finally:
            await run.close()
        if req.include_usage:
            yield _sse(shape.chunk(**head, choices=[], usage_=run.usage()))
        yield b"data: [DONE]\n\n"


@dataclasses.dataclass(frozen=True)
class _Shape:
    """How one endpoint shapes its answers (OpenAI's completion or chat objects)."""

    prefix: str
    whole: Callable[..., dict]               # the answer object, from its choices
    chunk: Callable[..., dict]               # a streamed chunk, from its choices
    choice: Callable[..., dict]              # one choice of the answer
    delta: Callable[..., dict]               # one choice of a chunk
    logprobs: Callable[..., dict]            # (texts, logprobs, offset, alternatives)
    first: Callable[[bool], dict]            # extra fields of a choice's first chunk


COMPLETION = _Shape("cmpl", fmt.completion_object, fmt.completion_object,
                    fmt.completion_choice, fmt.completion_choice, fmt.logprobs_object,
                    lambda first: {})
CHAT = _Shape("chatcmpl", fmt.chat_object, fmt.chat_chunk, fmt.chat_choice, fmt.chat_delta,
              lambda texts, lps, offset, tops: fmt.chat_logprobs(texts, lps, tops),
              lambda first: {"role": first})


class _Stream(StreamingResponse):
    """Server-sent events whose generator is closed when the response ends, however it ends.
    Starlette ends the stream of a client that left by cancelling it (ASGI 2.3's disconnect
    message) or, under ASGI 2.4, at a failed send, after which it drops the generator
    unclosed; closing it here ends the generation and returns its pages at once, not
    whenever the generator is collected. `run`'s sessions are let go too when the generator
    never started (a client gone before the first byte)."""

    def __init__(self, events, run: "_Completion"):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.run.close()


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _sse_event(obj: dict) -> bytes:
    return b"event: " + obj["type"].encode() + b"\n" + _sse(obj)


class _Piece:
    """Generated text released to the client: its token ids, their logprobs and alternatives
    (`tops`: (id, logprob) pairs a token), and the finish reason on the last piece."""

    def __init__(self, text: str, ids: list[int], logprobs: list[float],
                 finish_reason: str | None = None, tops: list[tuple] | None = None):
        self.text, self.ids, self.logprobs = text, ids, logprobs
        self.finish_reason = finish_reason
        self.tops = tops if tops is not None else [() for _ in ids]


class _Choice:
    """One generation of a completion: its session, its events, what it generated, the text
    released so far (up to stop strings), and how it finished."""

    def __init__(self, run: "_Completion", index: int):
        self.run, self.index = run, index
        self.key = run.key + (("generate",) if index == 0 else ("generate", index))
        sampling = run.req.sampling
        if index and sampling.seed is not None:     # choices draw apart, reproducibly
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) % 2 ** 32)
        self.sampling = sampling
        self.session: str | None = None
        self.events = None
        self.first = None
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[tuple] = []
        self.shown = 0                          # generated tokens whose text is shown
        self.released = 0                       # characters of the text sent so far
        self.text = ""                          # what was released
        self.finished = False                   # ran to its end
        self.finish_reason: str | None = None
        self.hold = max((len(s) for s in run.req.stop_strings), default=1) - 1

    async def begin(self, session: str):
        """Submit the generation in `session`; its first event."""
        self.session = session
        self.events = self.run.backend.request_events(Generate(
            id=self.key, session=session, sampling=self.sampling))
        self.first = await self.events.__anext__()
        return self.first

    async def pieces(self):
        """The generation as _Pieces of released text, from its first event."""
        run, metrics = self.run, self.run.front.metrics
        event, last = self.first, None
        while True:
            if isinstance(event, Done):
                tail, stopped = self._release(final=True)
                self.finished = True
                self.finish_reason = "stop" if stopped else event.info["finish_reason"]
                self.text += tail
                yield _Piece(tail, [], [], self.finish_reason)
                return
            assert isinstance(event, Token)
            now = time.perf_counter()
            if last is None:
                metrics.ttft.observe(now - run.received)
            else:
                metrics.itl.observe(now - last)
            last = now
            self.generated.append(event.token)
            self.logprobs.append(event.logprob)
            self.tops.append(event.top)
            made = len(self.generated)
            if not (event.token in self.sampling.stop and made > self.sampling.min_tokens):
                self.shown = made                   # a stop id's text is left out
            metrics.generated_tokens.inc()
            text, stopped = self._release()
            self.finished = stopped
            self.text += text
            if stopped:
                self.finish_reason = "stop"
            yield _Piece(text, [event.token], [event.logprob], self.finish_reason,
                         [event.top])
            if stopped:
                return
            event = await self.events.__anext__()

    def _release(self, final: bool = False) -> tuple[str, bool]:
        """Text that can go to the client now, and whether a stop string ended it: unless
        `final`, a tail that may be the start of a stop string, or of a character still being
        decoded, waits. Stop strings are looked for once `min_tokens` tokens are out."""
        tokenizer = self.run.tokenizer
        text = "" if tokenizer is None else tokenizer.decode(self.generated[:self.shown])
        if len(self.generated) >= self.sampling.min_tokens:
            for stop in self.run.req.stop_strings:
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


class _Completion:
    """One completion (or response): open its session, prefill what of the prompt it does not
    hold, fork it for each choice past the first, stream the generations, and at the end keep
    or close the sessions (`close`), whatever happens."""

    def __init__(self, front: OpenAIApp, req: fmt.CompletionRequest, received: float):
        self.front, self.backend, self.req = front, front.backend, req
        self.received = received
        self.key = ("http", next(front._ids))
        self.session: str | None = None         # an ephemeral session (prefix cache)
        self.kept: str | None = None            # a session that lives on
        self.forks: list[str] = []              # the other choices' sessions
        self.cached = 0                         # prompt tokens it held already
        self.length: int | None = None          # the kept session's length at the end
        self.tokenizer = self.backend.served.tokenizer
        self.choices = [_Choice(self, i) for i in range(req.n)]
        self._closed = False

    async def start(self) -> None:
        """Open the session (below), prefill what of the prompt it does not hold, fork it
        for the other choices, and wait for each choice's first generated token (or its
        end); errors up to here are raised, not streamed, and leave no session of theirs."""
        target = await self._open()
        try:
            rest = np.asarray(self.req.prompt_ids[self.cached:], np.int32)
            if len(rest):
                async for _ in self.backend.request_events(
                        Extend(id=self.key + ("prompt",), session=target, tokens=rest)):
                    pass
            self.front.metrics.prompt_tokens.inc(len(self.req.prompt_ids))
            self.front.metrics.cached_tokens.inc(self.cached)
            if self.req.n > 1:
                self.forks = await self.backend.fork_ephemeral(target, self.req.n - 1)
            sessions = [target, *self.forks]
            firsts = await asyncio.gather(*(c.begin(s) for c, s in zip(self.choices, sessions)),
                                          return_exceptions=True)
            failed = next((f for f in firsts if isinstance(f, BaseException)), None)
            if failed is not None:
                raise failed
        except BaseException:
            await self.close()
            raise

    async def _open(self) -> str:
        """The session to run in (Backend.open_session). A new one forks the live session
        holding the longest cached prefix of its prompt (or starts empty): a stateless
        request's is ephemeral and kept afterwards as a prefix-cache entry, `session: true`'s
        lives on. A session id continues that session, from `continue_at` in a fork when it
        has moved on since."""
        req = self.req
        opened = await self.backend.open_session(
            req.prompt_ids, session=req.session, continue_at=req.continue_at,
            reserve_tokens=len(req.prompt_ids) + req.sampling.max_tokens,
            check_held=self._check_fits)
        if opened.lives_on:
            self.kept = opened.id
        else:
            self.session = opened.id
        self.cached = opened.cached
        return opened.id

    def _check_fits(self, held: int) -> None:
        """Refuse a request that can never fit beside the `held` tokens of its session."""
        too_long = fmt.context_length_error(self.req, self.backend.served.max_model_len, held)
        if too_long is not None:                     # never fits: no wait can help
            raise _HttpError("context_length_exceeded", too_long[0], param=too_long[1])

    async def pieces(self):
        """Every choice's _Pieces as (choice, piece), in the order they come; leaving early
        (a client gone, an error) stops the others."""
        if len(self.choices) == 1:                  # no task needed
            choice = self.choices[0]
            async for piece in choice.pieces():
                yield choice, piece
            return
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(choice: _Choice) -> None:
            try:
                async for piece in choice.pieces():
                    queue.put_nowait((choice, piece))
            except Exception as e:                  # noqa: BLE001 - handed to the reader
                queue.put_nowait((choice, e))
            else:
                queue.put_nowait((choice, end))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            running = len(tasks)
            while running:
                choice, item = await queue.get()
                if item is end:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (its id as text for a model without a tokenizer; vLLM's
        "token_id:N" with `return_tokens_as_token_ids`)."""
        if self.req.tokens_as_ids:
            return [f"token_id:{t}" for t in ids]
        if self.tokenizer is None:
            return [str(t) for t in ids]
        return [self.tokenizer.decode([t]) for t in ids]

    def top_texts(self, tops: list[tuple]) -> list[list[tuple[str, float]]]:
        """Each token's alternatives as (text, logprob) pairs."""
        return [list(zip(self.token_texts([t for t, _ in top]), (lp for _, lp in top)))
                for top in tops]

    def tagged(self, answer: dict) -> dict:
        """`answer` with the extension field `session` when the session lives on."""
        return {**answer, "session": self.kept} if self.kept is not None else answer

    def usage(self) -> dict:
        return fmt.usage(len(self.req.prompt_ids), sum(len(c.generated) for c in self.choices),
                         self.cached)

    async def finish(self) -> None:
        """Run every choice to its end (the non-streamed answer), then `close`."""
        try:
            async with contextlib.aclosing(self.pieces()) as pieces:
                async for _ in pieces:
                    pass
        finally:
            await self.close()

    async def close(self) -> None:
        """End the generations still running; keep the ephemeral session of a request whose
        first choice ran to its end as a prefix-cache entry, or close it (a client that left:
        its queued work ends, its pages go back); close the other choices' forks; a kept
        session stays, idle, and its length is read. The engine's part (Backend.end_run) is
        handed over before anything is awaited, and shielded: a client that left cancels every
        await here (Starlette's cancel scope)."""
        if self._closed:
            return
        self._closed = True
        events = [c.events for c in self.choices if c.events is not None]
        for c in self.choices:
            c.events = None
        session, self.session = self.session, None
        keep, kept = self.choices[0].finished, self.kept
        generations = [c.key for c in self.choices]
        ended = self.backend.end_run(generations=generations, forks=list(self.forks),
                                     ephemeral=session, retain=keep, kept=kept)
        for generator in events:
            with contextlib.suppress(RuntimeError):     # already running: it ends with us
                await generator.aclose()
        with contextlib.suppress(Exception):
            self.length = await ended
