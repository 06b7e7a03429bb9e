"""Prefix reuse for stateless requests: the longest cached prefix of a prompt among the live
sessions, and the sessions kept after stateless requests as cache entries.

Index. Every live session's full pages of tokens are indexed by a chained hash: page i's is
blake2b-128 of page i - 1's hash and page i's token ids (int32 bytes), so equal hashes mean equal
prefixes, not merely equal pages (a collision of a 128-bit hash is the only way to a wrong
match). A session's log only grows (but for an undone upload, which `truncate`s its chain),
so a full page's hash never changes; the index catches up with each session's new pages at
each lookup, and each page is hashed once.

Lookup. The prompt's full pages are hashed in turn while some live session holds the same
chain; the match then goes on token by token into the next page, and is capped at what the
source has in its cache (its `kv_len`, plus the one unwritten token `Engine.fork` allows), and
for a session with an upload open, at where the upload began (an upload can be undone).

Entries. A stateless request's session is ephemeral (never journaled: it is gone after a
restart) and, once the request is done, retained here, least recently used first. The engine
closes the least recently used idle entry when the pool is short of pages, and when there are
more than `max_entries`. Forks from an entry share its full pages, so ten requests about one
document hold the document's pages once.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from cp_runtime.cache.layout import cdiv, shard_demand
from cp_runtime.cache.pages import CapacityError
from cp_runtime.engine.requests import ContextTooLong

__all__ = ["PrefixCache", "PrefixReuse"]

MIN_REUSE_PAGES = 1        # a match shorter than one full page is not worth a fork


def _page_hash(previous: bytes, page: np.ndarray) -> bytes:
    return hashlib.blake2b(previous + page.tobytes(), digest_size=16).digest()


class PrefixCache:
    """The index of live sessions' pages and the LRU order of retained entries."""

    def __init__(self, page_size: int, max_entries: int):
        self.page_size, self.max_entries = page_size, max_entries
        self.entries: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._chains: dict[str, list[bytes]] = {}           # session -> its full pages' hashes
        self._holders: dict[bytes, dict[str, None]] = {}    # page hash -> sessions holding it
        self.hits = 0
        self.cached_tokens = 0                               # prompt tokens reused, in all

    # -- index ------------------------------------------------------------------------------
    def _catch_up(self, sessions: dict) -> None:
        ps = self.page_size
        for session_id, session in sessions.items():
            chain = self._chains.setdefault(session_id, [])
            full = session.length // ps
            if full <= len(chain):
                continue
            new = np.asarray(session.tokens[len(chain) * ps: full * ps], np.int32)
            previous = chain[-1] if chain else b""
            for page in new.reshape(-1, ps):
                previous = _page_hash(previous, page)
                chain.append(previous)
                self._holders.setdefault(previous, {})[session_id] = None

    def forget(self, session_id: str) -> None:
        """A session is gone: drop its pages from the index and it from the entries."""
        self.entries.pop(session_id, None)
        for h in self._chains.pop(session_id, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(session_id, None)
                if not holders:
                    del self._holders[h]

    def truncate(self, session_id: str, length: int) -> None:
        """A session's log was cut back to `length` tokens (an undone upload): drop its pages
        past that from the index."""
        chain = self._chains.get(session_id)
        if chain is None:
            return
        keep = length // self.page_size
        for h in chain[keep:]:
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(session_id, None)
                if not holders:
                    del self._holders[h]
        del chain[keep:]

    def longest(self, sessions: dict, prompt: np.ndarray) -> tuple[object | None, int]:
        """(the live session holding the longest cached prefix of `prompt` i32[N], its
        length), or (None, 0) under MIN_REUSE_PAGES full pages. Restoring sessions are not
        sources (their cache is being rebuilt)."""
        self._catch_up(sessions)
        prompt = np.asarray(prompt, np.int32)
        ps, previous, holders, depth = self.page_size, b"", {}, 0
        for page in prompt[: len(prompt) // ps * ps].reshape(-1, ps):
            previous = _page_hash(previous, page)
            found = self._holders.get(previous)
            if not found:
                break
            holders, depth = found, depth + 1
        best, best_len = None, 0
        for session_id in holders:               # each holds the prompt's first `depth` pages
            source = sessions[session_id]
            if isinstance(source.busy, tuple) and source.busy[:1] == ("restore",):
                continue
            match = self._match(source, prompt, depth * ps)
            if match > best_len:
                best, best_len = source, match
        if best_len < MIN_REUSE_PAGES * ps:
            return None, 0
        return best, best_len

    def _match(self, source, prompt: np.ndarray, start: int) -> int:
        """Tokens of `prompt` that `source` holds cached, given it holds the first `start`:
        the next page is compared token by token, and the match capped at its cache."""
        tail_source = np.asarray(source.tokens[start: start + self.page_size], np.int32)
        tail_prompt = prompt[start: start + self.page_size]
        n = min(len(tail_source), len(tail_prompt))
        same = tail_source[:n] == tail_prompt[:n]
        extra = n if same.all() else int(np.argmin(same))
        upload = getattr(source, "upload", None)     # its parts may yet be undone
        end = source.length if upload is None else upload.start
        return min(start + extra, source.kv_len + 1, end, len(prompt))

    # -- entries ----------------------------------------------------------------------------
    def retain(self, session_id: str) -> None:
        """Keep a finished stateless request's session, most recently used."""
        self.entries[session_id] = None
        self.entries.move_to_end(session_id)

    def used(self, session_id: str, tokens: int) -> None:
        """`tokens` of a prompt came from this session's cache."""
        if session_id in self.entries:
            self.entries.move_to_end(session_id)
        self.hits += 1
        self.cached_tokens += tokens

    def evictable(self, sessions: dict, keep: str | None = None) -> str | None:
        """The least recently used idle entry other than `keep`, or None."""
        for session_id in self.entries:
            if session_id != keep and sessions[session_id].busy is None:
                return session_id
        return None

    def reclaimable(self, sessions: dict, allocator, keep: str | None = None) -> list[int]:
        """Pages per shard that closing every idle entry but `keep` would free: those the
        entries alone hold."""
        holds = collections.Counter()
        for session_id in self.entries:
            session = sessions[session_id]
            if session_id != keep and session.busy is None:
                holds.update(zip(session.table.shards(allocator.num_shards).tolist(),
                                 session.table.slots))
        spare = [0] * allocator.num_shards
        for (shard, slot), n in holds.items():
            if allocator.refcount(shard, slot) == n:
                spare[shard] += 1
        return spare

    def stats(self) -> dict:
        return {"entries": len(self.entries), "hits": self.hits,
                "cached_tokens": self.cached_tokens, "indexed_sessions": len(self._chains)}


class PrefixReuse:
    """The engine's side of prefix reuse (a mixin of cp_runtime.engine.core.Engine, whose
    sessions, allocator and `prefix` cache it uses): open a request's session from the
    longest cached prefix, and keep it afterwards."""

    def open_cached(self, prompt: np.ndarray, total_tokens: int,
                    durable: bool = False) -> tuple[object, int]:
        """A session for a request whose prompt i32[N] and generation take `total_tokens`
        (ephemeral unless `durable`): a fork of the live session holding the longest cached
        prefix of the prompt (its full pages shared), or a new session. Returns it and how
        many prompt tokens it holds already. Raises, changing nothing, ContextTooLong past
        `max_model_len`, and PoolBusy when `total_tokens` cannot fit even with every idle
        prefix-cache entry closed."""
        limit = self.max_model_len
        if total_tokens > limit:
            raise ContextTooLong(
                f"context length exceeded: this request needs {total_tokens:,} tokens "
                f"({len(prompt):,} of prompt), over the {limit:,} one session can hold "
                "(max_model_len); nothing changed",
                limit=limit, held=0, added=len(prompt),
                generated=total_tokens - len(prompt))
        source, cached = self.prefix.longest(self.sessions, prompt)
        want = cdiv(total_tokens, self.runtime.page_size)
        self._check_room(source, cdiv(cached, self.runtime.page_size) - 1 if cached else 0,
                         want, total_tokens)
        if source is None:
            session = self.create_session(durable=durable)
        else:
            session = self.fork(source.id, cached, durable=durable)
            self.prefix.used(source.id, cached)

        def fits():
            table = session.table if len(session.table) else self.allocator.new_table()
            demand = shard_demand(len(table), want, self.runtime.num_shards, table.rotation)
            if not self.allocator.can_grow(table, want):
                raise CapacityError(demand, self.allocator.free_per_shard())
        try:
            self._making_room(fits, keep=session.id, need=total_tokens)
        except CapacityError:
            self.close_session(session.id)
            raise
        return session, cached

    def _check_room(self, source: object | None, shared: int, want: int, need: int) -> None:
        """Raise PoolBusy (saying `need` tokens) unless a table of `want` pages whose first
        `shared` are `source`'s fits the free pages plus those of the idle prefix-cache
        entries."""
        rotation = (source.table if source is not None else self.allocator.new_table()).rotation
        demand = shard_demand(shared, want, self.runtime.num_shards, rotation)
        free = self.allocator.free_per_shard()
        spare = self.prefix.reclaimable(self.sessions, self.allocator,
                                        keep=source.id if source is not None else None)
        if any(d > f + r for d, f, r in zip(demand, free, spare)):
            raise self.pool_busy(need, source.id if source is not None else None,
                                 CapacityError(demand, free), spare_pages=sum(spare))

    def retain(self, session_id: str) -> None:
        """Keep an idle ephemeral session as a prefix-cache entry (closed when its pages or
        its place are wanted), and close the oldest entries past the cache's size."""
        self.prefix.retain(session_id)
        while len(self.prefix.entries) > self.prefix.max_entries:
            victim = self.prefix.evictable(self.sessions)
            if victim is None:
                break
            self.close_session(victim)
