"""What goes into the engine (requests, sampling parameters) and what comes out (events), and
the errors a refused request raises. Every check happens at `Engine.submit`, before anything
changes: a refused request leaves every session and the pool as they were.

Error codes (the server sends them as they are): bad_request, not_found, capacity,
context_length_exceeded, unauthorized, unavailable, overloaded, storage, internal. capacity,
unavailable, overloaded and storage are retryable: the request changed nothing, and waiting
can make room. context_length_exceeded is not: the session's tokens plus the request's would
pass what one session can ever hold (`Engine.max_model_len`: runtime.max_model_len, at most
the whole pool).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

import numpy as np

from cp_runtime.cache.pages import CapacityError
from cp_runtime.model.sampler import BIAS_SLOTS, MAX_TOP_LOGPROBS

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
    param: str | None = None       # the request's field at fault, where one is


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

    temperature 0 is greedy; top_k 0 means no limit; min_p 0 keeps every id; seed None draws
    one. Before sampling, `logit_bias` (token id -> bias, clamped to [-100, 100] as vLLM does)
    is added to the logits, then the penalties (vLLM's, over the session's last
    `sampler.PENALTY_WINDOW` tokens): `repetition_penalty` divides the positive logits and
    multiplies the negative ones of every id seen there (1: none), `frequency_penalty` and
    `presence_penalty` subtract per occurrence of an id in the generation's output, and once
    for any (0: none). Generation stops at `max_tokens` tokens or after any id in `stop`
    (which is returned); until `min_tokens` tokens are generated the `stop` ids are banned
    (never sampled). `logprobs`: each token carries the model's log-probability, and with
    `top_logprobs` N the N most likely ids with theirs."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()     # given as {id: bias} or (id, bias) pairs
    min_tokens: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, message: str) -> None:
            if not ok:
                error = BadRequest(message)
                error.param = field
                raise error

        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
             f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        need(_is_number(self.temperature) and 0 <= self.temperature <= MAX_F32, "temperature",
             f"temperature={self.temperature!r} must be a finite number >= 0 (float32)")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
             f"top_p={self.top_p!r} must be in (0, 1]")
        need(_is_int(self.top_k) and 0 <= self.top_k < MAX_TOP_K, "top_k",
             f"top_k={self.top_k!r} must be an integer in [0, 2**31) (0 = no limit)")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
             f"min_p={self.min_p!r} must be a number in [0, 1] (0 = no limit)")
        need(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed",
             f"seed={self.seed!r} must be an integer in [0, 2**32)")
        need(isinstance(self.stop, (tuple, list)) and all(_is_int(t) for t in self.stop),
             "stop", f"stop={self.stop!r} must be a list of token ids")
        need(isinstance(self.logprobs, bool), "logprobs",
             f"logprobs={self.logprobs!r} must be a bool")
        need(_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             "top_logprobs", f"top_logprobs={self.top_logprobs!r} must be an integer in "
                             f"[0, {MAX_TOP_LOGPROBS}]")
        need(not self.top_logprobs or self.logprobs, "top_logprobs",
             f"top_logprobs={self.top_logprobs} needs logprobs set to true")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_number(value) and -2 <= value <= 2, name,
                 f"{name}={value!r} must be a number in [-2, 2] (0 = none)")
        need(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_F32,
             "repetition_penalty", f"repetition_penalty={self.repetition_penalty!r} must be a "
                                   "finite number > 0 (1 = none)")
        need(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "min_tokens", f"min_tokens={self.min_tokens!r} must be an integer in "
                           f"[0, max_tokens={self.max_tokens!r}]")
        object.__setattr__(self, "stop", tuple(int(t) for t in self.stop))
        try:
            object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        except BadRequest as e:
            e.param = "logit_bias"
            raise
        banned = len(self.stop) if self.min_tokens else 0
        need(len(self.logit_bias) + banned <= BIAS_SLOTS, "logit_bias",
             f"logit_bias has {len(self.logit_bias)} entries"
             + (f" and min_tokens bans the {banned} stop ids" if banned else "")
             + f": at most {BIAS_SLOTS} in all")

    @property
    def penalized(self) -> bool:
        """Whether a penalty is set (the step then carries the row's recent token ids)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise BadRequest for a logit_bias id outside [0, vocab_size)."""
        bad = next((t for t, _ in self.logit_bias if not 0 <= t < vocab_size), None)
        if bad is not None:
            error = BadRequest(f"logit_bias: token {bad} is outside the vocabulary "
                               f"[0, {vocab_size})")
            error.param = "logit_bias"
            raise error


def _is_number(x) -> bool:
    """A finite real (an int past float's range is not: msgpack carries up to 2**64)."""
    if not isinstance(x, (numbers.Real, np.floating, np.integer)) or isinstance(
            x, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs: from a map of ids (ints, or strings of
    them as JSON keys are) to finite numbers, or from such pairs; biases clamped to
    [-100, 100]."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (tuple, list)) and all(
            isinstance(p, (tuple, list)) and len(p) == 2 for p in value):
        items = list(value)
    else:
        raise BadRequest(f"logit_bias must map token ids to biases, got "
                         f"{type(value).__name__}")
    out = {}
    for key, bias in items:
        token = key
        if isinstance(key, str) and re.fullmatch(r"\s*-?[0-9]+\s*", key):
            token = int(key)
        if not _is_int(token):
            raise BadRequest(f"logit_bias: key {key!r} is not a token id")
        if not _is_number(bias):
            raise BadRequest(f"logit_bias: the bias of token {token} is {bias!r}, not a finite "
                             "number")
        out[int(token)] = min(100.0, max(-100.0, float(bias)))
    return tuple(sorted(out.items()))


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
    """The `index`-th generated token of a request (logprob: the model's log-probability;
    `top`: the request's `top_logprobs` most likely (id, log-probability) pairs, most likely
    first)."""

    request: object
    token: int
    logprob: float
    index: int
    top: tuple[tuple[int, float], ...] = ()


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
