"""Snapshot files, format 2 (docs/state.md): a session's log and cached rows at one moment.

    <session id>/meta.json     {"format": 2, "session", "tokens", "cached", "model",
                                "kv_cache_dtype", "latent_dtype", "indexer_dtype",
                                "latent_shape", "indexer_shape", "crc32c": {file: crc}}
    <session id>/tokens.i32    the log's tokens: little-endian int32, `tokens` of them
    <session id>/latent.npy    u8/u16/f32[layers, cached, latent width]
    <session id>/indexer.npy   u16/f32[indexer layers, cached, index dim]

`crc32c` holds the CRC-32C of each data file's payload: the token bytes, and each array's
bytes in C order (its .npy header is checked against the dtypes and shapes in meta.json). A
snapshot that fails any check raises SnapshotError naming the file and what is wrong; nothing
of it is used. Format 1 (the same files, no checksums or shapes) is verified as far as it can
be and upgraded in place by `upgrade_format1`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import crc32c
import numpy as np

from cp_runtime.cache.pool import CacheRows

__all__ = ["FORMAT", "Snapshot", "SnapshotError", "read", "upgrade_format1", "write_files"]

FORMAT = 2
META, TOKENS, LATENT, INDEXER = "meta.json", "tokens.i32", "latent.npy", "indexer.npy"


class SnapshotError(Exception):
    """A snapshot that cannot be trusted: `file` (its name in the snapshot) and why."""

    def __init__(self, file: str, reason: str):
        super().__init__(f"{file}: {reason}")
        self.file, self.reason = file, reason


@dataclasses.dataclass(frozen=True)
class Snapshot:
    meta: dict
    tokens: np.ndarray          # i32[T]
    rows: CacheRows             # the first `cached` tokens' rows


def _crc(array: np.ndarray) -> int:
    return crc32c.crc32c(memoryview(np.ascontiguousarray(array)).cast("B"))


def fsync_path(path: pathlib.Path) -> None:
    """fsync a file or a directory (its entries: renames, new and deleted files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_files(directory: pathlib.Path, session_id: str, tokens: list[int], rows: CacheRows,
                meta: dict) -> None:
    """Write a complete snapshot into the new directory `directory`, every file fsynced."""
    directory.mkdir(parents=True)
    ids = np.asarray(tokens, "<i4")
    (directory / TOKENS).write_bytes(ids.tobytes())
    np.save(directory / LATENT, rows.latent)
    np.save(directory / INDEXER, rows.indexer)
    meta = {"format": FORMAT, "session": session_id, "tokens": len(ids),
            "cached": rows.num_tokens, **meta,
            "latent_dtype": str(rows.latent.dtype), "indexer_dtype": str(rows.indexer.dtype),
            "latent_shape": list(rows.latent.shape), "indexer_shape": list(rows.indexer.shape),
            "crc32c": {TOKENS: _crc(ids), LATENT: _crc(rows.latent),
                       INDEXER: _crc(rows.indexer)}}
    (directory / META).write_text(json.dumps(meta, indent=1))
    for name in (TOKENS, LATENT, INDEXER, META):
        fsync_path(directory / name)
    fsync_path(directory)


def read(directory: pathlib.Path, *, upgrade: bool = False) -> Snapshot:
    """The verified snapshot in `directory`; raises SnapshotError. With `upgrade`, a format-1
    snapshot is given its checksums first (`upgrade_format1`)."""
    meta = _read_meta(directory)
    if upgrade and meta.get("format") == 1:
        upgrade_format1(directory)
        return read(directory)
    if meta.get("format") != FORMAT:
        raise SnapshotError(META, f"format {meta.get('format')!r} is not {FORMAT}")
    crcs = meta.get("crc32c")
    if not isinstance(crcs, dict):
        raise SnapshotError(META, "it has no crc32c checksums")
    snap = _load(directory, meta)
    for name, data in ((TOKENS, snap.tokens), (LATENT, snap.rows.latent),
                       (INDEXER, snap.rows.indexer)):
        if _crc(data) != crcs.get(name):
            raise SnapshotError(name, f"its checksum {_crc(data):#010x} is not the "
                                      f"{crcs.get(name)!r} recorded in {META}")
    return snap


def _read_meta(directory: pathlib.Path) -> dict:
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SnapshotError(META, f"unreadable ({type(e).__name__}: {e})") from None
    except json.JSONDecodeError as e:
        raise SnapshotError(META, f"not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise SnapshotError(META, f"not a JSON object ({type(meta).__name__})")
    return meta


def _load(directory: pathlib.Path, meta: dict) -> Snapshot:
    """Read the data files and check them against meta.json (not the checksums)."""
    try:
        raw = (directory / TOKENS).read_bytes()
    except OSError as e:
        raise SnapshotError(TOKENS, f"unreadable ({type(e).__name__}: {e})") from None
    if len(raw) % 4 or len(raw) // 4 != meta.get("tokens"):
        raise SnapshotError(TOKENS, f"{len(raw)} bytes do not hold the {meta.get('tokens')!r} "
                                    f"tokens of {META}")
    tokens = np.frombuffer(raw, "<i4").astype(np.int32)
    arrays = {}
    for name, key in ((LATENT, "latent"), (INDEXER, "indexer")):
        try:
            arrays[key] = np.load(directory / name, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise SnapshotError(name, f"not a readable .npy array ({type(e).__name__}: "
                                      f"{e})") from None
        arr, want_dtype = arrays[key], meta.get(f"{key}_dtype")
        want_shape = meta.get(f"{key}_shape")
        if str(arr.dtype) != want_dtype or arr.ndim != 3 or arr.shape[1] != meta.get("cached"):
            raise SnapshotError(name, f"{arr.dtype}{list(arr.shape)} is not the "
                                      f"{want_dtype}[*, {meta.get('cached')}, *] of {META}")
        if want_shape is not None and list(arr.shape) != want_shape:
            raise SnapshotError(name, f"shape {list(arr.shape)} is not {want_shape} of {META}")
    if meta.get("cached", 0) > len(tokens):
        raise SnapshotError(META, f"{meta['cached']} cached rows for {len(tokens)} tokens")
    return Snapshot(meta=meta, tokens=tokens, rows=CacheRows(**arrays))


def upgrade_format1(directory: pathlib.Path) -> None:
    """Give a format-1 snapshot its shapes and checksums (meta.json rewritten atomically),
    after the checks format 1 allows; raises SnapshotError."""
    meta = _read_meta(directory)
    if meta.get("format") != 1:
        raise SnapshotError(META, f"format {meta.get('format')!r} is not 1")
    snap = _load(directory, meta)
    meta = {**meta, "format": FORMAT, "latent_shape": list(snap.rows.latent.shape),
            "indexer_shape": list(snap.rows.indexer.shape),
            "crc32c": {TOKENS: _crc(snap.tokens), LATENT: _crc(snap.rows.latent),
                       INDEXER: _crc(snap.rows.indexer)}}
    tmp = directory / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    fsync_path(tmp)
    tmp.replace(directory / META)
    fsync_path(directory)
