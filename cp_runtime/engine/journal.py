"""What the engine tells a durable store about sessions, so token logs outlive the process.

The engine calls these on its own thread, in order, and calls `commit()` before it hands out any
event that acknowledges tokens (an extend's `done`, a generated `token`): a store that makes
appended tokens durable in `commit` loses no acknowledged token. `Journal` itself keeps nothing
(an engine without a state directory).
"""

from __future__ import annotations

__all__ = ["Journal"]


class Journal:
    """No-op base: override what a store needs."""

    def created(self, session_id: str) -> None:
        """A new, empty session."""

    def appended(self, session_id: str, tokens: list[int]) -> None:
        """Tokens joined the end of a session's log."""

    def forked(self, parent_id: str, child_id: str, tokens: list[int]) -> None:
        """A new session whose log starts as `tokens` (its parent's)."""

    def closed(self, session_id: str) -> None:
        """The session is gone."""

    def commit(self) -> None:
        """Make everything reported so far as durable as the store promises."""
