"""What the server did, for its log: one debug line per finished request, and counters that the
server's periodic info summary reads and resets.

    request conn=3 id=7 extend session=s-2 tokens=2000 ms=812.4 ok
    last 60 s: 41 requests (2 refused: capacity 2), 80,000 tokens in, 512 out; 12 sessions, ...
"""

from __future__ import annotations

import collections
import dataclasses
import logging

__all__ = ["Activity", "RequestRecord"]

log = logging.getLogger("cp_runtime.serving.requests")


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One finished request: its op, session (or None), tokens uploaded (extend) or generated
    (generate), wall milliseconds, and outcome ("ok" or the error code)."""

    connection: int
    request: object
    op: str
    session: str | None
    tokens: int
    ms: float
    outcome: str


class Activity:
    """Counters since the last `take_summary()`; `record` also writes the request's debug line."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.requests = 0
        self.refused: collections.Counter[str] = collections.Counter()
        self.tokens_in = 0
        self.tokens_out = 0

    def record(self, r: RequestRecord) -> None:
        self.requests += 1
        if r.outcome != "ok":
            self.refused[r.outcome] += 1
        if r.op == "extend" and r.outcome == "ok":
            self.tokens_in += r.tokens
        elif r.op == "generate":
            self.tokens_out += r.tokens
        log.debug("request conn=%d id=%r %s session=%s tokens=%d ms=%.1f %s", r.connection,
                  r.request, r.op, r.session, r.tokens, r.ms, r.outcome)

    def take_summary(self, interval_s: float, engine_stats: dict) -> str | None:
        """The summary line of the interval just ended (None when no request finished in it),
        and a fresh interval."""
        if not self.requests:
            return None
        refused = sum(self.refused.values())
        why = ", ".join(f"{code} {n}" for code, n in self.refused.most_common())
        used = engine_stats["pages_used_per_shard"]
        line = (f"last {interval_s:.0f} s: {self.requests} requests"
                + (f" ({refused} refused: {why})" if refused else "")
                + f", {self.tokens_in:,} tokens in, {self.tokens_out:,} out; "
                f"{engine_stats['sessions']} sessions, {engine_stats['requests']} queued or "
                f"running, pages used per shard max {max(used)} of "
                f"{engine_stats['pages_per_shard']}, {engine_stats['tokens_per_s']:.0f} tok/s "
                "over the last minute")
        self._reset()
        return line
