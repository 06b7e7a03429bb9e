"""Durable token logs under a state directory (`cp-runtime serve --state-dir DIR`), the
engine's `Journal` (docs/state.md describes the format).

    DIR/sessions/<session id>.tokens     the session's token log: little-endian int32,
                                         append-only; one file per session, deleted on close

A session's tokens reach its file, through `commit`, before the engine acknowledges any of them,
so a server killed at any point (kill -9 included) restarts with every acknowledged token; a
restarted server lists the same sessions and rebuilds each cache from its log. A log may also
hold tokens that were accepted but never acknowledged (the server died between the two); a
client that did not see `done` should read the session's length before resending. A partial
int32 at the end of a file (a write cut short) is dropped when the log is read.

Fsync policy (`--fsync`):
    always     fsync every file written, at every commit: survives a power loss; costs a
               disk flush per step with new tokens
    interval   (default) write at every commit (the OS holds the data, so a killed process loses
               nothing) and fsync at most every `interval_s` seconds (a power loss can lose up
               to that much)
    never      write at every commit and leave the flushing to the OS
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import time

import numpy as np

from cp_runtime.engine.journal import Journal

__all__ = ["FSYNC_POLICIES", "TokenStore"]

FSYNC_POLICIES = ("always", "interval", "never")
SUFFIX = ".tokens"
_SESSION_ID = re.compile(r"[0-9a-f]{32}")


class TokenStore(Journal):
    """Token logs of every session, one append-only file each."""

    def __init__(self, root: str | pathlib.Path, *, fsync: str = "interval",
                 interval_s: float = 1.0):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync={fsync!r} is not one of {FSYNC_POLICIES}")
        self.dir = pathlib.Path(root) / "sessions"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync, self.interval_s = fsync, interval_s
        self._pending: dict[str, list[int]] = collections.defaultdict(list)
        self._unsynced: set[str] = set()
        self._last_sync = time.monotonic()

    def path(self, session_id: str) -> pathlib.Path:
        if not _SESSION_ID.fullmatch(session_id):
            raise ValueError(f"{session_id!r} is not a session id")
        return self.dir / (session_id + SUFFIX)

    def load(self) -> dict[str, list[int]]:
        """Every stored session's token log, by id (a cut-short last token is dropped)."""
        logs = {}
        for path in sorted(self.dir.glob("*" + SUFFIX)):
            raw = path.read_bytes()
            whole = len(raw) - len(raw) % 4
            logs[path.stem] = np.frombuffer(raw[:whole], "<i4").tolist()
        return logs

    # -- Journal ----------------------------------------------------------------------------
    def created(self, session_id: str) -> None:
        self.path(session_id).touch()
        self._unsynced.add(session_id)

    def appended(self, session_id: str, tokens: list[int]) -> None:
        self._pending[session_id].extend(tokens)

    def forked(self, parent_id: str, child_id: str, tokens: list[int]) -> None:
        self.created(child_id)
        self.appended(child_id, tokens)

    def closed(self, session_id: str) -> None:
        self._pending.pop(session_id, None)
        self._unsynced.discard(session_id)
        self.path(session_id).unlink(missing_ok=True)

    def commit(self) -> None:
        for session_id, tokens in self._pending.items():
            with self.path(session_id).open("ab") as f:
                f.write(np.asarray(tokens, "<i4").tobytes())
                if self.fsync == "always":
                    os.fsync(f.fileno())
            if self.fsync != "always":
                self._unsynced.add(session_id)
        self._pending.clear()
        due = time.monotonic() - self._last_sync >= self.interval_s
        if self._unsynced and (self.fsync == "always" or (self.fsync == "interval" and due)):
            self._sync()

    def _sync(self) -> None:
        for session_id in self._unsynced:
            path = self.path(session_id)
            if path.exists():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        dir_fd = os.open(self.dir, os.O_RDONLY)       # new and deleted files, too
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._unsynced.clear()
        self._last_sync = time.monotonic()
