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
