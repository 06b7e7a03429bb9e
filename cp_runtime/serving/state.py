"""Durable token logs under a state directory (`cp-runtime serve --state-dir DIR`), the
engine's `Journal` (docs/state.md describes the format).

    DIR/sessions/<session id>.tokens     the session's token log: little-endian int32,
                                         append-only; one file per session, deleted on close
    DIR/snapshots/<session id>/          the `snapshot` op: the log and the cached rows
        meta.json, tokens.i32,           (latent, indexer: .npy in the pool's storage dtypes)
        latent.npy, indexer.npy          at that moment; a restart restores from it

A session's tokens reach its file, through `commit`, before the engine acknowledges any of them,
so a server killed at any point (kill -9 included) restarts with every acknowledged token; a
restarted server lists the same sessions and rebuilds each cache from its log. A log may also
hold tokens that were accepted but never acknowledged (the server died between the two); a
client that did not see `done` should read the session's length before resending. A partial
int32 at the end of a file (a write cut short) is cut off the file when the log is read.

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
import json
import os
import pathlib
import re
import shutil
import time

import logging

import numpy as np

from cp_runtime.engine.journal import Journal
from cp_runtime.pool import CacheRows

__all__ = ["FSYNC_POLICIES", "TokenStore", "restore_sessions"]

FSYNC_POLICIES = ("always", "interval", "never")
log = logging.getLogger(__name__)
SUFFIX = ".tokens"
SNAPSHOT_FORMAT = 1
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
        """Every stored session's token log, by id. A cut-short last token (a crash inside an
        append) is cut off the file itself, so later appends line up with whole tokens."""
        logs = {}
        for path in sorted(self.dir.glob("*" + SUFFIX)):
            raw = path.read_bytes()
            whole = len(raw) - len(raw) % 4
            if whole != len(raw):
                self._truncate(path, whole, len(raw) - whole)
            logs[path.stem] = np.frombuffer(raw[:whole], "<i4").tolist()
        return logs

    @staticmethod
    def _truncate(path: pathlib.Path, size: int, dropped: int) -> None:
        """Cut a torn log back to its last whole token, durably, and say so."""
        with path.open("r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())
        log.warning("session %s: its token log ended in a partial token (%d bytes, a write "
                    "cut short); cut back to its last whole token", path.stem, dropped)

    # -- snapshots --------------------------------------------------------------------------
    def snapshot_dir(self, session_id: str) -> pathlib.Path:
        self.path(session_id)                          # checks the id
        return self.dir.parent / "snapshots" / session_id

    def write_snapshot(self, session_id: str, tokens: list[int], rows: CacheRows,
                       meta: dict) -> pathlib.Path:
        """Write (atomically: a complete new snapshot replaces the old one) and fsync."""
        final = self.snapshot_dir(session_id)
        tmp, old = final.with_suffix(".tmp"), final.with_suffix(".old")
        for leftover in (tmp, old):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir(parents=True)
        meta = {"format": SNAPSHOT_FORMAT, "session": session_id, "tokens": len(tokens),
                "cached": rows.num_tokens, "latent_dtype": str(rows.latent.dtype),
                "indexer_dtype": str(rows.indexer.dtype), **meta}
        (tmp / "tokens.i32").write_bytes(np.asarray(tokens, "<i4").tobytes())
        np.save(tmp / "latent.npy", rows.latent)
        np.save(tmp / "indexer.npy", rows.indexer)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for path in tmp.iterdir():
            with path.open("rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return final

    def read_snapshot(self, session_id: str) -> tuple[dict, list[int], CacheRows] | None:
        """(meta, tokens, rows) of a session's snapshot, or None if it has none."""
        d = self.snapshot_dir(session_id)
        if not (d / "meta.json").exists():
            return None
        meta = json.loads((d / "meta.json").read_text())
        tokens = np.frombuffer((d / "tokens.i32").read_bytes(), "<i4").tolist()
        rows = CacheRows(latent=np.load(d / "latent.npy"), indexer=np.load(d / "indexer.npy"))
        return meta, tokens, rows

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
        shutil.rmtree(self.snapshot_dir(session_id), ignore_errors=True)

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


def restore_sessions(engine, store: TokenStore) -> None:
    """Bring back every session of `store` into `engine`: from its snapshot where one matches
    (same model and cache dtype, its tokens a prefix of the log), the rest by prefill."""
    for session_id, tokens in store.load().items():
        snap = store.read_snapshot(session_id)
        cache = None
        if snap is not None:
            meta, snap_tokens, rows = snap
            if (meta.get("model"), meta.get("kv_cache_dtype")) != (
                    engine.model.name, engine.runtime.kv_cache_dtype):
                log.warning("session %s: snapshot of %s/%s does not fit %s/%s; re-prefilling",
                            session_id, meta.get("model"), meta.get("kv_cache_dtype"),
                            engine.model.name, engine.runtime.kv_cache_dtype)
            elif tokens[: len(snap_tokens)] == snap_tokens:
                cache = rows
        engine.restore_session(session_id, tokens, cache=cache)
