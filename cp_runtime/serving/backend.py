"""The server as a front door sees it: the limits on what clients may ask (`ServerLimits`, the
same at both doors), the model served (`ServedModel`), and `Backend`, the few operations the
OpenAI HTTP door (serving/http/) runs. The server (serving/session/server.py) implements it;
the HTTP door holds a `Backend` and never the engine, the device loop or the server itself.

Each engine operation runs on the device thread between two steps, all at once (nothing else
touches the engine in the middle). Requests and their events are the engine's value types
(cp_runtime.engine.requests: Extend and Generate; Progress, Token and Done).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:                       # types only: this module imports nothing of the engine
    from cp_runtime.engine.requests import Extend, Generate

__all__ = ["Backend", "OpenedSession", "ServedModel", "ServerLimits"]


def _limit(default: int, meaning: str):
    """A ServerLimits field: its default and what it limits (the serve flag's help)."""
    return dataclasses.field(default=default, metadata={"help": meaning})


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Limits on what clients may ask; each refusal is an error event naming the limit."""

    max_frame_bytes: int = _limit(
        64 << 20, "bytes in one request frame (a 1M-token upload is about 4 MiB); a bigger "
                  "frame is refused with bad_request and the connection closed")
    max_sessions: int = _limit(
        4096, "sessions open at once; create or fork past it is refused with capacity")
    max_tokens_per_request: int = _limit(
        1 << 20, "tokens in one extend (the client splits longer uploads); more is refused "
                 "with bad_request")
    max_connections: int = _limit(
        64, "client connections at once; one more is refused with unavailable and closed")
    max_pending_bytes: int = _limit(
        16 << 20, "reply bytes buffered for a client that is not reading; past it the "
                  "connection is closed and its requests cancelled")
    idle_timeout_s: int = _limit(
        300, "seconds a connection with nothing in flight may send nothing before it is "
             "closed")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{f.name}={value!r} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """The model a server serves, fixed for its life: its name, vocabulary size, the tokens one
    session can hold (`max_model_len`), its tokenizer (None: token ids only) and chat template
    (None: none; cp_runtime.serving.http.chat_template)."""

    name: str
    vocab_size: int
    max_model_len: int
    tokenizer: Any = None
    chat_template: Any = None


@dataclasses.dataclass(frozen=True)
class OpenedSession:
    """The session a run goes on in (`Backend.open_session`): its id, whether it lives on past
    the run (`lives_on`: a session named or asked for; else an ephemeral one, a prefix-cache
    entry afterwards or closed), and how many of the prompt's tokens it held already
    (`cached`)."""

    id: str
    lives_on: bool
    cached: int = 0


class Backend(Protocol):
    """What the HTTP door needs of the server, and nothing more."""

    limits: ServerLimits
    served: ServedModel
    strict_fields: bool                 # refuse request fields no endpoint knows (else ignore)

    @property
    def requires_auth(self) -> bool:
        """Whether requests must carry the server's token."""

    def authorized(self, token) -> bool:
        """Whether `token` is the server's (compared in constant time); True without one."""

    @property
    def restoring(self) -> int:
        """Sessions whose cache is being rebuilt, as published after the last step: read at
        once, never waiting for a step (a health probe)."""

    async def stats(self) -> dict:
        """The engine's figures (Engine.stats()) and `restoring`, read between two steps."""

    def request_events(self, request: Extend | Generate) -> AsyncIterator:
        """Submit an engine request and yield its events up to its Done; a Failed event raises
        (as the error code it carries)."""

    async def open_session(self, prompt_ids: Sequence[int], *, session: str | bool | None,
                           continue_at: int | None, reserve_tokens: int,
                           check_held: Callable[[int], None]) -> OpenedSession:
        """The session a run of `prompt_ids` goes on in. `session`: a session's id continues
        it, in place (`continue_at` None) or, from `continue_at` tokens, in a fork when it has
        moved on since; True opens a session that lives on; None an ephemeral one. A new
        session forks the live session holding the longest cached prefix of the prompt (or
        starts empty), with room for `reserve_tokens`. `check_held(tokens the session holds
        already)` runs first, before anything changes: what it raises refuses the run (a
        prompt that can never fit). A new session past `max_sessions` is refused
        (`capacity`)."""

    async def fork_ephemeral(self, session_id: str, count: int) -> list[str]:
        """`count` ephemeral forks of a session, all or none (`capacity` past max_sessions)."""

    def end_run(self, *, generations: Sequence, forks: Sequence[str], ephemeral: str | None,
                retain: bool, kept: str | None) -> Awaitable[int | None]:
        """End a run: cancel its `generations` (request ids; nothing for one that is done),
        close its `forks`, keep its `ephemeral` session as a prefix-cache entry (`retain`) or
        close it, and read the length of the `kept` session (None when it is gone). Handed to
        the device thread before this returns, and shielded: cancelling the awaitable (a
        client that left) does not cancel the work."""

    async def close_session(self, session_id: str, *, holding: int = 0) -> bool:
        """Close a session that holds at least `holding` tokens; False, changing nothing, when
        it holds fewer (NotFound when there is no such session)."""
