"""Page allocator: per-shard free lists with reference counts.

Logical page `i` of a session lives on shard `i % S` (see `layout.py`), so a session's page table
is just the physical slot of each logical page; the shard is implied by the index. Slot `P` of
every shard (one past the last allocatable slot) is the sentinel that absorbs no-op writes and is
never handed out.

Running out of pages is a normal answer: `grow` raises `CapacityError` *before* changing
anything, so a refused request leaves the allocator exactly as it was. Misuse (freeing a page
twice, forking past the end) raises `ValueError`.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from cp_runtime.layout import cdiv

__all__ = ["CapacityError", "PageCopy", "PageAllocator"]


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


class PageAllocator:
    """Allocates physical page slots on S shards of `pages_per_shard` slots each."""

    def __init__(self, num_shards: int, pages_per_shard: int):
        if num_shards <= 0 or pages_per_shard <= 0:
            raise ValueError(f"{num_shards=} and {pages_per_shard=} must be positive")
        self.num_shards = num_shards
        self.pages_per_shard = pages_per_shard
        self._free = [list(range(pages_per_shard)) for _ in range(num_shards)]  # min-heaps
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
            return sum(len(f) for f in self._free)
        return len(self._free[shard])

    def num_used(self) -> int:
        return int(np.count_nonzero(self._refs))

    def refcount(self, shard: int, slot: int) -> int:
        return int(self._refs[shard, slot])

    def shard_demand(self, have_pages: int, want_pages: int) -> list[int]:
        """Pages each shard must supply to grow a table from `have_pages` to `want_pages`."""
        demand = [0] * self.num_shards
        for page in range(have_pages, want_pages):
            demand[page % self.num_shards] += 1
        return demand

    def can_grow(self, have_pages: int, want_pages: int) -> bool:
        demand = self.shard_demand(have_pages, want_pages)
        return all(d <= len(f) for d, f in zip(demand, self._free))

    def grow(self, table: list[int], want_pages: int) -> list[int]:
        """Extend `table` (slots of logical pages) to `want_pages` pages; returns the new table.

        Atomic: raises CapacityError without allocating anything if any shard is short.
        """
        demand = self.shard_demand(len(table), want_pages)
        free = [len(f) for f in self._free]
        if any(d > f for d, f in zip(demand, free)):
            raise CapacityError(demand, free)
        new = list(table)
        for page in range(len(table), want_pages):
            shard = page % self.num_shards
            slot = heapq.heappop(self._free[shard])
            self._refs[shard, slot] = 1
            new.append(slot)
        return new

    def free(self, table: list[int]) -> None:
        """Drop one reference to every page of `table`."""
        for page, slot in enumerate(table):
            shard = page % self.num_shards
            if self._refs[shard, slot] <= 0:
                raise ValueError(f"page {page} (shard {shard}, slot {slot}) is not allocated")
        for page, slot in enumerate(table):
            shard = page % self.num_shards
            self._refs[shard, slot] -= 1
            if self._refs[shard, slot] == 0:
                heapq.heappush(self._free[shard], slot)

    def shrink(self, table: list[int], keep: int) -> list[int]:
        """Drop one reference to the pages of `table` past the first `keep`; returns the rest."""
        for page in range(keep, len(table)):
            shard = page % self.num_shards
            self._refs[shard, table[page]] -= 1
            if self._refs[shard, table[page]] == 0:
                heapq.heappush(self._free[shard], table[page])
        return list(table[:keep])

    def fork(self, table: list[int], num_tokens: int, page_size: int
             ) -> tuple[list[int], PageCopy | None]:
        """Share the full pages of a session holding `num_tokens` tokens; copy its partial page.

        Returns the child's table and the copy the caller must perform on the device (or None
        when the last page is full). Atomic like `grow`.
        """
        num_pages = cdiv(num_tokens, page_size)
        if num_pages > len(table):
            raise ValueError(f"{num_tokens=} needs {num_pages} pages, table has {len(table)}")
        partial = num_tokens % page_size != 0
        shared = num_pages - 1 if partial else num_pages
        if partial:  # check before touching anything
            demand = self.shard_demand(num_pages - 1, num_pages)
            free = [len(f) for f in self._free]
            if any(d > f for d, f in zip(demand, free)):
                raise CapacityError(demand, free)
        for page in range(shared):
            self._refs[page % self.num_shards, table[page]] += 1
        child = list(table[:shared])
        if not partial:
            return child, None
        child = self.grow(child, num_pages)
        last = num_pages - 1
        return child, PageCopy(shard=last % self.num_shards, src=table[last], dst=child[last])

    def check_invariants(self) -> None:
        """free + used == capacity; free lists hold exactly the slots with refcount 0."""
        for shard, heap in enumerate(self._free):
            zero = set(np.flatnonzero(self._refs[shard] == 0).tolist())
            if set(heap) != zero or len(heap) != len(zero):
                raise AssertionError(f"shard {shard}: free list disagrees with refcounts")
        if self.num_free() + self.num_used() != self.capacity:
            raise AssertionError("free + used != capacity")
