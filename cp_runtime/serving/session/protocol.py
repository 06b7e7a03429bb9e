"""The wire protocol: frames, ops, events and error codes (docs/protocol.md specifies each).

A frame is a 4-byte big-endian length, then that many bytes of one msgpack map. A request map
carries `id` (an int or a string the client picks, unique among its requests in flight) and
`op`; the server answers with event maps tagged with that `id`:

    {"id": 7, "event": "progress", "done": 4096, "total": 131072}
    {"id": 8, "event": "token", "token": 17, "index": 0, "logprob": -0.01}
    {"id": 8, "event": "done", ...}              the op's result; the last event of a request
    {"id": 8, "event": "error", "code": "capacity", "message": "..."}   also the last

Token ids travel as a msgpack array of ints or, more compactly, as `bin` bytes holding
little-endian int32 values (what the client sends).
"""

from __future__ import annotations

import asyncio
import struct

import msgpack
import numpy as np

__all__ = [
    "ERROR_CODES",
    "EVENTS",
    "HEADER",
    "OPS",
    "PROTOCOL_VERSION",
    "RETRYABLE_CODES",
    "FrameError",
    "ProtocolError",
    "ServerError",
    "decode_tokens",
    "encode_frame",
    "encode_tokens",
    "error_class",
    "read_frame",
]

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
OPS = ("hello", "create", "extend", "generate", "fork", "info", "close", "stats", "sessions",
       "snapshot", "abort")
EVENTS = ("progress", "token", "done", "error")
ERROR_CODES = ("bad_request", "not_found", "capacity", "context_length_exceeded",
               "unauthorized", "unavailable", "overloaded", "storage", "internal")
# Codes of requests that changed nothing and may succeed if sent again later (`capacity`: once
# other sessions give back pages). `context_length_exceeded` never will: the session's tokens
# plus the request's pass what one session can hold.
RETRYABLE_CODES = ("capacity", "unavailable", "overloaded", "storage")


class FrameError(Exception):
    """The byte stream cannot be read as frames any more (oversized or truncated frame): the
    connection must close."""


class ProtocolError(ValueError):
    """One frame that is not a valid request; the connection can go on."""


def encode_frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> dict | None:
    """The next frame's map; None at a clean end of stream (between frames).

    Raises FrameError for a frame longer than `max_bytes` (before reading its body) or a
    stream that ends inside a frame, and ProtocolError for a body that is not a msgpack map."""
    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise FrameError("connection closed inside a frame header") from None
    (length,) = HEADER.unpack(head)
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes exceeds max_frame_bytes={max_bytes}")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise FrameError(f"connection closed inside a frame of {length} bytes") from None
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:                 # msgpack raises several types for bad input
        raise ProtocolError(f"frame is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(message).__name__}")
    return message


def encode_tokens(tokens) -> bytes:
    """Token ids as little-endian int32 bytes."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def decode_tokens(value) -> np.ndarray | list:
    """A request's `tokens` field: int32 bytes become i32[N]; a list is returned as it is (the
    engine checks every element). Anything else raises ProtocolError."""
    if isinstance(value, (bytes, bytearray)):
        if len(value) % 4:
            raise ProtocolError(f"tokens bytes must hold int32 values, got {len(value)} bytes")
        return np.frombuffer(value, dtype="<i4").astype(np.int32)
    if isinstance(value, list):
        return value
    raise ProtocolError(f"tokens must be a list of ints or int32 bytes, got "
                        f"{type(value).__name__}")


class ServerError(Exception):
    """An error event from the server; subclasses mirror the error codes."""

    code = "internal"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadRequestError(ServerError):
    code = "bad_request"


class NotFoundError(ServerError):
    code = "not_found"


class ContextLengthError(BadRequestError):
    """Not retryable: the session's tokens plus the request's (an extend's or an upload's
    tokens, a generation's `max_tokens`) pass `max_model_len`, what one session can hold
    (`hello` says it); nothing changed. Send less, or start a new session."""
    code = "context_length_exceeded"


class UnauthorizedError(ServerError):
    code = "unauthorized"


class UnavailableError(ServerError):
    """Retryable."""
    code = "unavailable"


class CapacityError(UnavailableError):
    """Retryable: no room now (pages held by other sessions, or `max_sessions` reached);
    nothing changed, and a retry may succeed once other sessions end."""
    code = "capacity"


class OverloadedError(UnavailableError):
    """Retryable: the server's admission queue is full; try again later."""
    code = "overloaded"


class StorageError(UnavailableError):
    """Retryable: the server's state directory could not take the change (disk full, an I/O
    error); nothing changed."""
    code = "storage"


class InternalError(ServerError):
    code = "internal"


_ERRORS = {cls.code: cls for cls in (BadRequestError, NotFoundError, CapacityError,
                                     ContextLengthError, UnauthorizedError, UnavailableError,
                                     OverloadedError, StorageError, InternalError)}


def error_class(code: str) -> type[ServerError]:
    return _ERRORS.get(code, ServerError)


__all__ += [cls.__name__ for cls in _ERRORS.values()]
