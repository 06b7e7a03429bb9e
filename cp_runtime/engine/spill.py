"""Which sessions' pages leave HBM so that a prompt's can be there
(`RuntimeConfig.latent_device_pages`, a pool whose latent cache is mostly in host memory).

A prompt prefilled in HBM pages runs the device pool's programs over them; in host pages,
every chunk copies all its earlier pages in from the host again, a cost that grows with the
square of the prompt (docs/notes/2026-12-07-host-latent-cache.md,
"Two tiers: the prompt in HBM"). A session's later decode steps read K + 1 pages a row, where
the host costs little. So when an admitted prompt's pages do not all fit in HBM, sessions that
are not being prefilled move their pages out, copied once: idle ones first, then those
generating; the oldest first within each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from cp_runtime.cache.pages import PageAllocator

__all__ = ["spill_candidates", "choose_spill"]


def spill_candidates(sessions: Iterable, keep: str, prefilling: set[str]) -> list:
    """Sessions whose pages may leave HBM, in the order they go: not `keep` (the prompt's
    own), none being prefilled; idle (busy None) before busy, each group oldest first (the
    engine's `sessions` keep the order they were opened in)."""
    movable = [s for s in sessions if s.id != keep and s.id not in prefilling]
    return ([s for s in movable if s.busy is None]
            + [s for s in movable if s.busy is not None])


def choose_spill(allocator: PageAllocator, candidates: list, need: list[int]) -> list:
    """The fewest leading `candidates` whose pages, moved to the host together, free `need`
    HBM slots on every shard (per shard, beyond those free now); all of them with HBM pages if
    no prefix does. Together, because pages they share move only when all their holders do."""
    short = [max(n - f, 0) for n, f in zip(need, allocator.free_device_per_shard())]
    if not any(short):
        return []
    chosen: list = []
    held, freed = Counter(), [0] * allocator.num_shards    # references among the chosen
    for session in candidates:
        table = session.table
        in_hbm = table.slot_array < allocator.device_pages
        if not in_hbm.any():
            continue
        chosen.append(session)
        # A slot frees once the chosen hold every reference to it (linear in the pages).
        for shard, slot in zip(table.shards(allocator.num_shards)[in_hbm].tolist(),
                               table.slot_array[in_hbm].tolist()):
            held[shard, slot] += 1
            if held[shard, slot] == allocator.refcount(shard, slot):
                freed[shard] += 1
        if all(f >= s for f, s in zip(freed, short)):
            break
    return chosen
