"""Python clients of the server: `AsyncClient` (asyncio) and `Client` (blocking, for scripts and
notebooks; it runs an `AsyncClient` on a background event loop).

    with cp_runtime.Client("127.0.0.1:7777") as client:
        with client.create_session() as session:             # closed on the server at exit
            session.extend(document_tokens, progress=True)  # chunked upload, progress bar
            answer = session.generate(max_tokens=32, temperature=0.7, seed=1)
            for token in session.stream(max_tokens=32):      # tokens as they come
                ...
            for token, logprob in session.stream(max_tokens=8, logprobs=True):
                ...
            with session.fork() as child:
                print(child.info())

Server errors raise `ServerError` subclasses named after their codes (`BadRequestError`,
`ContextLengthError`, `NotFoundError`, `CapacityError`, `UnauthorizedError`,
`UnavailableError`, `OverloadedError`, `StorageError`, `InternalError`), all importable from
`cp_runtime`. The retryable ones (`capacity`: other sessions hold the pages, or
`max_sessions`; `unavailable`: a pool rebuilding or a session restoring; `overloaded`: the
admission queue is full; `storage`: the state directory could not take the change) are
`UnavailableError`s, and `Client(..., retry=Retry())` retries a request turned away with one
of them before it began, with exponential backoff; nothing is retried by default.
`ContextLengthError` (a `BadRequestError`) is never retried: the session's tokens plus the
request's pass `max_model_len` (in `client.server`), what one session can ever hold.

`Session.extend` of more than `chunk_tokens` tokens is one upload in several requests, all or
nothing: the first says the upload's size, so the server refuses it up front
(`ContextLengthError`, `CapacityError`, ...) before any token is sent on, and a part that
fails undoes the whole upload (the session keeps the tokens it had before), as does a
cancelled upload (the client sends `abort`) or a closed connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np

from cp_runtime.serving.session.protocol import (BadRequestError, NotFoundError, ServerError,
                                                 UnavailableError, encode_frame, encode_tokens,
                                                 error_class, read_frame)

__all__ = ["AsyncClient", "AsyncSession", "Client", "Generation", "Retry", "Session"]

UPLOAD_CHUNK = 1 << 16          # tokens per extend request of a long upload (256 KiB of int32)
ABORT_TIMEOUT_S = 5.0           # how long a cancelled upload waits for the server's undo
MAX_REPLY_BYTES = 64 << 20
ProgressArg = bool | Callable[[int, int], None] | None


@dataclasses.dataclass(frozen=True)
class Generation:
    """A finished generation: its tokens, their text (models with a tokenizer), the model's
    log-probability of each token (when asked for), and why it stopped ("stop", "length");
    with `top_logprobs` N, each token's N most likely (id, log-probability) pairs."""

    tokens: list[int]
    text: str | None
    logprobs: list[float] | None
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass(frozen=True)
class Retry:
    """Retry a request the server answered with a retryable code (`capacity`, `unavailable`,
    `overloaded`, `storage`) before any other event (so it had no effect): up to `attempts`
    tries in all, waiting `backoff_s`, then twice that, ..., at most `max_backoff_s` between
    tries. An upload's first request is retried so; a later part's failure undoes the upload
    and is raised."""

    attempts: int = 5
    backoff_s: float = 0.25
    max_backoff_s: float = 4.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"{self}: attempts must be >= 1 and the waits >= 0")

    def wait_s(self, tried: int) -> float:
        """Seconds to wait after the `tried`-th failed try."""
        return min(self.backoff_s * 2 ** (tried - 1), self.max_backoff_s)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


class AsyncClient:
    """One connection to a server; requests on it may run concurrently."""

    def __init__(self, address: str = "127.0.0.1:7777", *, token: str | None = None,
                 retry: Retry | None = None):
        self.host, self.port = _split_address(address)
        self.token, self.retry = token, retry
        self.server: dict = {}                 # the hello reply: model, limits, ...
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue] = {}
        self._reader = self._writer = self._pump = None

    async def connect(self) -> "AsyncClient":
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port,
                                                                   limit=1 << 20)
        self._pump = asyncio.get_running_loop().create_task(self._read_replies())
        hello = {"token": self.token} if self.token else {}
        self.server = await self.call("hello", **hello)
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        if self._pump is not None:
            await asyncio.gather(self._pump, return_exceptions=True)

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _read_replies(self) -> None:
        error: Exception = ConnectionError("the server closed the connection")
        try:
            while (message := await read_frame(self._reader, MAX_REPLY_BYTES)) is not None:
                queue = self._queues.get(message.get("id"))
                if queue is not None:
                    queue.put_nowait(message)
                elif message.get("event") == "error":         # about no request of ours
                    error = error_class(message.get("code"))(message.get("message", ""))
        except Exception as e:                                 # noqa: BLE001 - told below
            error = ConnectionError(f"connection lost: {e}")
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def events(self, op: str, **fields) -> AsyncIterator[dict]:
        """Send one request; yield its events up to and including `done` (an error event
        raises its ServerError). With `retry`, a retryable answer (an UnavailableError) that
        comes before any other event sends the request again after a backoff."""
        async for event in self._events(op, fields, self.retry):
            yield event

    async def _events(self, op: str, fields: dict, retry: Retry | None
                      ) -> AsyncIterator[dict]:
        tried = 0
        while True:
            tried += 1
            started = False
            try:
                async for event in self._events_once(op, fields):
                    started = True
                    yield event
                return
            except UnavailableError:
                if started or retry is None or tried >= retry.attempts:
                    raise
            await asyncio.sleep(retry.wait_s(tried))

    async def _events_once(self, op: str, fields: dict) -> AsyncIterator[dict]:
        rid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            self._writer.write(encode_frame({"id": rid, "op": op, **fields}))
            await self._writer.drain()
            while True:
                event = await queue.get()
                if isinstance(event, Exception):
                    raise event
                if event.get("event") == "error":
                    raise error_class(event.get("code"))(event.get("message", ""),
                                                         event.get("code"))
                yield event
                if event.get("event") == "done":
                    return
        finally:
            self._queues.pop(rid, None)

    async def call(self, op: str, **fields) -> dict:
        """Send one request and return its `done` event's fields."""
        async for event in self.events(op, **fields):
            if event["event"] == "done":
                return {k: v for k, v in event.items() if k not in ("id", "event")}
        raise ServerError(f"{op}: no done event")

    async def create_session(self) -> "AsyncSession":
        return AsyncSession(self, (await self.call("create"))["session"])

    def session(self, session_id: str) -> "AsyncSession":
        """A handle on an existing session (no request is sent)."""
        return AsyncSession(self, session_id)

    async def stats(self) -> dict:
        return await self.call("stats")

    async def sessions(self) -> list[dict]:
        """Every session on the server: `id` (as `AsyncSession.id`), `length`, `restoring`,
        and `damaged` (why) for one restored up to the trusted prefix of a damaged log. (The
        wire names the id `session`, as in every request.)"""
        listed = (await self.call("sessions"))["sessions"]
        return [{"id": s["session"], **{k: v for k, v in s.items() if k != "session"}}
                for s in listed]

    async def unrestored(self) -> list[dict]:
        """Sessions of the server's state directory that start-up could not bring back:
        `id`, `reason` (naming the file), `quarantine` (where their files went, or None)."""
        listed = (await self.call("sessions")).get("unrestored", [])
        return [{"id": s["session"], **{k: v for k, v in s.items() if k != "session"}}
                for s in listed]


# generate's sampling fields (docs/protocol.md) and the values that change nothing; a field
# left at its neutral value is not sent.
SAMPLING_DEFAULTS = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0,
                     "repetition_penalty": 1.0, "logit_bias": None, "min_tokens": 0,
                     "top_logprobs": 0}


def _sampling(max_tokens: int, temperature: float, stop, logprobs: bool, **given) -> dict:
    unknown = set(given) - set(SAMPLING_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s) {sorted(unknown)}; known: "
                        f"{sorted(SAMPLING_DEFAULTS)}")
    fields = dict(max_tokens=max_tokens, temperature=temperature, stop=list(stop or ()),
                  logprobs=bool(logprobs or given.get("top_logprobs")))
    for name, value in given.items():
        if value is not None and value != SAMPLING_DEFAULTS[name]:
            fields[name] = ({int(t): float(b) for t, b in dict(value).items()}
                            if name == "logit_bias" else value)
    return fields


class _Progress:
    """Reports an upload's progress to a tqdm bar, a callback, or nothing."""

    def __init__(self, progress: ProgressArg, total: int | None):
        self.callback = progress if callable(progress) else None
        self.bar = None
        if progress is True:
            from tqdm import tqdm          # here: `import cp_runtime` works without it
            self.bar = tqdm(total=total, unit="tok", unit_scale=True)

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)
        if self.callback is not None:
            self.callback(done, total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class AsyncSession:
    """A session on the server, by id."""

    def __init__(self, client: AsyncClient, session_id: str):
        self.client, self.id = client, session_id

    def __repr__(self) -> str:
        return f"AsyncSession({self.id!r})"

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._close_quietly()

    async def _close_quietly(self) -> None:
        """Close, unless the session is already gone (closed inside the block)."""
        try:
            await self.close()
        except NotFoundError:
            pass

    async def extend(self, tokens_or_text, *, progress: ProgressArg = None,
                     chunk_tokens: int = UPLOAD_CHUNK) -> dict:
        """Append token ids (a list or integer array) or text (models with a tokenizer) and
        wait until they are in the cache. Long token uploads go in requests of `chunk_tokens`,
        all or nothing: the server admits the whole upload or refuses it (ContextLengthError
        past `max_model_len`, CapacityError, ...) before anything changes, and a failure part
        way (or a cancellation) undoes what was sent: the session is as it was before.
        progress: True for a progress bar, or a callback(done, total). Returns `info()`-like
        fields (`length`)."""
        if isinstance(tokens_or_text, str):
            parts, total = [{"text": tokens_or_text}], None
        else:
            ids = np.asarray(tokens_or_text)
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise BadRequestError(f"tokens must be a 1-D sequence of integers, got "
                                      f"{ids.dtype} with shape {ids.shape}")
            parts = [{"tokens": encode_tokens(ids[i: i + chunk_tokens])}
                     for i in range(0, max(len(ids), 1), chunk_tokens)]
            total = len(ids)
            if len(parts) > 1:                   # one upload: admitted whole, or refused
                parts[0]["upload"] = total
        report, before, result = _Progress(progress, total), 0, {}
        try:
            for i, part in enumerate(parts):
                # Only the first request may be retried: a later one's failure undid it all.
                retry = self.client.retry if i == 0 else None
                async for event in self.client._events("extend", {"session": self.id, **part},
                                                       retry):
                    if event["event"] == "progress":
                        report.update(before + event["done"], total or event["total"])
                    elif event["event"] == "done":
                        result = {k: v for k, v in event.items() if k not in ("id", "event")}
                before += len(part.get("tokens", b"")) // 4
        except (asyncio.CancelledError, KeyboardInterrupt):
            if len(parts) > 1:
                await self._abort_upload()
            raise
        finally:
            report.close()
        return result

    async def _abort_upload(self) -> None:
        """Undo an upload given up part way (the server undoes it too if the connection
        closes); at most ABORT_TIMEOUT_S, errors ignored: the caller's exception goes on."""
        try:
            await asyncio.wait_for(asyncio.shield(self.client.call("abort", session=self.id)),
                                   ABORT_TIMEOUT_S)
        except (Exception, asyncio.CancelledError):      # noqa: BLE001 - best effort
            pass

    async def stream(self, *, max_tokens: int = 16, temperature: float = 0.0, stop=None,
                     logprobs: bool = False, **sampling
                     ) -> AsyncIterator[int] | AsyncIterator[tuple]:
        """Generate, yielding each token id as it comes, or with `logprobs` each (token id,
        its log-probability) pair, or with `top_logprobs` N each (token id, log-probability,
        its N most likely (id, log-probability) pairs). `sampling`: generate's other fields
        (`top_p`, `top_k`, `min_p`, `seed`, `presence_penalty`, `frequency_penalty`,
        `repetition_penalty`, `logit_bias` {id: bias}, `min_tokens`, `top_logprobs`;
        docs/protocol.md)."""
        fields = _sampling(max_tokens, temperature, stop, logprobs, **sampling)
        top = bool(sampling.get("top_logprobs"))
        async for event in self.client.events("generate", session=self.id, **fields):
            if event["event"] == "token":
                if top:
                    yield (event["token"], event["logprob"],
                           [tuple(p) for p in event["top_logprobs"]])
                else:
                    yield ((event["token"], event["logprob"]) if fields["logprobs"]
                           else event["token"])

    async def generate(self, *, max_tokens: int = 16, temperature: float = 0.0, stop=None,
                       logprobs: bool = False, **sampling) -> Generation:
        """Generate and return the whole result (`sampling`: as `stream`'s)."""
        fields = _sampling(max_tokens, temperature, stop, logprobs, **sampling)
        tokens, lps, tops, done = [], [], [], {}
        async for event in self.client.events("generate", session=self.id, **fields):
            if event["event"] == "token":
                tokens.append(event["token"])
                lps.append(event.get("logprob"))
                tops.append([tuple(p) for p in event.get("top_logprobs", ())])
            elif event["event"] == "done":
                done = event
        return Generation(tokens=tokens, text=done.get("text"),
                          logprobs=lps if fields["logprobs"] else None,
                          finish_reason=done.get("finish_reason", ""),
                          top_logprobs=tops if sampling.get("top_logprobs") else None)

    async def fork(self) -> "AsyncSession":
        return AsyncSession(self.client, (await self.client.call("fork", session=self.id))
                            ["session"])

    async def info(self) -> dict:
        return await self.client.call("info", session=self.id)

    async def snapshot(self) -> dict:
        """Write the session's log and cache under the server's state directory (`path`,
        `length`, `cached`); a restarted server, of any shard count, restores from it."""
        return await self.client.call("snapshot", session=self.id)

    async def close(self) -> None:
        await self.client.call("close", session=self.id)


class Client:
    """Blocking client: an `AsyncClient` on an event loop in a background thread."""

    def __init__(self, address: str = "127.0.0.1:7777", *, token: str | None = None,
                 retry: Retry | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="cp-runtime-client")
        self._thread.start()
        self._async = AsyncClient(address, token=token, retry=retry)
        try:
            self._run(self._async.connect())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def server(self) -> dict:
        return self._async.server

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, agen) -> Iterator:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._async.close())
            self._stop_loop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create_session(self) -> "Session":
        return Session(self, self._run(self._async.create_session()))

    def session(self, session_id: str) -> "Session":
        return Session(self, self._async.session(session_id))

    def stats(self) -> dict:
        return self._run(self._async.stats())

    def sessions(self) -> list[dict]:
        return self._run(self._async.sessions())

    def unrestored(self) -> list[dict]:
        return self._run(self._async.unrestored())


class Session:
    """Blocking twin of `AsyncSession`; the same methods and arguments."""

    def __init__(self, client: Client, inner: AsyncSession):
        self._client, self._inner = client, inner

    @property
    def id(self) -> str:
        return self._inner.id

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self._client._run(self._inner._close_quietly())

    def extend(self, tokens_or_text, *, progress: ProgressArg = None,
               chunk_tokens: int = UPLOAD_CHUNK) -> dict:
        return self._client._run(self._inner.extend(tokens_or_text, progress=progress,
                                                    chunk_tokens=chunk_tokens))

    def generate(self, **sampling) -> Generation:
        return self._client._run(self._inner.generate(**sampling))

    def stream(self, **sampling) -> Iterator[int]:
        return self._client._iterate(self._inner.stream(**sampling))

    def fork(self) -> "Session":
        return Session(self._client, self._client._run(self._inner.fork()))

    def info(self) -> dict:
        return self._client._run(self._inner.info())

    def snapshot(self) -> dict:
        return self._client._run(self._inner.snapshot())

    def close(self) -> None:
        self._client._run(self._inner.close())
