"""Durable token logs under a state directory (`cp-runtime serve --state-dir DIR`): the engine's
`Journal` (docs/state.md describes the format and the recovery rules).

    DIR/sessions/<session id>.log    the session's token log
                                     (cp_runtime.serving.state.token_log: checksummed
                                     records, append-only; deleted on close)
    DIR/snapshots/<session id>/      the `snapshot` op: the log and the cached rows at that
                                     moment (cp_runtime.serving.state.snapshots: checksummed)
    DIR/quarantine/<name>-<time>/    what start-up found damaged, kept with a note.json

Every journal call writes (and, per the fsync policy, syncs) before it returns, and the engine
applies a change only after its journal call returned: so every acknowledged token is in its
file, and a call that fails (disk full, an I/O error) raises StorageFailed having changed
nothing on disk: a record cut short is cut off again, and a commit that touched several logs
takes back the records it had already written.

Fsync policy (`--fsync`):
    always     fsync every file written, and its directory, at every commit: survives a power
               loss; costs a disk flush per step with new tokens
    interval   (default) write at every commit (the OS holds the data, so a killed process loses
               nothing) and fsync at most every `interval_s` seconds (a power loss can lose up
               to that much)
    never      write at every commit and leave the flushing to the OS
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import pathlib
import re
import secrets
import shutil
import threading
import time

from cp_runtime.cache.pool import CacheRows
from cp_runtime.engine.journal import Journal
from cp_runtime.engine.requests import NotFound, StorageFailed
from cp_runtime.serving.state import snapshots, token_log
from cp_runtime.serving.state.snapshots import fsync_path

__all__ = ["FSYNC_POLICIES", "LOG_SUFFIX", "TokenStore", "read_logs"]

FSYNC_POLICIES = ("always", "interval", "never")
LOG_SUFFIX = ".log"
SESSION_ID = re.compile(r"[0-9a-f]{32}")
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Tail:
    """Where a live log's next record goes (`end`, bytes) and the chain's last crc."""

    end: int
    crc: int


class TokenStore(Journal):
    """Token logs of every session, one append-only file each; snapshots; quarantine.

    Journal calls come from the engine's thread; `write_snapshot` from another, so the two
    meet under a lock (a snapshot never lands for a session closed meanwhile)."""

    def __init__(self, root: str | pathlib.Path, *, fsync: str = "interval",
                 interval_s: float = 1.0):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync={fsync!r} is not one of {FSYNC_POLICIES}")
        self.root = pathlib.Path(root)
        self.dir = self.root / "sessions"
        self.snapshots_dir = self.root / "snapshots"
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.dir, self.snapshots_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.fsync, self.interval_s = fsync, interval_s
        self._tails: dict[str, _Tail] = {}
        self._unsynced: set[str] = set()
        self._last_sync = time.monotonic()
        self._lock = threading.Lock()
        # What start-up found (cp_runtime.serving.state.recovery), for the `sessions` op.
        self.damaged: dict[str, dict] = {}         # restored, up to their trusted prefix
        self.unrestored: list[dict] = []           # sessions that could not come back

    def path(self, session_id: str) -> pathlib.Path:
        if not SESSION_ID.fullmatch(session_id):
            raise ValueError(f"{session_id!r} is not a session id")
        return self.dir / (session_id + LOG_SUFFIX)

    def snapshot_dir(self, session_id: str) -> pathlib.Path:
        self.path(session_id)                          # checks the id
        return self.snapshots_dir / session_id

    @property
    def live(self) -> set[str]:
        return set(self._tails)

    # -- Journal ----------------------------------------------------------------------------
    def create(self, session_id: str) -> None:
        self._write_new(session_id, [])

    def fork(self, parent_id: str, child_id: str, tokens: list[int]) -> None:
        self._write_new(child_id, tokens)

    def append(self, tokens_by_session: dict[str, list[int]]) -> None:
        """One record per session, all or none: on a failure the records already written by
        this call are cut off again before StorageFailed is raised."""
        before: dict[str, _Tail] = {}
        try:
            for session_id, tokens in tokens_by_session.items():
                if len(tokens) == 0:
                    continue
                tail = before[session_id] = self._tails[session_id]
                record, crc = token_log.encode_record(tokens, tail.crc)
                self._write_at(self.path(session_id), record, tail.end)
                self._tails[session_id] = _Tail(tail.end + len(record), crc)
        except OSError as e:
            self._take_back(before)
            log.error("session %s: could not append %d tokens to its log (%s); the commit "
                      "was taken back and the request refused with `storage`", session_id,
                      len(tokens), e.strerror or e)
            raise StorageFailed(f"the state directory could not take {len(tokens)} tokens of "
                                f"session {session_id} ({e.strerror or e}); nothing was "
                                "written: retry once the disk has room") from e
        self._written(before)

    def close(self, session_id: str) -> None:
        with self._lock:
            try:
                shutil.rmtree(self.snapshot_dir(session_id), ignore_errors=False)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StorageFailed(f"could not delete session {session_id}'s snapshot "
                                    f"({e.strerror or e}); the session stays open") from e
            try:
                self.path(session_id).unlink(missing_ok=True)
            except OSError as e:
                raise StorageFailed(f"could not delete session {session_id}'s token log "
                                    f"({e.strerror or e}); the session stays open") from e
            self._tails.pop(session_id, None)
            self._unsynced.discard(session_id)
            self.damaged.pop(session_id, None)
            if self.fsync == "always":
                self._sync_dirs()

    # -- writing ----------------------------------------------------------------------------
    def _write_new(self, session_id: str, tokens: list[int]) -> None:
        """A new log holding `tokens` (one record, or none), or StorageFailed and no file."""
        path = self.path(session_id)
        data, crc = token_log.HEADER, 0
        if len(tokens):
            record, crc = token_log.encode_record(tokens, 0)
            data += record
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            self._write_at(path, data, 0)
            if self.fsync == "always":
                fsync_path(self.dir)
        except OSError as e:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                log.exception("session %s: could not remove its half-created log", session_id)
            log.error("session %s: could not create its log (%s); refused with `storage`",
                      session_id, e.strerror or e)
            raise StorageFailed(f"the state directory could not take session {session_id}'s "
                                f"new log ({e.strerror or e}); nothing changed: retry once "
                                "the disk has room") from e
        self._tails[session_id] = _Tail(len(data), crc)
        self._written({session_id: None})

    def _write_at(self, path: pathlib.Path, data: bytes, offset: int) -> None:
        """Write `data` at `offset` of the log, the file ending right after it (bytes a
        failed write left beyond `offset` are cut first)."""
        fd = os.open(path, os.O_WRONLY)
        try:
            if os.fstat(fd).st_size != offset:
                os.ftruncate(fd, offset)
            _write_all(fd, data, offset)
            if self.fsync == "always":
                os.fsync(fd)
        finally:
            os.close(fd)

    def _take_back(self, before: dict[str, _Tail]) -> None:
        """Cut the logs in `before` back to their ends then (a failed commit)."""
        for session_id, tail in before.items():
            self._tails[session_id] = tail
            try:
                os.truncate(self.path(session_id), tail.end)
            except OSError:
                # The next write of this log cuts it first (_write_at), and start-up drops a
                # torn tail: the stray bytes are never read as tokens.
                log.exception("session %s: could not cut a failed write off its log",
                              session_id)

    def _written(self, session_ids) -> None:
        """Per the fsync policy, after a successful write of these logs."""
        if self.fsync == "always":
            return
        self._unsynced.update(session_ids)
        due = time.monotonic() - self._last_sync >= self.interval_s
        if self.fsync == "interval" and due:
            self._sync()

    def _sync(self) -> None:
        try:
            for session_id in self._unsynced:
                path = self.path(session_id)
                if path.exists():
                    fsync_path(path)
            fsync_path(self.dir)                          # new and deleted files, too
        except OSError:
            log.exception("fsync of the token logs failed: tokens acknowledged since the "
                          "last sync may not survive a power loss; retrying at the next commit")
            return
        self._unsynced.clear()
        self._last_sync = time.monotonic()

    def _sync_dirs(self) -> None:
        for d in (self.dir, self.snapshots_dir):
            try:
                fsync_path(d)
            except OSError:
                log.exception("fsync of %s failed", d)

    # -- snapshots --------------------------------------------------------------------------
    def write_snapshot(self, session_id: str, tokens: list[int], rows: CacheRows,
                       meta: dict) -> pathlib.Path:
        """Write a snapshot beside the session's old one, then swap it in (fsynced). Raises
        NotFound if the session closed meanwhile (nothing is left behind) and StorageFailed
        if the disk refused (the old snapshot stays)."""
        final = self.snapshot_dir(session_id)
        suffix = secrets.token_hex(4)
        tmp = final.with_name(f"{session_id}.tmp-{suffix}")
        old = final.with_name(f"{session_id}.old-{suffix}")
        try:
            snapshots.write_files(tmp, session_id, tokens, rows, meta)
            with self._lock:
                if session_id not in self._tails:
                    raise NotFound(f"session {session_id} was closed while its snapshot was "
                                   "being written")
                if final.exists():
                    final.rename(old)
                tmp.rename(final)
                fsync_path(self.snapshots_dir)
        except OSError as e:
            log.error("session %s: could not write its snapshot (%s)", session_id,
                      e.strerror or e)
            raise StorageFailed(f"the state directory could not take session {session_id}'s "
                                f"snapshot ({e.strerror or e}); its last snapshot stays") from e
        finally:
            for leftover in (tmp, old):
                shutil.rmtree(leftover, ignore_errors=True)
        return final

    def read_snapshot(self, session_id: str, *, upgrade: bool = False
                      ) -> snapshots.Snapshot | None:
        """The session's verified snapshot, None if it has none; raises SnapshotError.
        `upgrade`: give a format-1 snapshot its checksums (start-up)."""
        d = self.snapshot_dir(session_id)
        if not d.exists():
            return None
        if not d.is_dir():
            raise snapshots.SnapshotError(d.name, "is not a directory")
        return snapshots.read(d, upgrade=upgrade)

    # -- start-up (cp_runtime.serving.state.recovery) ---------------------------------------
    def adopt(self, session_id: str, end: int, crc: int) -> None:
        """Take a log read at start-up as live: its next record goes at byte `end`."""
        self._tails[session_id] = _Tail(end, crc)

    def forget(self, session_id: str) -> None:
        """Stop treating a log as live (its session could not be restored); its file stays."""
        self._tails.pop(session_id, None)

    def rewrite(self, session_id: str, tokens) -> None:
        """Replace a session's log with one holding exactly `tokens` (atomically, fsynced)."""
        path = self.path(session_id)
        tmp = path.with_name(path.name + ".tmp")
        data, crc = token_log.HEADER, 0
        if len(tokens):
            record, crc = token_log.encode_record(tokens, 0)
            data += record
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        fsync_path(self.dir)
        self.adopt(session_id, len(data), crc)

    def quarantine(self, name: str, reason: str, *, move=(), copy=(),
                   session: str | None = None) -> pathlib.Path:
        """Keep damaged files apart: `move` and `copy` (paths) go into a new folder under
        DIR/quarantine with a note.json saying what was wrong; returns the folder."""
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        dest = self.quarantine_dir / f"{name}-{stamp}"
        dest.mkdir(parents=True)
        for path in copy:
            shutil.copy2(path, dest / path.name)
        for path in move:
            shutil.move(str(path), str(dest / path.name))
        note = {"session": session, "reason": reason, "time": stamp,
                "files": [p.name for p in (*copy, *move)],
                "copied": [str(p) for p in copy], "moved": [str(p) for p in move]}
        (dest / "note.json").write_text(json.dumps(note, indent=1))
        fsync_path(dest)
        fsync_path(self.quarantine_dir)
        return dest


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def read_logs(root: str | pathlib.Path) -> dict[str, list[int]]:
    """Every session's trusted tokens under a state directory, read only (nothing repaired):
    for tools and tests looking at a server's directory."""
    logs = {}
    for path in sorted((pathlib.Path(root) / "sessions").glob("*" + LOG_SUFFIX)):
        if SESSION_ID.fullmatch(path.stem) and path.is_file():
            logs[path.stem] = token_log.parse(path.read_bytes()).tokens.tolist()
    return logs
