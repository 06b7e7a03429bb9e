"""What goes into the engine (requests, sampling parameters) and what comes out (events), and
the errors a refused request raises. Every check happens at `Engine.submit`, before anything
changes: a refused request leaves every session and the pool as they were.

Error codes (the server sends them as they are): bad_request, not_found, capacity,
context_length_exceeded, unauthorized, unavailable, overloaded, storage, internal. capacity,
unavailable, overloaded and storage are retryable: the request changed nothing, and waiting
can make room. context_length_exceeded is not: the session's tokens plus the request's would
pass what one session can ever hold (`Engine.max_model_len`, the whole pool).
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from cp_runtime.cache.pages import CapacityError

__all__ = [
    "BadRequest",
    "ContextTooLong",
    "Done",
    "EngineError",
    "Extend",
    "Failed",
    "Generate",
    "NotFound",
    "Overloaded",
    "PoolBusy",
    "Progress",
    "SamplingParams",
    "StorageFailed",
    "Token",
    "Unavailable",
    "check_token_ids",
]

MAX_SEED = 2 ** 32          # seeds are u32 on the device
MAX_TOP_K = 2 ** 31         # top_k is i32 on the device
MAX_F32 = float(np.finfo(np.float32).max)   # temperature is f32 on the device


class EngineError(Exception):
    """A request the engine refuses; `code` is the protocol's error code."""

    code = "internal"


class BadRequest(EngineError, ValueError):
    code = "bad_request"


class NotFound(EngineError, LookupError):
    code = "not_found"


class Unavailable(EngineError):
    """Retryable: the engine could not finish the request now (a failed step, shutdown)."""

    code = "unavailable"


class Overloaded(EngineError):
    """Retryable: the admission queue is full; the request was refused at once, changing
    nothing."""

    code = "overloaded"


class PoolBusy(EngineError, CapacityError):
    """Retryable: the pool has no room for the request now, its pages being held by other
    sessions (or requests in flight); the message says so in tokens and sessions. A
    `CapacityError` too, for callers of the allocator's kind."""

    code = "capacity"

    def __init__(self, message: str, requested=(), free=()):
        Exception.__init__(self, message)
        self.requested, self.free = list(requested), list(free)


class ContextTooLong(EngineError, CapacityError):
    """Never fits, however long one waits: `held` tokens of the session plus `added` new ones
    plus `generated` to generate pass `limit`, what one session can hold (the whole pool).
    Not retryable. A `CapacityError` too (it does not fit the pool)."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, limit: int, held: int, added: int,
                 generated: int = 0):
        Exception.__init__(self, message)
        self.limit, self.held, self.added, self.generated = limit, held, added, generated
        self.requested, self.free = [], []

    @property
    def total(self) -> int:
        return self.held + self.added + self.generated


class StorageFailed(EngineError):
    """Retryable: the state directory could not take the request's change (disk full, an I/O
    error); nothing changed, on disk or in memory."""

    code = "storage"


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_token_ids(tokens, vocab_size: int) -> np.ndarray:
    """Token ids as i32[N]: Python ints or a numpy integer array, each in [0, vocab_size).
    Floats, strings and bools are refused, never truncated."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu" or tokens.ndim != 1:
            raise BadRequest(f"tokens must be a 1-D integer array, got {tokens.dtype} "
                             f"with shape {tokens.shape}")
        ids = tokens.astype(np.int64)
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise BadRequest(f"tokens must be a list of integers, got "
                             f"{type(tokens).__name__}") from None
        bad = next((t for t in items if not _is_int(t)), None)
        if bad is not None:
            raise BadRequest(f"token {bad!r} is not an integer")
        # Range first: ids beyond int64 (msgpack carries up to 2**64 - 1) cannot be converted.
        bad = next((t for t in items if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token {int(bad)} is outside the vocabulary [0, {vocab_size})")
        ids = np.asarray(items, np.int64)
    if ids.size == 0:
        raise BadRequest("tokens is empty: send at least one token")
    out = (ids < 0) | (ids >= vocab_size)
    if out.any():
        raise BadRequest(f"token {int(ids[out][0])} is outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a generation draws its tokens (cp_runtime.model.sampler) and when it stops.

    temperature 0 is greedy; top_k 0 means no limit; seed None draws one; generation stops at
    `max_tokens` tokens or after any id in `stop` (which is returned)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[int, ...] = ()
    logprobs: bool = False

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise BadRequest(message)

        need(_is_int(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        need(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
             and 0 <= self.temperature <= MAX_F32,
             f"temperature={self.temperature!r} must be a finite number >= 0 (float32)")
        need(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
             and 0 < self.top_p <= 1, f"top_p={self.top_p!r} must be in (0, 1]")
        need(_is_int(self.top_k) and 0 <= self.top_k < MAX_TOP_K,
             f"top_k={self.top_k!r} must be an integer in [0, 2**31) (0 = no limit)")
        need(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED),
             f"seed={self.seed!r} must be an integer in [0, 2**32)")
        need(isinstance(self.stop, (tuple, list)) and all(_is_int(t) for t in self.stop),
             f"stop={self.stop!r} must be a list of token ids")
        need(isinstance(self.logprobs, bool), f"logprobs={self.logprobs!r} must be a bool")
        object.__setattr__(self, "stop", tuple(int(t) for t in self.stop))


@dataclasses.dataclass(frozen=True)
class Extend:
    """Append tokens to a session and prefill them (chunked, interleaved with decoding).

    Uploads (several extends, all or nothing; cp_runtime.engine.core): `upload_total` set
    begins one of that many tokens in all, these included, owned by `upload` (any key, e.g.
    the client's connection); an extend whose `upload` owns the session's open upload is its
    next part."""

    id: object
    session: str
    tokens: np.ndarray
    upload: object = None
    upload_total: int | None = None


@dataclasses.dataclass(frozen=True)
class Generate:
    """Generate tokens after a session's last token."""

    id: object
    session: str
    sampling: SamplingParams


@dataclasses.dataclass(frozen=True)
class Progress:
    """`done` of `total` tokens of an extend are in the cache."""

    request: object
    done: int
    total: int


@dataclasses.dataclass(frozen=True)
class Token:
    """The `index`-th generated token of a request (logprob: the model's log-probability)."""

    request: object
    token: int
    logprob: float
    index: int


@dataclasses.dataclass(frozen=True)
class Done:
    """A request finished; `info` says how (session length, finish reason, token count)."""

    request: object
    info: dict


@dataclasses.dataclass(frozen=True)
class Failed:
    """A request that was accepted but could not finish; `code` as in EngineError."""

    request: object
    code: str
    message: str
