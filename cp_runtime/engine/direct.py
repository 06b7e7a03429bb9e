"""The engine's direct path, for scoring (benchmarks, tests): `extend` and `decode` run at
once, synchronously, and return logits, where `Engine.submit` queues work for `Engine.step`.
They refuse sessions that have queued work, and journal what they append as the queued path
does. A mixin of `Engine` (cp_runtime.engine.core), whose sessions and pages it uses.
"""

from __future__ import annotations

import logging

import numpy as np

from cp_runtime.cache.pages import CapacityError
from cp_runtime.engine.plans import Row
from cp_runtime.engine.requests import BadRequest, StorageFailed, Unavailable, check_token_ids
from cp_runtime.engine.step import Segment

__all__ = ["DirectPath"]

log = logging.getLogger(__name__)


class DirectPath:
    """Engine.extend and Engine.decode."""

    def extend(self, session_id: str, tokens, *, all_logits: bool = False,
               progress=None) -> np.ndarray:
        """Prefill `tokens` into an idle session now, in chunks. Returns the logits of the last
        token f32[V] (or of every new token, f32[N, V], with all_logits)."""
        session = self._idle(session_id)
        ids = check_token_ids(tokens, self.model.vocab_size).tolist()
        self._append(session, ids)
        self._prompt_to_device(session)
        pending = session.length - session.kv_len      # includes an unwritten last token
        chunk, outs = self.runtime.chunk_size, []
        while session.kv_len < session.length:
            start = session.kv_len
            piece = session.tokens[start: start + chunk]
            final = start + len(piece) == session.length
            kind = "all_logits" if all_logits else ("logits" if final else "fill")
            out = self._run_now(self._segment(kind, [Row(session.table, piece, start)],
                                              width=chunk))
            session.kv_len += len(piece)
            if all_logits:
                outs.append(out[0, : len(piece)])
            if progress is not None:
                progress(len(piece))
        if all_logits:
            return np.concatenate(outs)[pending - len(ids):]
        return out[0]

    def decode(self, session_ids: list[str], tokens: list[int]) -> np.ndarray:
        """Append one token to each of several idle, fully written sessions in one step;
        returns logits f32[B, V]."""
        if len(session_ids) != len(tokens) or len(set(session_ids)) != len(session_ids):
            raise BadRequest("decode needs one token per distinct session")
        if len(session_ids) > self.runtime.max_batch:
            raise BadRequest(f"batch of {len(session_ids)} exceeds "
                             f"max_batch={self.runtime.max_batch}")
        ids = check_token_ids(list(tokens), self.model.vocab_size).tolist()
        sessions = [self._idle(i) for i in session_ids]
        if any(s.kv_len != s.length for s in sessions):
            raise BadRequest("decode needs sessions whose every token is in the cache")
        tables = [s.table for s in sessions]
        self._reserve_all(sessions)
        rows = [Row(s.table, [t], s.length) for s, t in zip(sessions, ids)]
        out = self._run_now(self._segment("logits", rows))
        try:
            self._journal.append({s.id: [t] for s, t in zip(sessions, ids)})
        except StorageFailed:
            for s, table in zip(sessions, tables):
                self._unreserve(s, table)
            raise
        for s, t in zip(sessions, ids):
            s.tokens.append(t)
            s.kv_len += 1
        return out[: len(sessions)]

    def _run_now(self, segment: Segment):
        """Run one segment of the direct path; a failed step is recovered from as in `step`
        (the caches come back through queued prefills) and raised as Unavailable."""
        try:
            return self.executor.run((segment,))[0]
        except Exception as e:          # noqa: BLE001 - the pool may be gone: recover first
            log.exception("step failed")
            self._recover(e)
            raise Unavailable(f"a device step failed ({type(e).__name__}: {e}); the cache is "
                              "being rebuilt: step the engine, then retry") from e

    def _reserve_all(self, sessions: list) -> None:
        """Reserve one more token for each session, all or nothing."""
        before = [s.table for s in sessions]
        try:
            for s in sessions:
                self._reserve(s, s.length + 1)
        except CapacityError:
            for s, table in zip(sessions, before):
                self._unreserve(s, table)
            raise
