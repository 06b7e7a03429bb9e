"""What the engine tells a durable store about sessions, so token logs outlive the process.

The engine calls these on its own thread, in order, each before it applies the change (to its
sessions, the allocator, or the events it hands out): a store whose calls are durable when they
return loses no acknowledged token. A call that cannot be made durable raises
`StorageFailed` (cp_runtime.engine.requests) having changed nothing, and the engine then
changes nothing either. `Journal` itself keeps nothing (an engine without a state directory).
"""

from __future__ import annotations

__all__ = ["Journal"]


class Journal:
    """No-op base: override what a store needs."""

    def create(self, session_id: str) -> None:
        """A new, empty session."""

    def append(self, tokens_by_session: dict[str, list[int]]) -> None:
        """Tokens join the ends of these sessions' logs: all of them, or (StorageFailed) none."""

    def fork(self, parent_id: str, child_id: str, tokens: list[int]) -> None:
        """A new session whose log starts as `tokens` (its parent's)."""

    def close(self, session_id: str) -> None:
        """The session is gone."""


class DurableOnly(Journal):
    """Passes the calls of durable sessions on to `store`; ephemeral sessions (prefix-cache
    entries, cp_runtime.engine.prefix_cache) live in memory only and are gone after a
    restart. A durable fork of an ephemeral session starts a log of its own."""

    def __init__(self, store: Journal):
        self.store = store
        self.ephemeral: set[str] = set()

    def create(self, session_id: str) -> None:
        self.store.create(session_id)

    def append(self, tokens_by_session: dict[str, list[int]]) -> None:
        durable = {s: t for s, t in tokens_by_session.items() if s not in self.ephemeral}
        if durable:
            self.store.append(durable)

    def fork(self, parent_id: str, child_id: str, tokens: list[int]) -> None:
        if child_id not in self.ephemeral:
            self.store.fork(parent_id, child_id, tokens)

    def close(self, session_id: str) -> None:
        if session_id in self.ephemeral:
            self.ephemeral.discard(session_id)
        else:
            self.store.close(session_id)
