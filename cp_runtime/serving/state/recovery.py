"""Start-up over a state directory: every session that can come back does, nothing that fails
a check is served, and no bad file stops the server (docs/state.md, "Restart and recovery").

In order:
  1. sessions/: format-1 logs (`<id>.tokens`) become format 2; the leftover of an interrupted
     rewrite (`<id>.log.tmp`) is removed; a name that is not a session's is ignored with a
     warning; an entry that is not a readable format-2 log goes to quarantine (moved), with
     its snapshot, and its session is listed as unrestored.
  2. Each log is read. A torn tail is cut off the file (fsynced, logged). A record that fails
     its checksum, or a token id outside the vocabulary, ends the trusted prefix: the original
     file is copied into quarantine, the log rewritten to the prefix, and the session restored
     with it, marked damaged.
  3. snapshots/: leftovers of an interrupted snapshot (`.tmp-*`, `.old-*`) and snapshots of
     sessions without a log are removed.
  4. Each session comes back into the engine, from its snapshot where that passes its checks
     and matches the log. A snapshot that fails a check goes to quarantine and the cache is
     rebuilt from the log; a log that is a strict prefix of its snapshot's tokens lost
     acknowledged tokens, so it is rewritten from the snapshot (the session marked damaged).
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil

import numpy as np

from cp_runtime.cache.pages import CapacityError
from cp_runtime.engine.requests import BadRequest
from cp_runtime.serving.state import token_log
from cp_runtime.serving.state.snapshots import SnapshotError
from cp_runtime.serving.state.token_store import LOG_SUFFIX, SESSION_ID, TokenStore

__all__ = ["restore_sessions"]

log = logging.getLogger(__name__)
FORMAT1_SUFFIX = ".tokens"
SNAPSHOT_LEFTOVER = re.compile(r"[0-9a-f]{32}\.(tmp|old)(-[0-9a-f]+)?")


def restore_sessions(engine, store: TokenStore) -> None:
    """Bring back every session of `store` into `engine` (the rules above); what could not
    come back whole is in `store.damaged` and `store.unrestored`, and in the log."""
    logs = _read_logs(store, engine.model.vocab_size)
    _clean_snapshots(store, set(logs))
    for session_id, tokens in logs.items():
        tokens, cache = _with_snapshot(engine, store, session_id, tokens)
        try:
            engine.restore_session(session_id, tokens, cache=cache)
        except BadRequest as e:                   # rows that do not fit this pool's layout
            log.warning("session %s: its snapshot does not fit (%s); rebuilding from its log",
                        session_id, e)
            engine.restore_session(session_id, tokens)
        except CapacityError as e:
            store.forget(session_id)
            _unrestored(store, session_id, f"its {len(tokens)} tokens do not fit this pool "
                                           f"({e}); its files stay in place", None)
    if store.damaged or store.unrestored:
        log.error("%s: %d sessions restored, %d of them damaged (restored up to their trusted "
                  "prefix), %d could not be restored; see the lines above and %s",
                  store.root, len(engine.sessions), len(store.damaged), len(store.unrestored),
                  store.quarantine_dir)


# -- 1 and 2: the logs ------------------------------------------------------------------------
def _read_logs(store: TokenStore, vocab_size: int) -> dict[str, np.ndarray]:
    _migrate_format1(store)
    logs = {}
    for path in sorted(store.dir.iterdir()):
        session_id = path.name[: -len(LOG_SUFFIX)] if path.name.endswith(LOG_SUFFIX) else None
        if session_id is not None and SESSION_ID.fullmatch(session_id):
            tokens = _read_log(store, session_id, path, vocab_size)
            if tokens is not None:
                logs[session_id] = tokens
        elif path.name.endswith(LOG_SUFFIX + ".tmp") and SESSION_ID.fullmatch(path.name[:32]):
            _remove(path, "the leftover of an interrupted log rewrite")
        else:
            log.warning("%s: ignored: not a session's token log (a log is named by its "
                        "session id, 32 lowercase hex digits, then %s)", path, LOG_SUFFIX)
    return logs


def _read_log(store: TokenStore, session_id: str, path: pathlib.Path,
              vocab_size: int) -> np.ndarray | None:
    """The session's trusted tokens, the file repaired; None if it went to quarantine."""
    try:
        if not path.is_file():
            raise token_log.LogFormatError("it is not a regular file")
        parsed = token_log.parse(path.read_bytes())
    except (OSError, token_log.LogFormatError) as e:
        reason = e.strerror if isinstance(e, OSError) else str(e)
        _quarantine_session(store, session_id, path, f"{path.name}: {reason}")
        return None
    if parsed.torn:
        _cut_torn_tail(path, parsed.end, parsed.torn)
    tokens, reasons = parsed.tokens, [parsed.damage] if parsed.damage else []
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        i = int(bad[0])
        reasons.append(f"token id {int(tokens[i])} at position {i} is outside the vocabulary "
                       f"[0, {vocab_size})")
        tokens = tokens[:i]
    if not reasons:
        store.adopt(session_id, parsed.end, parsed.crc)
        return tokens
    return tokens if _damaged(store, session_id, path, "; ".join(reasons), tokens) else None


def _cut_torn_tail(path: pathlib.Path, end: int, dropped: int) -> None:
    with path.open("r+b") as f:
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())
    log.warning("session %s: its token log ended in a record cut short (%d bytes: a write "
                "interrupted by a crash); cut back to its last whole record", path.stem, dropped)


def _migrate_format1(store: TokenStore) -> None:
    """`<id>.tokens` (format 1: bare i32) -> `<id>.log` (format 2), atomically each."""
    migrated = 0
    for path in sorted(store.dir.glob("*" + FORMAT1_SUFFIX)):
        session_id = path.stem
        if not SESSION_ID.fullmatch(session_id):
            continue                                   # _read_logs warns about it
        try:
            if not store.path(session_id).exists():    # else: migrated, not yet deleted
                store.rewrite(session_id, token_log.read_format1(path.read_bytes()))
            path.unlink()
            migrated += 1
        except OSError as e:
            log.error("session %s: could not migrate %s to format %d (%s); it stays as it is",
                      session_id, path, token_log.FORMAT, e)
    if migrated:
        log.info("%s: %d token logs migrated from format 1 to format %d", store.dir, migrated,
                 token_log.FORMAT)


# -- 3: snapshot leftovers ------------------------------------------------------------------
def _clean_snapshots(store: TokenStore, live: set[str]) -> None:
    for path in sorted(store.snapshots_dir.iterdir()):
        if SNAPSHOT_LEFTOVER.fullmatch(path.name):
            _remove(path, "the leftover of an interrupted snapshot")
        elif SESSION_ID.fullmatch(path.name):
            if path.name not in live:
                _remove(path, "a snapshot of a session that has no token log (closed)")
        else:
            log.warning("%s: ignored: not a session's snapshot", path)


def _remove(path: pathlib.Path, what: str) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        log.warning("%s: removed: %s", path, what)
    except OSError as e:
        log.error("%s: could not remove %s (%s)", path, what, e)


# -- 4: snapshots ---------------------------------------------------------------------------
def _with_snapshot(engine, store: TokenStore, session_id: str, tokens: np.ndarray):
    """(tokens, cached rows or None) for the session, from its snapshot where it holds."""
    try:
        snap = store.read_snapshot(session_id, upgrade=True)
        if snap is not None and ((snap.tokens < 0) | (snap.tokens >= engine.model.vocab_size)
                                 ).any():
            raise SnapshotError("tokens.i32", "holds token ids outside the vocabulary")
    except (SnapshotError, OSError) as e:
        _drop_snapshot(store, session_id, str(e))
        return tokens, None
    if snap is None:
        return tokens, None
    n = len(tokens)
    if len(snap.tokens) > n and np.array_equal(snap.tokens[:n], tokens):
        if _damaged(store, session_id, store.path(session_id),
                    f"its log holds {n} tokens, its snapshot {len(snap.tokens)}: the log lost "
                    "tokens; it is rewritten from the snapshot", snap.tokens):
            tokens = snap.tokens
    elif not np.array_equal(tokens[: len(snap.tokens)], snap.tokens):
        _drop_snapshot(store, session_id, "its tokens are not the start of the session's log")
        return tokens, None
    want = (engine.model.name, engine.runtime.kv_cache_dtype)
    have = (snap.meta.get("model"), snap.meta.get("kv_cache_dtype"))
    if have != want:
        log.warning("session %s: snapshot of %s/%s does not fit %s/%s; re-prefilling",
                    session_id, *have, *want)
        return tokens, None
    return tokens, snap.rows


def _drop_snapshot(store: TokenStore, session_id: str, reason: str) -> None:
    where = _try_quarantine(store, f"{session_id}-snapshot", f"snapshot: {reason}",
                            move=[store.snapshot_dir(session_id)], session=session_id)
    log.error("session %s: its snapshot fails a check (%s): not used; moved to %s; the cache "
              "is rebuilt from the token log", session_id, reason, where)


# -- reporting ------------------------------------------------------------------------------
def _damaged(store: TokenStore, session_id: str, path: pathlib.Path, reason: str,
             tokens: np.ndarray) -> bool:
    """Keep a copy of the damaged log, rewrite it to `tokens`, and report the session; False
    (the session reported unrestored, its files left as they are) if the rewrite failed."""
    where = _try_quarantine(store, session_id, reason, copy=[path], session=session_id)
    try:
        store.rewrite(session_id, tokens)
    except OSError as e:
        _unrestored(store, session_id, f"{path.name}: {reason}; rewriting it failed "
                                       f"({e.strerror or e})", where)
        return False
    store.damaged[session_id] = {"session": session_id, "file": path.name, "reason": reason,
                                 "tokens": len(tokens), "quarantine": where}
    log.error("session %s: %s: %s; restored with %d tokens; the original is kept in %s",
              session_id, path.name, reason, len(tokens), where)
    return True


def _quarantine_session(store: TokenStore, session_id: str, path: pathlib.Path,
                        reason: str) -> None:
    snapshot = store.snapshot_dir(session_id)
    move = [path] + ([snapshot] if snapshot.exists() else [])
    where = _try_quarantine(store, session_id, reason, move=move, session=session_id)
    _unrestored(store, session_id, reason, where)


def _unrestored(store: TokenStore, session_id: str, reason: str, where: str | None) -> None:
    store.unrestored.append({"session": session_id, "reason": reason, "quarantine": where})
    log.error("session %s: not restored: %s%s", session_id, reason,
              f"; moved to {where}" if where else "")


def _try_quarantine(store: TokenStore, name: str, reason: str, **files) -> str | None:
    try:
        return str(store.quarantine(name, reason, **files))
    except OSError as e:
        log.error("%s: could not move or copy %s into quarantine (%s); left in place", name,
                  [str(p) for p in files.get("move", []) + files.get("copy", [])], e)
        return None
