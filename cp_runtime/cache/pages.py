"""Page allocator: per-shard free lists with reference counts.

A session's `PageTable` is its rotation (the shard its page 0 lives on, see `cache/layout.py`)
and the physical slot of each logical page; the shard of a page is implied by its index and the
rotation. Slot `P` of every shard (one past the last allocatable slot) is the sentinel that
absorbs no-op writes and is never handed out.

A shard may hold its first `device_pages` slots in HBM and the rest in host memory
(`RuntimeConfig.latent_device_pages`): a table takes the lowest free slots, so HBM's first,
and `to_host` moves a table's pages out of HBM (the caller performs the copies).

Running out of pages is a normal answer: `grow` and `fork` raise `CapacityError` *before*
changing anything, so a refused request leaves the allocator exactly as it was. Misuse (freeing
a page twice, a table naming one slot twice, forking past the end) raises `ValueError`, also
before changing anything.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq

import numpy as np

from cp_runtime.cache.layout import cdiv, owner_shard, shard_demand

__all__ = ["CapacityError", "PageCopy", "PageTable", "PageAllocator"]


class CapacityError(RuntimeError):
    """Not enough free pages. Carries what was asked and what was free, per shard."""

    def __init__(self, requested: list[int], free: list[int]):
        self.requested = requested
        self.free = free
        short = [r for r, (q, f) in enumerate(zip(requested, free)) if q > f]
        super().__init__(
            f"out of KV pages: requested {sum(requested)} pages, {sum(free)} free; "
            f"shard(s) {short} short (requested per shard {requested}, free per shard {free})")


@dataclasses.dataclass(frozen=True)
class PageCopy:
    """A device-side copy the caller must perform: `slot src -> slot dst` on `shard`."""

    shard: int
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class PageTable:
    """A session's pages: logical page i sits on shard `(i + rotation) % S` in slot `slots[i]`."""

    rotation: int
    slots: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.slots)

    @functools.cached_property
    def slot_array(self) -> np.ndarray:
        """i32[len] `slots` as an array, made once per table: a step copies a prefix of it
        into its page table, and a million-token session has 16K slots."""
        array = np.asarray(self.slots, np.int32)
        array.flags.writeable = False
        return array

    def shards(self, num_shards: int) -> np.ndarray:
        """i32[len]: the owner shard of each logical page."""
        return owner_shard(np.arange(len(self.slots)), num_shards, self.rotation)


class PageAllocator:
    """Allocates physical page slots on S shards of `pages_per_shard` slots each, the first
    `device_pages` of each in HBM where the rest are in host memory."""

    def __init__(self, num_shards: int, pages_per_shard: int, device_pages: int = 0):
        if num_shards <= 0 or pages_per_shard <= 0:
            raise ValueError(f"{num_shards=} and {pages_per_shard=} must be positive")
        if not 0 <= device_pages <= pages_per_shard:
            raise ValueError(f"{device_pages=} must be in [0, {pages_per_shard}]")
        self.num_shards = num_shards
        self.pages_per_shard = pages_per_shard
        self.device_pages = device_pages
        # Min-heaps of free slots per shard: [0, device_pages) and [device_pages, P).
        self._free_device = [list(range(device_pages)) for _ in range(num_shards)]
        self._free_host = [list(range(device_pages, pages_per_shard))
                           for _ in range(num_shards)]
        self._refs = np.zeros((num_shards, pages_per_shard), np.int32)

    @property
    def sentinel(self) -> int:
        """The slot on every shard that no session owns; writes to it are discarded."""
        return self.pages_per_shard

    @property
    def capacity(self) -> int:
        return self.num_shards * self.pages_per_shard

    def num_free(self, shard: int | None = None) -> int:
        if shard is None:
            return sum(self.free_per_shard())
        return len(self._free_device[shard]) + len(self._free_host[shard])

    def free_per_shard(self) -> list[int]:
        return [self.num_free(s) for s in range(self.num_shards)]

    def free_device_per_shard(self) -> list[int]:
        """Free slots in HBM, per shard."""
        return [len(f) for f in self._free_device]

    def used_per_shard(self) -> list[int]:
        return [self.pages_per_shard - f for f in self.free_per_shard()]

    def _pop(self, shard: int, host: bool = False) -> int:
        """The lowest free slot of `shard` (in host memory only, with `host`), referenced."""
        heap = self._free_host[shard] if host or not self._free_device[shard] \
            else self._free_device[shard]
        slot = heapq.heappop(heap)
        self._refs[shard, slot] = 1
        return slot

    def num_used(self) -> int:
        return int(np.count_nonzero(self._refs))

    def refcount(self, shard: int, slot: int) -> int:
        return int(self._refs[shard, slot])

    def new_table(self) -> PageTable:
        """An empty table starting on the shard with the most free pages (lowest on a tie)."""
        free = self.free_per_shard()
        return PageTable(rotation=free.index(max(free)))

    def can_grow(self, table: PageTable, want_pages: int) -> bool:
        demand = shard_demand(len(table), want_pages, self.num_shards, table.rotation)
        return all(d <= f for d, f in zip(demand, self.free_per_shard()))

    def grow(self, table: PageTable, want_pages: int) -> PageTable:
        """`table` extended to `want_pages` pages. Atomic: raises CapacityError without
        allocating anything if any shard is short."""
        demand = shard_demand(len(table), want_pages, self.num_shards, table.rotation)
        free = self.free_per_shard()
        if any(d > f for d, f in zip(demand, free)):
            raise CapacityError(demand, free)
        slots = list(table.slots)
        for page in range(len(table), want_pages):
            slots.append(self._pop(int(owner_shard(page, self.num_shards, table.rotation))))
        return dataclasses.replace(table, slots=tuple(slots))

    def device_held(self, tables: list[PageTable]) -> dict[tuple[int, int], list]:
        """The HBM slots that `tables` alone reference, what `to_host` moves: {(shard, slot):
        [(table index, logical page), ...]} (a slot the tables share is listed once)."""
        refs: dict[tuple[int, int], list] = {}
        for i, table in enumerate(tables):
            for page, (shard, slot) in enumerate(self._pairs(table)):
                if slot < self.device_pages:
                    refs.setdefault((shard, slot), []).append((i, page))
        return {key: where for key, where in refs.items() if len(where) == self._refs[key]}

    def to_host(self, tables: list[PageTable]) -> tuple[list[PageTable], list[PageCopy]]:
        """`tables` with the pages in HBM that they alone reference moved to free host slots,
        and the copies the caller must perform before the tables are used. Atomic like `grow`:
        raises CapacityError, changing nothing, if a shard has too few free host slots. Pages
        other tables share stay where they are (moving them would change those tables too)."""
        moving = self.device_held(tables)
        demand = np.bincount([shard for shard, _ in moving],
                             minlength=self.num_shards).tolist()
        free = [len(f) for f in self._free_host]
        if any(d > f for d, f in zip(demand, free)):
            raise CapacityError(demand, free)
        slots = [list(t.slots) for t in tables]
        copies = []
        for (shard, device), where in moving.items():
            host = self._pop(shard, host=True)
            self._refs[shard, host] = len(where)
            for i, page in where:
                slots[i][page] = host
            copies.append(PageCopy(shard=shard, src=device, dst=host))
        for (shard, device), where in moving.items():
            self._refs[shard, device] = 1
        self._release([(c.shard, c.src) for c in copies])
        return [dataclasses.replace(t, slots=tuple(s)) for t, s in zip(tables, slots)], copies

    def unwritten_on_host(self, table: PageTable, first: int) -> list[int]:
        """Per shard, how many of `table`'s pages from logical page `first` on sit in host
        slots that it alone references: what `to_device` would move, HBM permitting."""
        need = [0] * self.num_shards
        for page, (shard, slot) in enumerate(self._pairs(table, first), start=first):
            if slot >= self.device_pages and self._refs[shard, slot] == 1:
                need[shard] += 1
        return need

    def to_device(self, table: PageTable, first: int) -> PageTable:
        """`table` with its pages from logical page `first` on (those it alone references)
        placed again, lowest free slots first, so in HBM as far as each shard's free HBM slots
        go and in ascending slot order, without copies: the caller promises those pages hold
        nothing yet (a prompt's pages before it is prefilled)."""
        pairs = self._pairs(table, first)
        mine = [(page, shard, slot) for page, (shard, slot) in enumerate(pairs, start=first)
                if self._refs[shard, slot] == 1]
        self._release([(shard, slot) for _, shard, slot in mine])
        slots = list(table.slots)
        for page, shard, _ in mine:
            slots[page] = self._pop(shard)
        return dataclasses.replace(table, slots=tuple(slots))

    def undo_to_host(self, copies: list[PageCopy]) -> None:
        """Take back a `to_host` whose copies failed: its HBM slots referenced again as they
        were, its new host slots freed; the tables given to it are then the ones to keep."""
        for c in copies:
            refs = int(self._refs[c.shard, c.dst])
            self._take(c.shard, c.src, refs)
            self._refs[c.shard, c.dst] = 1
        self._release([(c.shard, c.dst) for c in copies])

    def _take(self, shard: int, slot: int, refs: int) -> None:
        """A free slot referenced `refs` times again (`undo_to_host`)."""
        heap = self._free_device[shard] if slot < self.device_pages else self._free_host[shard]
        heap.remove(slot)
        heapq.heapify(heap)
        self._refs[shard, slot] = refs

    def _pairs(self, table: PageTable, first: int = 0) -> list[tuple[int, int]]:
        """(shard, slot) of pages `first..` of `table`, checked: each allocated, none twice."""
        pairs = [(int(s), slot) for s, slot in
                 zip(table.shards(self.num_shards)[first:], table.slots[first:])]
        if len(set(pairs)) != len(pairs):
            raise ValueError(f"page table names a slot twice: {table}")
        for page, (shard, slot) in enumerate(pairs, start=first):
            if not 0 <= slot < self.pages_per_shard or self._refs[shard, slot] <= 0:
                raise ValueError(f"page {page} (shard {shard}, slot {slot}) is not allocated")
        return pairs

    def _release(self, pairs: list[tuple[int, int]]) -> None:
        for shard, slot in pairs:
            self._refs[shard, slot] -= 1
            if self._refs[shard, slot] == 0:
                heapq.heappush(self._free_device[shard] if slot < self.device_pages
                               else self._free_host[shard], slot)

    def free(self, table: PageTable) -> None:
        """Drop one reference to every page of `table` (all checked before any is dropped)."""
        self._release(self._pairs(table))

    def shrink(self, table: PageTable, keep: int) -> PageTable:
        """Drop one reference to the pages of `table` past the first `keep`; returns the rest."""
        self._release(self._pairs(table, first=keep))
        return dataclasses.replace(table, slots=table.slots[:keep])

    def fork(self, table: PageTable, num_tokens: int, page_size: int
             ) -> tuple[PageTable, PageCopy | None]:
        """A child of a session holding `num_tokens` tokens: it shares every page but the last,
        which is copied (the caller performs the returned device copy; None for no pages).

        The last page is never shared, full or not: the next write of either session lands
        there (a new token, or the last token written again when a generation starts).
        Atomic like `grow`; the child keeps the parent's rotation.
        """
        num_pages = cdiv(num_tokens, page_size)
        if num_pages > len(table):
            raise ValueError(f"{num_tokens=} needs {num_pages} pages, table has {len(table)}")
        if num_pages == 0:
            return PageTable(rotation=table.rotation), None
        shared = PageTable(rotation=table.rotation, slots=table.slots[: num_pages - 1])
        pairs = self._pairs(shared)                  # checked before anything changes
        child = self.grow(shared, num_pages)         # may raise CapacityError, changing nothing
        for shard, slot in pairs:
            self._refs[shard, slot] += 1
        last = num_pages - 1
        return child, PageCopy(shard=int(owner_shard(last, self.num_shards, table.rotation)),
                               src=table.slots[last], dst=child.slots[last])

    def check_invariants(self) -> None:
        """free + used == capacity; free lists hold exactly the slots with refcount 0."""
        for shard in range(self.num_shards):
            device, host = self._free_device[shard], self._free_host[shard]
            zero = set(np.flatnonzero(self._refs[shard] == 0).tolist())
            if set(device) | set(host) != zero or len(device) + len(host) != len(zero):
                raise AssertionError(f"shard {shard}: free list disagrees with refcounts")
            if any(s >= self.device_pages for s in device) or any(
                    s < self.device_pages for s in host):
                raise AssertionError(f"shard {shard}: a free slot is in the wrong tier")
        if self.num_free() + self.num_used() != self.capacity:
            raise AssertionError("free + used != capacity")
