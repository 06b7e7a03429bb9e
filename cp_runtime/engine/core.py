"""The engine: sessions (token log + page table) and the step plans that advance them.

Every host-side decision (pages, positions, padding, batch composition) is made here, once, and
handed to the executor as a `StepInputs` plan, so multi-process workers stay in lockstep.

A session's token log is the source of truth; its KV is derived data. Requests that cannot be
served (too many tokens for the pool) are refused before anything changes.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.engine.executor import Executor
from cp_runtime.layout import cdiv
from cp_runtime.pages import CapacityError, PageAllocator
from cp_runtime.step import StepInputs

__all__ = ["Session", "Engine"]


@dataclasses.dataclass
class Session:
    """A session's token log (all tokens whose KV is in the pool) and its page table."""

    id: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)


def _bucket(n: int, multiple: int) -> int:
    """Round n up to multiple * 2^k, so step shapes (and compiles) stay few."""
    size = multiple
    while size < n:
        size *= 2
    return size


class Engine:
    """Owns sessions and the allocator; drives an executor with step plans."""

    def __init__(self, model: ModelConfig, runtime: RuntimeConfig, executor: Executor):
        self.model, self.runtime, self.executor = model, runtime, executor
        self.allocator = PageAllocator(runtime.num_shards, runtime.pages_per_shard)
        self.sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)

    # -- sessions -------------------------------------------------------------------------
    def create_session(self) -> Session:
        session = Session(id=next(self._ids))
        self.sessions[session.id] = session
        return session

    def get(self, session_id: int) -> Session:
        if session_id not in self.sessions:
            raise KeyError(f"no session {session_id}")
        return self.sessions[session_id]

    def close_session(self, session_id: int) -> None:
        session = self.sessions.pop(session_id)
        self.allocator.free(session.pages)

    def fork(self, session_id: int) -> Session:
        parent = self.get(session_id)
        pages, copy = self.allocator.fork(parent.pages, parent.length, self.runtime.page_size)
        if copy is not None:
            self.executor.copy_page(copy.shard, copy.src, copy.dst)
        child = Session(id=next(self._ids), tokens=list(parent.tokens), pages=pages)
        self.sessions[child.id] = child
        return child

    def _reserve(self, session: Session, new_tokens: int) -> None:
        """Grow the page table to hold `new_tokens` more tokens (atomic; may raise
        CapacityError, leaving everything as it was)."""
        want = cdiv(session.length + new_tokens, self.runtime.page_size)
        if want > len(session.pages):
            session.pages = self.allocator.grow(session.pages, want)

    # -- step plans -----------------------------------------------------------------------
    def _page_table(self, sessions: list[Session], chunks: list[list[int]],
                    rows: int) -> np.ndarray:
        """i32[rows, M]: each session's pages up to the end of its chunk (not every reserved
        page: later pages hold no keys yet, and the indexer's work grows with M)."""
        used = [cdiv(s.length + len(c), self.runtime.page_size) for s, c in zip(sessions, chunks)]
        width = _bucket(max(used), self.runtime.num_shards)
        table = np.full((rows, width), self.allocator.sentinel, np.int32)
        for row, (s, n) in enumerate(zip(sessions, used)):
            table[row, :n] = s.pages[:n]
        return table

    def _plan(self, sessions: list[Session], chunks: list[list[int]], width: int,
              rows: int) -> StepInputs:
        tokens = np.zeros((rows, width), np.int32)
        positions = np.full((rows, width), -1, np.int32)
        last = np.zeros((rows,), np.int32)
        for row, (s, chunk) in enumerate(zip(sessions, chunks)):
            tokens[row, : len(chunk)] = chunk
            positions[row, : len(chunk)] = np.arange(s.length, s.length + len(chunk))
            last[row] = len(chunk) - 1
        return StepInputs(tokens=tokens, positions=positions,
                          page_table=self._page_table(sessions, chunks, rows), logit_index=last)

    def _advance(self, sessions: list[Session], chunks: list[list[int]], width: int,
                 all_logits: bool) -> np.ndarray:
        rows = _bucket(len(sessions), 1)
        plan = self._plan(sessions, chunks, width, rows)
        out = self.executor.run(plan, all_logits=all_logits)
        for s, chunk in zip(sessions, chunks):
            s.tokens.extend(chunk)
        return out[: len(sessions)]

    def extend(self, session_id: int, tokens: list[int], *, all_logits: bool = False,
               progress=None) -> np.ndarray:
        """Chunked prefill of `tokens` into a session. Returns the logits of the last token
        f32[V] (or of every token, f32[len(tokens), V], with all_logits)."""
        session = self.get(session_id)
        if not tokens:
            raise ValueError("extend needs at least one token")
        self._check_tokens(tokens)
        self._reserve(session, len(tokens))
        chunk_size = self.runtime.chunk_size
        outs = []
        for start in range(0, len(tokens), chunk_size):
            chunk = list(tokens[start: start + chunk_size])
            out = self._advance([session], [chunk], chunk_size, all_logits)[0]
            outs.append(out[: len(chunk)] if all_logits else out)
            if progress is not None:
                progress(len(chunk))
        return np.concatenate(outs) if all_logits else outs[-1]

    def decode(self, session_ids: list[int], tokens: list[int]) -> np.ndarray:
        """Append one token to each session in one batched step; returns logits f32[B, V]."""
        if len(session_ids) != len(tokens) or len(set(session_ids)) != len(session_ids):
            raise ValueError("decode needs one token per distinct session")
        if len(session_ids) > self.runtime.max_batch:
            raise ValueError(f"batch of {len(session_ids)} exceeds "
                             f"max_batch={self.runtime.max_batch}")
        self._check_tokens(tokens)
        sessions = [self.get(i) for i in session_ids]
        self._reserve_all(sessions)
        return self._advance(sessions, [[t] for t in tokens], 1, False)

    def _reserve_all(self, sessions: list[Session]) -> None:
        """Reserve one more token for each session, all or nothing."""
        before = [list(s.pages) for s in sessions]
        try:
            for s in sessions:
                self._reserve(s, 1)
        except CapacityError:
            for s, pages in zip(sessions, before):
                s.pages = self.allocator.shrink(s.pages, len(pages))
            raise

    def _check_tokens(self, tokens: list[int]) -> None:
        bad = [t for t in tokens if not 0 <= int(t) < self.model.vocab_size]
        if bad:
            raise ValueError(f"token {bad[0]} is outside the vocabulary "
                             f"[0, {self.model.vocab_size})")
