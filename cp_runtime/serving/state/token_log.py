"""The token log's file format, format 2 (docs/state.md): one append-only file per session.

    header   8 bytes     b"CPTL", then the format version: u32 little-endian, 2
    record   8 + 4n      n: u32 LE; crc: u32 LE; then n token ids, i32 LE

Each commit of the engine's journal appends one record per session it touches. A record's crc
is CRC-32C (the `crc32c` package, hardware-accelerated) over its n and its ids, seeded with the
previous record's crc (0 for the first), as etcd's WAL chains its records: a record that is
damaged, lost or spliced in from elsewhere fails the check where it happened.

Reading a log yields its trusted prefix: the tokens of the whole, verified records. A last
record cut short (a crash inside a write) is torn, and the reader says how many bytes to cut; a
record that fails its check ends the trusted prefix and is reported as damage. Format 1 (no
header, bare i32 ids, `<id>.tokens`) is read by `read_format1` for migration.
"""

from __future__ import annotations

import dataclasses
import struct

import crc32c
import numpy as np

__all__ = ["FORMAT", "HEADER", "LogFormatError", "ParsedLog", "encode_record", "parse",
           "read_format1"]

MAGIC = b"CPTL"
FORMAT = 2
HEADER = MAGIC + struct.pack("<I", FORMAT)
RECORD_HEAD = struct.Struct("<II")                  # n, crc


class LogFormatError(ValueError):
    """The file is not a token log of a format this release reads."""


@dataclasses.dataclass(frozen=True)
class ParsedLog:
    """A log's trusted prefix: `tokens` i32[N] of its whole, verified records, which end at
    byte `end` with chain value `crc`. `torn` bytes after `end` are a cut-short last record;
    `damage` says why the records stop before the end of the file, if they do."""

    tokens: np.ndarray
    end: int
    crc: int
    torn: int = 0
    damage: str | None = None


def record_crc(head_n: bytes, payload, prev_crc: int) -> int:
    return crc32c.crc32c(payload, crc32c.crc32c(head_n, prev_crc))


def encode_record(tokens, prev_crc: int) -> tuple[bytes, int]:
    """One record of `tokens` after a record whose crc is `prev_crc`: (bytes, its crc)."""
    payload = np.ascontiguousarray(tokens, "<i4").tobytes()
    head_n = struct.pack("<I", len(payload) // 4)
    crc = record_crc(head_n, payload, prev_crc)
    return head_n + struct.pack("<I", crc) + payload, crc


def parse(raw: bytes) -> ParsedLog:
    """The trusted prefix of a format-2 log's bytes. Raises LogFormatError if the header is
    not a format-2 header."""
    if raw[:4] != MAGIC or len(raw) < len(HEADER):
        raise LogFormatError(f"it does not start with a token log header ({MAGIC!r} + format)")
    (version,) = struct.unpack_from("<I", raw, 4)
    if version != FORMAT:
        raise LogFormatError(f"token log format {version} is not one this release reads "
                             f"({FORMAT})")
    pieces, pos, crc, count = [], len(HEADER), 0, 0
    view = memoryview(raw)
    while pos < len(raw):
        if len(raw) - pos < RECORD_HEAD.size:
            return _prefix(pieces, pos, crc, torn=len(raw) - pos)
        n, want = RECORD_HEAD.unpack_from(raw, pos)
        body = pos + RECORD_HEAD.size
        if body + 4 * n > len(raw):
            return _prefix(pieces, pos, crc, torn=len(raw) - pos)
        got = record_crc(view[pos: pos + 4], view[body: body + 4 * n], crc)
        if got != want:
            return _prefix(pieces, pos, crc, damage=(
                f"record {len(pieces)} (at byte {pos}, after {count} tokens) fails its "
                f"checksum ({got:#010x}, stored {want:#010x})"))
        pieces.append(np.frombuffer(raw, "<i4", count=n, offset=body))
        count += n
        pos, crc = body + 4 * n, want
    return _prefix(pieces, pos, crc)


def _prefix(pieces, end: int, crc: int, **kw) -> ParsedLog:
    tokens = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
    return ParsedLog(tokens=tokens, end=end, crc=crc, **kw)


def read_format1(raw: bytes) -> np.ndarray:
    """A format-1 log's tokens (bare little-endian i32; a partial last id is dropped)."""
    return np.frombuffer(raw[: len(raw) - len(raw) % 4], "<i4").astype(np.int32)
