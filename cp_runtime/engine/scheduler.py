"""The scheduler: what each engine step runs.

A step holds the next token of every running generation (up to `max_batch` of them, oldest
first) plus at most one prefill chunk of at most `chunk_size` tokens and at most what the step's
token budget leaves after the decode rows. So a long upload advances one chunk per step while
every running generation gets a token every step: a million-token extend never stalls other
sessions' decoding. Extends take turns, one chunk each (round robin): a short prompt sent during
a long upload waits a chunk or two, not for the whole upload (first come, first served made a
256-token chat prompt wait 31 s behind two 8K uploads in `cp-runtime bench serving`).

Admission queue: the prefill tokens of queued extends are bounded by `max_queued_tokens`
(0: no bound; the engine may move it with the measured prefill rate). An extend that would pass it is refused at once (`Overloaded`, retryable), unless
the queue is empty, so an overloaded server serves the extends it took within their clients'
deadlines and turns the rest away fast instead of slowing every upload down together. Restores
(the engine rebuilding a cache from its log) are never refused, but count.

The scheduler only orders work; the engine owns sessions and pages, and decides admission of
pages (they are reserved when a request is submitted, so nothing here can run out of them).
"""

from __future__ import annotations

import collections
import dataclasses

from cp_runtime.engine.requests import Extend, Generate, Overloaded

__all__ = ["ExtendWork", "GenerateWork", "Batch", "Scheduler"]


@dataclasses.dataclass
class ExtendWork:
    """An extend in progress: its session's cache must reach `target` tokens."""

    request: Extend
    session: "object"            # engine.core.Session
    target: int

    @property
    def remaining(self) -> int:
        return self.target - self.session.kv_len


@dataclasses.dataclass
class GenerateWork:
    """A generation in progress: `produced` tokens so far, drawn with `seed`."""

    request: Generate
    session: "object"
    seed: int
    produced: int = 0


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's work: decode rows, then at most one prefill chunk of `prefill_tokens`."""

    decodes: tuple[GenerateWork, ...]
    prefill: ExtendWork | None
    prefill_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.decodes) or self.prefill is not None


class Scheduler:
    """Generations oldest first; extends in turn."""

    def __init__(self, *, chunk_size: int, max_batch: int, token_budget: int,
                 max_queued_tokens: int = 0):
        if min(chunk_size, max_batch, token_budget) <= 0:
            raise ValueError(f"{chunk_size=}, {max_batch=} and {token_budget=} must be positive")
        if max_queued_tokens < 0:
            raise ValueError(f"{max_queued_tokens=} must be >= 0 (0: no bound)")
        self.chunk_size, self.max_batch, self.token_budget = chunk_size, max_batch, token_budget
        self.max_queued_tokens = max_queued_tokens
        self._extends: collections.deque[ExtendWork] = collections.deque()
        self._generations: list[GenerateWork] = []

    @property
    def has_work(self) -> bool:
        return bool(self._extends or self._generations)

    @property
    def queued_tokens(self) -> int:
        """Prefill tokens the queued extends (restores included) still have to run."""
        return sum(w.remaining for w in self._extends)

    def check_room(self, tokens: int) -> None:
        """Raise Overloaded if an extend of `tokens` tokens would pass the admission bound."""
        queued = self.queued_tokens
        bound = self.max_queued_tokens
        if bound and queued and queued + tokens > bound:
            raise Overloaded(f"the server is overloaded: {queued} prefill tokens are queued, "
                             f"and {tokens} more would pass max_queued_tokens={bound}; retry "
                             "after a backoff")

    def add(self, work: ExtendWork | GenerateWork) -> None:
        if isinstance(work, ExtendWork):
            self._extends.append(work)
        else:
            self._generations.append(work)

    def remove(self, work: ExtendWork | GenerateWork) -> None:
        if isinstance(work, ExtendWork):
            self._extends.remove(work)
        else:
            self._generations.remove(work)

    def work(self) -> list[ExtendWork | GenerateWork]:
        """Everything queued or running, oldest first within each kind."""
        return [*self._generations, *self._extends]

    def next_batch(self) -> Batch:
        decodes = tuple(self._generations[: self.max_batch])
        room = min(self.chunk_size, self.token_budget - len(decodes))
        if not self._extends or room <= 0:
            return Batch(decodes=decodes, prefill=None)
        extend = self._extends[0]
        self._extends.rotate(-1)                    # the next step serves the next extend
        return Batch(decodes=decodes, prefill=extend,
                     prefill_tokens=min(room, extend.remaining))
