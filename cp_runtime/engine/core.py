"""The engine: sessions (token log + page table), requests in, one device step at a time out.

    engine.submit(Extend(...)) / engine.submit(Generate(...))   queue work (checked first)
    events = engine.step()                                      one device step -> events

Every host-side decision (pages, positions, padding, batch composition, sampling seeds) is made
here, once, and handed to the executor as a plan of `Segment`s, so multi-process workers stay
in lockstep. A session's token log is the source of truth; its KV is derived data.

Cache state: `kv_len` tokens of a session's log are in the cache, and `kv_len` is `length` or
`length - 1`. A generation step always runs the log's last token at position `length - 1` and
samples the next; the sampled token joins the log and is written by the following step. So a
generation leaves its last token unwritten (the next extend or generation writes it), and a
generation that starts on a fully written session writes its last token a second time, with
the same value: that costs one token and needs no saved logits. `PageAllocator.fork` never
shares a session's last page, so neither write touches a page another session reads.

Admission: an extend reserves the pages of all its tokens and a generation those of
`max_tokens`, when submitted; a request that does not fit changes nothing and raises
`ContextTooLong` when the session's tokens plus the request's pass `max_model_len` (at most the
whole pool; no wait can make it fit), else `PoolBusy` (other sessions hold the pages; retryable),
both `CapacityError`s, their messages in tokens. A finished generation gives back the pages it
did not use. An extend that would take
the queued prefill tokens past the scheduler's bound raises `Overloaded`; unless the runtime
sets `max_queued_tokens`, the bound follows the measured prefill rate: AUTO_QUEUE_S seconds of
it (at least 16 chunks), so a refused client would otherwise have waited longer than that.

Durability: every change of a token log goes to the `journal` (a store under a state
directory, or nothing) before the engine applies it: an extend's tokens before they join the
session, a step's sampled tokens before any of them is acknowledged. A journal call that fails
raises StorageFailed having changed nothing, and the engine then leaves its sessions, pages
and queue as they were (the generations of a step whose tokens could not be stored end with
`storage`; the prefill in the same step goes on). A failed device step gets the executor a
fresh pool and rebuilds every session's cache from its log (docs/state.md); `restore_session`
does the same for sessions read back after a restart.

Uploads: an extend with `upload_total` begins an upload of that many tokens, sent in several
extends (the server's parts of a long `Session.extend`), all or nothing. Its first part is
admitted for the whole (context, admission queue, and the pages of every token, reserved
then), so a later part cannot fail for room. Its parts join the session and are prefilled as
they come, but the journal gets the upload's tokens only with its last part, in one record;
until then the session takes no other request (but its owner's next part), and is a prefix
source only up to where the upload began. `abort_upload` (a part failed, the client gave up,
its connection closed) puts the session back as it was: its tokens, its cache and its pages;
a crash mid-upload loses nothing acknowledged either, the log never having had the parts.

Prefix reuse (cp_runtime.engine.prefix_cache): `open_cached` gives a stateless request a
fork of the live session holding the longest cached prefix of its prompt; such sessions are
ephemeral (never journaled) and kept afterwards as entries that `_making_room` closes, least
recently used first, whenever an allocation is short of pages.

`extend` and `decode` are the direct path for scoring (benchmarks, tests; engine/direct.py):
they run at once, synchronously, and return logits; they refuse sessions that have queued work.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import time

import numpy as np

from cp_runtime.cache.layout import cdiv, owner_shard
from cp_runtime.cache.pages import CapacityError, PageAllocator, PageCopy, PageTable
from cp_runtime.cache.pool import CacheRows
from cp_runtime.config import ModelConfig, RuntimeConfig, check_runtime_for_model
from cp_runtime.engine.direct import DirectPath
from cp_runtime.engine.executor import Executor
from cp_runtime.engine.journal import DurableOnly, Journal
from cp_runtime.engine.plans import Row, build_segment, sampling_arrays
from cp_runtime.engine.prefix_cache import PrefixCache, PrefixReuse
from cp_runtime.engine.requests import (BadRequest, ContextTooLong, Done, Extend, Failed,
                                        Generate, NotFound, PoolBusy, Progress, StorageFailed,
                                        Token, Unavailable, check_token_ids)
from cp_runtime.engine.scheduler import Batch, ExtendWork, GenerateWork, Scheduler
from cp_runtime.engine.spill import choose_spill, spill_candidates
from cp_runtime.engine.step import Segment
from cp_runtime.kernels.storage import storage_dtype

__all__ = ["Session", "Engine", "StepTiming", "Upload"]

log = logging.getLogger(__name__)
STATS_WINDOW_S = 60.0
AUTO_QUEUE_S = 10.0            # an auto admission bound holds this many seconds of prefill


@dataclasses.dataclass(frozen=True)
class Upload:
    """An open upload: the session held `start` tokens when it began and will hold `end` when
    its last part is in; `owner` sends its parts."""

    owner: object
    start: int
    end: int

    @property
    def total(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class Session:
    """A session's token log, how much of it is in the cache, and its pages."""

    id: str
    table: PageTable
    tokens: list[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0
    busy: object = None            # the id of the request working on it, if any
    durable: bool = True           # journaled (False: a stateless request's, cache entry)
    upload: Upload | None = None   # an upload in progress (its parts are not journaled yet)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def pages(self) -> tuple[int, ...]:
        return self.table.slots


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """One step: when it ended, tokens it wrote, host seconds (planning and applying results)
    and device seconds (the executor's run, transfers included); `first_of_shape`: the first
    step of its program shapes, which compiled (or loaded) them."""

    end: float
    prefill_tokens: int
    decode_tokens: int
    host_s: float
    device_s: float
    first_of_shape: bool = False


class Engine(DirectPath, PrefixReuse):
    """Owns sessions, the allocator and the scheduler; drives an executor with step plans."""

    def __init__(self, model: ModelConfig, runtime: RuntimeConfig, executor: Executor,
                 *, seed: int | None = None, journal: Journal | None = None):
        check_runtime_for_model(model, runtime)
        self.model, self.runtime, self.executor = model, runtime, executor
        self._journal = DurableOnly(journal or Journal())
        self.prefix = PrefixCache(runtime.page_size, runtime.prefix_cache_entries)
        self.allocator = PageAllocator(runtime.num_shards, runtime.pages_per_shard,
                                       runtime.latent_device_pages)
        self.scheduler = Scheduler(chunk_size=runtime.chunk_size, max_batch=runtime.max_batch,
                                   token_budget=runtime.step_token_budget
                                   or runtime.chunk_size + runtime.max_batch,
                                   max_queued_tokens=runtime.admission_bound)
        self.sessions: dict[str, Session] = {}
        self._work: dict[object, ExtendWork | GenerateWork] = {}
        self._rng = np.random.default_rng(seed)
        self.timings: collections.deque[StepTiming] = collections.deque()   # the last minute
        self._window = collections.Counter()         # prefill tokens and their steps' seconds
        self._shapes_seen: set[tuple] = set()         # step shapes run (compiled) so far
        self.totals = collections.Counter()          # steps, tokens, host and device seconds

    @property
    def max_model_len(self) -> int:
        """Tokens one session can hold: runtime.max_model_len, at most every page of the pool
        (`num_shards * pages_per_shard * page_size`; each shard's sentinel page is apart from
        those). A session's tokens plus a request's new and generated ones past it never fit."""
        pool = self.allocator.capacity * self.runtime.page_size
        return min(pool, self.runtime.max_model_len or pool)

    @property
    def journal(self) -> Journal:
        """Where durable sessions' logs go (a store, or nothing)."""
        return self._journal.store

    @journal.setter
    def journal(self, store: Journal) -> None:
        self._journal.store = store

    # -- sessions -------------------------------------------------------------------------
    def create_session(self, durable: bool = True) -> Session:
        """A new empty session with an unguessable id (128 random bits); an ephemeral one
        (not `durable`) is never journaled."""
        session_id = secrets.token_hex(16)
        if durable:
            self._journal.create(session_id)
        else:
            self._journal.ephemeral.add(session_id)
        session = Session(id=session_id, table=self.allocator.new_table(), durable=durable)
        self.sessions[session.id] = session
        return session

    def restore_session(self, session_id: str, tokens: list[int],
                        cache: CacheRows | None = None) -> Session:
        """Bring back a session from its token log (after a restart): its pages are reserved
        now; the cached rows of its first tokens, if given (a snapshot, from a pool of any
        shard count), are written at once, and the rest of its cache is rebuilt by a prefill
        queued like any other work. Until that is done its requests are refused as
        `unavailable` (retryable). Its token ids are checked as an extend's are."""
        if session_id in self.sessions:
            raise BadRequest(f"session {session_id} already exists")
        if len(tokens):
            check_token_ids(np.asarray(tokens, np.int64), self.model.vocab_size)
        if cache is not None:
            self._check_rows(cache)
        session = Session(id=session_id, table=self.allocator.new_table())
        self._reserve(session, len(tokens))
        session.tokens = np.asarray(tokens, np.int64).tolist()
        self.sessions[session_id] = session
        cached = 0
        if cache is not None and len(tokens):
            cached = min(cache.num_tokens, len(tokens))
            self.executor.write_rows(*self._locations(session, cached),
                                     CacheRows(latent=cache.latent[:, :cached],
                                               indexer=cache.indexer[:, :cached]))
        self._queue_restore(session, start=cached)
        return session

    def export_session(self, session_id: str) -> tuple[list[int], CacheRows]:
        """An idle session's token log and the cached rows of its first `kv_len` tokens."""
        session = self._idle(session_id)
        return list(session.tokens), self.executor.read_rows(*self._locations(
            session, session.kv_len))

    def _locations(self, session: Session, count: int) -> tuple[np.ndarray, ...]:
        """(shard, slot, offset) i32[count] of a session's first `count` tokens."""
        ps = self.runtime.page_size
        page = np.arange(count) // ps
        shard = owner_shard(page, self.runtime.num_shards, session.table.rotation)
        slot = session.table.slot_array[page]
        return shard.astype(np.int32), slot, (np.arange(count) % ps).astype(np.int32)

    def _check_rows(self, rows: CacheRows) -> None:
        spec = self.executor.pool_spec
        want = ((self.model.num_hidden_layers, self.model.latent_dim,
                 storage_dtype(spec.latent_dtype)),
                (self.model.num_full_layers, self.model.index_head_dim,
                 storage_dtype(spec.indexer_dtype)))
        for name, arr, (layers, dim, dtype) in zip(("latent", "indexer"),
                                                   (rows.latent, rows.indexer), want):
            if arr.ndim != 3 or (arr.shape[0], arr.shape[2], arr.dtype) != (layers, dim, dtype):
                raise BadRequest(f"cached {name} rows {arr.dtype}{list(arr.shape)} do not fit "
                                 f"this pool ({np.dtype(dtype)}[{layers}, N, {dim}])")

    def _queue_restore(self, session: Session, start: int = 0) -> None:
        """Rebuild a session's cache from its log past `start`: an internal extend."""
        session.kv_len = start
        if session.length == start:
            return
        request = Extend(id=("restore", session.id), session=session.id,
                         tokens=np.asarray(session.tokens[start:], np.int32))
        work = ExtendWork(request=request, session=session, target=session.length)
        session.busy = request.id
        self._work[request.id] = work
        self.scheduler.add(work)

    @property
    def open_sessions(self) -> int:
        """Sessions but the prefix cache's entries (which make way for others)."""
        return len(self.sessions) - len(self.prefix.entries)

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise NotFound(f"no session {session_id!r}")
        return session

    def _idle(self, session_id: str, upload: object = None) -> Session:
        """The session, idle; `upload`: the owner of its open upload may send the next part."""
        session = self.get(session_id)
        if self._restoring(session):
            raise Unavailable(f"session {session_id} is being restored from its token log; "
                              "retry in a moment")
        if session.busy is not None:
            raise BadRequest(f"session {session_id} is busy with request {session.busy!r}; "
                             "one request per session at a time")
        up = session.upload
        if up is not None and (upload is None or upload != up.owner):
            raise BadRequest(f"session {session_id} is busy with an upload of {up.total:,} "
                             f"tokens ({session.length - up.start:,} sent); one request per "
                             "session at a time")
        return session

    @property
    def restoring_sessions(self) -> int:
        """Sessions whose cache is being rebuilt from their logs (their queued restores)."""
        return sum(isinstance(k, tuple) and k[:1] == ("restore",) for k in self._work)

    @staticmethod
    def _restoring(session: Session) -> bool:
        return isinstance(session.busy, tuple) and session.busy[:1] == ("restore",)

    def close_session(self, session_id: str) -> list:
        """Free a session's pages. Its queued or running request, if any, ends: the returned
        events say so."""
        session = self.get(session_id)
        self._journal.close(session_id)
        self.prefix.forget(session_id)
        events = []
        if session.busy is not None:
            events.append(Failed(request=session.busy, code="not_found",
                                 message=f"session {session_id} was closed"))
            self._drop(self._work[session.busy])
        self.allocator.free(session.table)
        del self.sessions[session_id]
        return events

    def fork(self, session_id: str, length: int | None = None,
             durable: bool = True) -> Session:
        """A new session with the parent's log (its first `length` tokens), sharing the
        parent's full pages. Without `length` the parent must be idle; with it, it may be
        busy, as long as `length` is at most one past its cached tokens (the pages shared are
        written and stay as they are; the child writes its own last page)."""
        if length is None:
            parent = self._idle(session_id)
            length = parent.length
        else:
            parent = self.get(session_id)
            if self._restoring(parent):
                self._idle(session_id)                  # raises Unavailable
            if not 0 < length <= min(parent.length, parent.kv_len + 1):
                raise BadRequest(f"cannot fork session {session_id} at {length}: it holds "
                                 f"{parent.length} tokens, {parent.kv_len} cached")
            if parent.upload is not None and length > parent.upload.start:
                raise BadRequest(f"cannot fork session {session_id} at {length}: it is busy "
                                 f"with an upload that began at {parent.upload.start}")
        table, copy = self._making_room(
            lambda: self.allocator.fork(parent.table, length, self.runtime.page_size),
            keep=parent.id, need=self.runtime.page_size,
            what="a copy of the parent's last page")
        child_id = secrets.token_hex(16)
        if not durable:
            self._journal.ephemeral.add(child_id)
        try:
            self._journal.fork(parent.id, child_id, parent.tokens[:length])
        except StorageFailed:
            self.allocator.free(table)
            raise
        if copy is not None:
            self.executor.copy_pages(*_copy_arrays([copy]))
        child = Session(id=child_id, table=table, tokens=parent.tokens[:length],
                        kv_len=min(parent.kv_len, length), durable=durable)
        self.sessions[child.id] = child
        return child

    def info(self, session_id: str) -> dict:
        session = self.get(session_id)
        per_shard = np.bincount(session.table.shards(self.runtime.num_shards),
                                minlength=self.runtime.num_shards)
        return {"session": session.id, "length": session.length, "cached": session.kv_len,
                "pages": len(session.table), "pages_per_shard": per_shard.tolist(),
                "start_shard": session.table.rotation, "busy": session.busy is not None,
                "restoring": self._restoring(session)}

    # -- requests -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def submit(self, request: Extend | Generate) -> None:
        """Queue a request, or raise (BadRequest, NotFound, CapacityError, Overloaded,
        StorageFailed) changing nothing."""
        if request.id in self._work:
            raise BadRequest(f"request id {request.id!r} is already in use")
        owner = request.upload if isinstance(request, Extend) else None
        session = self._idle(request.session, upload=owner)
        if isinstance(request, Extend):
            work = self._admit_extend(session, request)
        elif isinstance(request, Generate):
            work = self._admit_generate(session, request)
        else:
            raise BadRequest(f"unknown request type {type(request).__name__}")
        session.busy = request.id
        self._work[request.id] = work
        self.scheduler.add(work)

    def _admit_extend(self, session: Session, request: Extend) -> ExtendWork:
        ids = check_token_ids(request.tokens, self.model.vocab_size).tolist()
        total = request.upload_total
        if session.upload is not None:
            self._upload_part(session, request, ids)
        elif total is not None and total != len(ids):
            self._begin_upload(session, request, ids)
        else:
            self._check_context(session, len(ids), what="this extend")
            self.scheduler.check_room(len(ids))
            self._append(session, ids)
        self._prompt_to_device(session)
        return ExtendWork(request=request, session=session, target=session.length)

    def _check_context(self, session: Session, added: int, generated: int = 0, *,
                       what: str) -> None:
        """Raise ContextTooLong if the session's tokens plus `added` and `generated` pass
        `max_model_len`."""
        limit, held = self.max_model_len, session.length
        total = held + added + generated
        if total <= limit:
            return
        asks = (f"{what} adds {added:,}: {total:,} tokens" if added else
                f"{what} would take it to {total:,} tokens")
        hint = f"; ask for at most {limit - held:,}" if generated and held < limit else ""
        raise ContextTooLong(
            f"context length exceeded: session {session.id} holds {held:,} tokens and {asks}, "
            f"over the {limit:,} one session can hold (max_model_len)"
            f"{hint}; nothing changed", limit=limit, held=held, added=added,
            generated=generated)

    def _begin_upload(self, session: Session, request: Extend, ids: list[int]) -> None:
        """The first part of an upload: admitted for the whole upload (its context, the
        admission queue, the pages of all its tokens), then applied unjournaled."""
        total = request.upload_total
        if not (isinstance(total, int) and not isinstance(total, bool) and total > len(ids)):
            raise BadRequest(f"upload={total!r} must be an integer, the upload's tokens in all "
                             f"(at least this extend's {len(ids)})")
        if request.upload is None:
            raise BadRequest("an upload needs an owner to send its parts")
        self._check_context(session, total, what=f"this upload of {total:,} tokens")
        self.scheduler.check_room(len(ids))
        self._reserve(session, session.length + total, need=total)
        session.upload = Upload(owner=request.upload, start=session.length,
                                end=session.length + total)
        session.tokens.extend(ids)

    def _upload_part(self, session: Session, request: Extend, ids: list[int]) -> None:
        """A later part of the session's open upload (its pages are reserved, the admission
        queue took the upload already); the last one journals the whole upload."""
        up = session.upload
        left = up.end - session.length
        if request.upload_total is not None:
            raise BadRequest(f"session {session.id} has an upload open already: send its "
                             f"{left:,} remaining tokens, or abort it")
        if len(ids) > left:
            raise BadRequest(f"this part of {len(ids):,} tokens overshoots the upload: "
                             f"{left:,} of its {up.total:,} tokens remain")
        if len(ids) == left:                 # the last part: the upload joins the log
            self._journal.append({session.id: session.tokens[up.start:] + ids})
            session.upload = None
        session.tokens.extend(ids)

    def abort_upload(self, session_id: str, owner: object) -> tuple[list, int | None]:
        """Undo the session's open upload if `owner` owns it: (events for a part that was
        running, the session's length now), or ([], None) when there is none to undo (no
        such session, no upload, another owner's)."""
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.upload is None or session.upload.owner != owner:
            return [], None
        return self._undo_upload(session), session.length

    def abort_uploads(self, owner: object) -> list:
        """Undo every open upload `owner` owns (its connection closed)."""
        events = []
        for session in list(self.sessions.values()):
            if session.upload is not None and session.upload.owner == owner:
                events += self._undo_upload(session)
        return events

    def _undo_upload(self, session: Session) -> list:
        """The session as it was when its upload began: its tokens, its cache (`kv_len`; rows
        written past it are never read) and its pages. A running part ends (the returned
        event); a restore under way (a failed step) starts again from what is left."""
        up, session.upload = session.upload, None
        restoring = self._restoring(session)
        events = []
        if session.busy is not None:
            if not restoring:
                events.append(Failed(request=session.busy, code="bad_request",
                                     message=f"the upload into session {session.id} was "
                                             "aborted"))
            self._drop(self._work[session.busy])
        del session.tokens[up.start:]
        self.prefix.truncate(session.id, up.start)
        session.kv_len = min(session.kv_len, up.start)
        keep = cdiv(up.start, self.runtime.page_size)
        if len(session.table) > keep:
            session.table = self.allocator.shrink(session.table, keep)
        if restoring:
            self._queue_restore(session, start=session.kv_len)
        return events

    def _prompt_to_device(self, session: Session) -> None:
        """Put an admitted prompt's unwritten pages in HBM where the pool holds some of its
        pages there (`latent_device_pages`), moving the pages of sessions not being prefilled
        to the host to make room (cp_runtime.engine.spill). A spill that fails leaves every
        page where it was, and the prompt runs from the host."""
        if not self.allocator.device_pages:
            return
        first = cdiv(session.kv_len, self.runtime.page_size)   # pages holding nothing yet
        need = self.allocator.unwritten_on_host(session.table, first)
        prefilling = {w.session.id for w in self._work.values() if isinstance(w, ExtendWork)}
        victims = choose_spill(self.allocator,
                               spill_candidates(self.sessions.values(), session.id, prefilling),
                               need)
        if victims:
            tables, copies = self.allocator.to_host([v.table for v in victims])
            try:
                self.executor.copy_pages(*_copy_arrays(copies))
            except Exception:           # noqa: BLE001 - the request stands either way
                log.exception("spilling %d sessions' pages to the host failed", len(victims))
                self.allocator.undo_to_host(copies)
            else:
                for victim, table in zip(victims, tables):
                    victim.table = table
                self.totals["pages_spilled"] += len(copies)
        session.table = self.allocator.to_device(session.table, first)

    def _admit_generate(self, session: Session, request: Generate) -> GenerateWork:
        if session.length == 0:
            raise BadRequest(f"session {session.id} is empty: extend it before generating")
        max_tokens = request.sampling.max_tokens
        request.sampling.check_vocab(self.model.vocab_size)
        self._check_context(session, 0, max_tokens, what=f"max_tokens={max_tokens:,}")
        # Steps write positions length - 1 ... length + max_tokens - 2.
        self._reserve(session, session.length + max_tokens - 1, need=max_tokens)
        seed = request.sampling.seed
        if seed is None:
            seed = int(self._rng.integers(0, 2 ** 32))
        return GenerateWork(request=request, session=session, seed=seed)

    def _append(self, session: Session, ids: list[int]) -> None:
        """Reserve pages for `ids`, store them in the journal, then add them to the session;
        CapacityError or StorageFailed change nothing."""
        table = session.table
        self._reserve(session, session.length + len(ids))
        try:
            self._journal.append({session.id: ids})
        except StorageFailed:
            self._unreserve(session, table)
            raise
        session.tokens.extend(ids)

    def _unreserve(self, session: Session, table: PageTable) -> None:
        """Give back what `_reserve` took: the session's table is `table` again."""
        session.table = self.allocator.shrink(session.table, len(table))
        session.table = table

    def _reserve(self, session: Session, tokens: int, need: int | None = None) -> None:
        """Grow the session's table to hold `tokens` tokens (atomic: ContextTooLong past
        `max_model_len`, PoolBusy when other sessions hold the pages; both change nothing).
        `need`: the request's tokens, for the message (default: the growth)."""
        if tokens > self.max_model_len:
            self._check_context(session, tokens - session.length, what="this request")
        want = cdiv(tokens, self.runtime.page_size)
        if want > len(session.table):
            # A session's start shard is picked when it first takes pages, so sessions created
            # together still spread out.
            table = session.table if len(session.table) else self.allocator.new_table()
            session.table = self._making_room(
                lambda: self.allocator.grow(table, want), keep=session.id,
                need=tokens - session.length if need is None else need)

    def _making_room(self, allocate, keep: str, need: int, what: str = "this request"):
        """allocate(), closing idle prefix-cache entries but `keep` (least recently used
        first) while the pool is short of pages; then PoolBusy, saying `need` tokens."""
        while True:
            try:
                return allocate()
            except CapacityError as e:
                victim = self.prefix.evictable(self.sessions, keep=keep)
                if victim is None:
                    raise self.pool_busy(need, keep, e, what=what) from None
                self.close_session(victim)

    def pool_busy(self, need: int, keep: str | None, error: CapacityError, *,
                  spare_pages: int = 0, what: str = "this request") -> PoolBusy:
        """The retryable refusal of a request short of pages, in tokens and sessions: what it
        needs, what is free (with `spare_pages` that closing idle prefix-cache entries would
        free), and how many other sessions hold the rest."""
        ps = self.runtime.page_size
        free = (self.allocator.num_free() + spare_pages) * ps
        others = sum(1 for s in self.sessions.values() if s.id != keep and len(s.table) and (
            s.id not in self.prefix.entries or s.busy is not None))   # idle entries make way
        where = ("" if need > free else
                 ", but not on every shard its pages go to (a session's pages go round the "
                 "shards, and some are full)")
        held = ("1 other session holds the rest" if others == 1 else
                f"{others} other sessions hold the rest" if others else
                "requests in flight hold the rest")
        return PoolBusy(f"the KV pool is full for now: {what} needs room for {need:,} tokens "
                        f"and the pool has {free:,} tokens free{where}; {held}; retry later",
                        requested=error.requested, free=error.free)

    def cancel(self, request_id: object) -> None:
        """Stop a queued or running request (its client went away); no event follows."""
        work = self._work.get(request_id)
        if work is not None:
            self._drop(work)

    def _drop(self, work: ExtendWork | GenerateWork) -> None:
        self.scheduler.remove(work)
        self._finish(work)

    def _finish(self, work: ExtendWork | GenerateWork) -> None:
        """Release a request: the session is idle again and unused pages go back."""
        del self._work[work.request.id]
        session = work.session
        session.busy = None
        up = session.upload                      # an open upload keeps its pages reserved
        keep = cdiv(up.end if up is not None else session.length, self.runtime.page_size)
        if len(session.table) > keep:
            session.table = self.allocator.shrink(session.table, keep)

    # -- steps ----------------------------------------------------------------------------
    def step(self) -> list:
        """Run one device step of the scheduler's next batch; returns its events."""
        t0 = time.perf_counter()
        batch = self.scheduler.next_batch()
        if not batch:
            return []
        segments = self._segments(batch)
        t1 = time.perf_counter()
        try:
            outputs = self.executor.run(tuple(segments))
        except Exception as e:          # noqa: BLE001 - every request in the step must hear
            log.exception("step failed")
            return self._recover(e)
        t2 = time.perf_counter()
        events = self._apply(batch, outputs)
        t3 = time.perf_counter()
        shape = tuple((seg.kind, seg.inputs.tokens.shape, seg.inputs.page_table.shape,
                       seg.in_hbm, seg.sampling and seg.sampling.variant)
                      for seg in segments)                 # what a program is compiled for
        first = shape not in self._shapes_seen
        self._shapes_seen.add(shape)
        self._record(StepTiming(end=t3, prefill_tokens=batch.prefill_tokens,
                                decode_tokens=len(batch.decodes), host_s=(t1 - t0) + (t3 - t2),
                                device_s=t2 - t1, first_of_shape=first))
        return events

    def _segments(self, batch: Batch) -> list[Segment]:
        segments = []
        if batch.decodes:
            rows = [Row(w.session.table, [w.session.tokens[-1]], w.session.length - 1)
                    for w in batch.decodes]
            sampling = sampling_arrays([w.request.sampling for w in batch.decodes],
                                       [w.seed for w in batch.decodes],
                                       [w.produced for w in batch.decodes],
                                       [w.session.tokens for w in batch.decodes])
            segments.append(self._segment("sample", rows, sampling=sampling))
        if batch.prefill is not None:
            s = batch.prefill.session
            rows = [Row(s.table, s.tokens[s.kv_len: s.kv_len + batch.prefill_tokens], s.kv_len)]
            segments.append(self._segment("fill", rows, width=self.runtime.chunk_size))
        return segments

    def _segment(self, kind: str, rows: list[Row], **kw) -> Segment:
        return build_segment(kind, rows, page_size=self.runtime.page_size,
                             num_shards=self.runtime.num_shards,
                             sentinel=self.allocator.sentinel,
                             hbm_pages=self.allocator.device_pages, **kw)

    def _apply(self, batch: Batch, outputs: list) -> list:
        events: list = []
        if batch.decodes:
            tokens, logprobs = outputs[0]
            top_ids = top_lps = None
            if tokens.ndim == 2:        # the sampled token, then the most likely ids
                tokens, top_ids, logprobs, top_lps = (tokens[:, 0], tokens[:, 1:],
                                                      logprobs[:, 0], logprobs[:, 1:])
            try:                        # stored before any of them is acknowledged
                self._journal.append({w.session.id: [int(tokens[i])]
                                     for i, w in enumerate(batch.decodes)})
            except StorageFailed as e:
                events += self._end_unstored(batch.decodes, e)
            else:
                for i, work in enumerate(batch.decodes):
                    k = work.request.sampling.top_logprobs
                    top = () if not k or top_ids is None else tuple(
                        zip(top_ids[i, :k].tolist(), top_lps[i, :k].tolist()))
                    events += self._advance_generation(work, int(tokens[i]),
                                                       float(logprobs[i]), top)
        if batch.prefill is not None:
            events += self._advance_extend(batch.prefill, batch.prefill_tokens)
        return events

    def _end_unstored(self, decodes: tuple[GenerateWork, ...], error: StorageFailed) -> list:
        """The step's sampled tokens could not be stored: they are dropped, and these
        generations end with `storage` (their earlier tokens stay, acknowledged)."""
        events = []
        for work in decodes:
            work.session.kv_len = work.session.length    # the step wrote the last token
            self.scheduler.remove(work)
            self._finish(work)
            events.append(Failed(request=work.request.id, code=error.code,
                                 message=str(error)))
        return events

    def _advance_generation(self, work: GenerateWork, token: int, logprob: float,
                            top: tuple = ()) -> list:
        session, params = work.session, work.request.sampling
        session.kv_len = session.length            # the step wrote the log's last token
        session.tokens.append(token)
        work.produced += 1
        events = [Token(request=work.request.id, token=token, logprob=logprob,
                        index=work.produced - 1, top=top)]
        reason = ("stop" if token in params.stop and work.produced > params.min_tokens else
                  "length" if work.produced >= params.max_tokens else None)
        if reason is not None:
            self.scheduler.remove(work)
            self._finish(work)
            events.append(Done(request=work.request.id,
                               info={"length": session.length, "tokens": work.produced,
                                     "finish_reason": reason}))
        return events

    def _advance_extend(self, work: ExtendWork, n: int) -> list:
        session = work.session
        session.kv_len += n
        total = len(work.request.tokens)
        done = total - (work.target - session.kv_len)
        events = [Progress(request=work.request.id, done=done, total=total)]
        if session.kv_len == work.target:
            self.scheduler.remove(work)
            self._finish(work)
            events.append(Done(request=work.request.id, info={"length": session.length}))
        return events

    def fail_all(self, code: str, message: str) -> list:
        """End every queued or running request with an error event (shutdown, a broken
        engine); sessions stay, idle."""
        work = self.scheduler.work()
        for w in work:
            self._drop(w)
        return [Failed(request=w.request.id, code=code, message=message) for w in work]

    def _recover(self, error: Exception) -> list:
        """A step failed, and the pool it was given may be gone (donated): get a fresh pool,
        end every request with a retryable `unavailable`, and rebuild every session's cache
        from its token log (queued prefills; token logs and page tables are untouched)."""
        self.executor.rebuild()
        events = self.fail_all("unavailable", f"a device step failed ({type(error).__name__}: "
                                              f"{error}); the cache is being rebuilt, retry")
        for session_id in list(self.prefix.entries):     # a cache, not worth rebuilding
            self.close_session(session_id)
        for session in self.sessions.values():
            self._queue_restore(session)
        return events

    def _record(self, timing: StepTiming) -> None:
        self.totals.update(steps=1, prefill_tokens=timing.prefill_tokens,
                           decode_tokens=timing.decode_tokens, host_s=timing.host_s,
                           device_s=timing.device_s)
        self.timings.append(timing)
        self._count_prefill(timing, 1)
        while self.timings and self.timings[0].end < timing.end - STATS_WINDOW_S:
            self._count_prefill(self.timings.popleft(), -1)
        if self.runtime.max_queued_tokens is None:
            self.scheduler.max_queued_tokens = self._auto_bound()

    def _count_prefill(self, timing: StepTiming, sign: int) -> None:
        if timing.prefill_tokens and not timing.first_of_shape:     # compiles are not a rate
            self._window.update(tokens=sign * timing.prefill_tokens,
                                seconds=sign * (timing.host_s + timing.device_s))

    def _auto_bound(self) -> int:
        """AUTO_QUEUE_S seconds of the last minute's prefill rate (steps with a prefill chunk,
        their decode rows included: a conservative rate; not a shape's first step, which
        compiled), at least 16 chunks."""
        seconds = self._window["seconds"]
        rate = self._window["tokens"] / seconds if seconds > 0 else 0.0
        return max(self.runtime.admission_bound, int(rate * AUTO_QUEUE_S))

    def stats(self) -> dict:
        """Pool pages per shard, sessions, and tokens/s and step time split over the last
        minute."""
        now = time.perf_counter()
        recent = [t for t in self.timings if t.end >= now - STATS_WINDOW_S]
        span = (now - recent[0].end + recent[0].host_s + recent[0].device_s) if recent else 0.0
        tokens = sum(t.prefill_tokens + t.decode_tokens for t in recent)
        return {
            "sessions": self.open_sessions,
            "prefix_cache": self.prefix.stats(),
            "requests": len(self._work),
            "queued_prefill_tokens": self.scheduler.queued_tokens,
            "max_queued_tokens": self.scheduler.max_queued_tokens,     # 0: no bound
            "pages_used_per_shard": self.allocator.used_per_shard(),
            "pages_per_shard": self.runtime.pages_per_shard,
            **({"hbm_pages_free_per_shard": self.allocator.free_device_per_shard()}
               if self.allocator.device_pages else {}),
            "executor": self.executor.stats(self.allocator.used_per_shard()),
            "steps_last_minute": len(recent),
            "tokens_per_s": tokens / span if span > 0 else 0.0,
            "prefill_tokens_last_minute": sum(t.prefill_tokens for t in recent),
            "decode_tokens_last_minute": sum(t.decode_tokens for t in recent),
            "host_s_last_minute": sum(t.host_s for t in recent),
            "device_s_last_minute": sum(t.device_s for t in recent),
            **{f"{name}_total": value for name, value in self.totals.items()},
        }


def _copy_arrays(copies: list[PageCopy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, src, dst) i32[N] of `copies`, as `Executor.copy_pages` takes them."""
    return tuple(np.asarray([getattr(c, f) for c in copies], np.int32).reshape(-1)
                 for f in ("shard", "src", "dst"))
