"""The protocol's error code for whatever a request raised: shared by both doors (the session
protocol's server and the OpenAI HTTP app), so each maps an exception to the same code."""

from __future__ import annotations

from cp_runtime.cache.pages import CapacityError
from cp_runtime.engine.requests import EngineError
from cp_runtime.serving.session.protocol import ProtocolError

__all__ = ["Refused", "error_code", "session_limit_message"]


class Refused(Exception):
    """A request refused by the server itself; `code` is the error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def session_limit_message(limit: int) -> str:
    """The refusal of a new session at `max_sessions` (both doors): retryable, `capacity`."""
    return (f"the server holds its limit of {limit} sessions (max_sessions={limit}); retry "
            "once one is closed")


def error_code(e: Exception) -> str:
    """The protocol's error code for an exception a request raised."""
    if isinstance(e, Refused):
        return e.code
    if isinstance(e, EngineError):
        return e.code
    if isinstance(e, CapacityError):
        return "capacity"
    if isinstance(e, ProtocolError):
        return "bad_request"
    return "internal"
