"""Placement of a session's logical pages on `cp` shards: the one rule everything else calls,
with a numpy twin (the engine, the allocator) and a jnp twin (inside the step).

A session starts on shard `r`, its rotation (0 <= r < S), chosen when it is created as the
shard with the most free pages; a fork keeps its parent's. Logical page `i` lives whole on
shard `(i + r) % S` as that shard's local page `(i + r) // S`. Token position `t` is on logical
page `t // ps` at offset `t % ps`. With r = 0 this is plain round robin; with S = 1 it is the
identity.

Why rotate: without it every session's page 0 sits on shard 0, so many short sessions fill
shard 0 while the others stay empty (a 16-shard pool of 4 pages per shard refused its 5th
one-page session), and their decode work piles onto the low shards.

Step inputs describe pages in *rotated* coordinates: row b's page table has entry `i + r_b` for
logical page i (the sentinel elsewhere), so splitting it by owner is a plain reshape and local
page j of shard s holds logical page `j * S + s - r_b` (none when that is negative).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from cp_runtime.kernels.storage import cdiv

__all__ = [
    "cdiv",
    "owner_shard",
    "local_page",
    "global_page",
    "pages_on_shard",
    "shard_demand",
    "rotated_row",
    "local_page_table",
    "local_page_table_jnp",
    "owner_shard_jnp",
    "local_page_jnp",
    "global_page_jnp",
]


def owner_shard(page, num_shards: int, rotation=0):
    """Shard that owns logical page(s) `page` of a session rotated by `rotation`."""
    return (np.asarray(page) + rotation) % num_shards


def local_page(page, num_shards: int, rotation=0):
    """Index of logical page(s) `page` among its owner's local pages."""
    return (np.asarray(page) + rotation) // num_shards


def global_page(local, shard, num_shards: int, rotation=0):
    """Inverse of (owner_shard, local_page): the logical page (negative: no page)."""
    return np.asarray(local) * num_shards + np.asarray(shard) - rotation


def pages_on_shard(num_pages: int, shard: int, num_shards: int, rotation: int = 0) -> int:
    """How many of a session's first `num_pages` logical pages live on `shard`."""
    first = (shard - rotation) % num_shards          # smallest logical page on `shard`
    return max(0, cdiv(num_pages - first, num_shards))


def shard_demand(have_pages: int, want_pages: int, num_shards: int, rotation: int) -> list[int]:
    """Pages each shard must supply to grow a session from `have_pages` to `want_pages`."""
    return [pages_on_shard(want_pages, s, num_shards, rotation)
            - pages_on_shard(have_pages, s, num_shards, rotation) for s in range(num_shards)]


def rotated_row(slots: list[int] | np.ndarray, rotation: int, width: int,
                sentinel: int) -> np.ndarray:
    """One row of a step's page table: i32[width], entry `i + rotation` = slots[i]."""
    if len(slots) + rotation > width:
        raise ValueError(f"{len(slots)} pages at rotation {rotation} do not fit {width=}")
    row = np.full((width,), sentinel, np.int32)
    row[rotation: rotation + len(slots)] = slots
    return row


def local_page_table(page_table: np.ndarray, num_shards: int) -> np.ndarray:
    """Split a rotated page table by owner.

    page_table: i32[B, M] (rotated coordinates, M a multiple of S)
    returns:    i32[S, B, M // S]; `[s, b, j]` is entry `j * S + s`.
    """
    b, m = page_table.shape
    if m % num_shards:
        raise ValueError(f"page table width {m} must be a multiple of {num_shards=}")
    # [B, M] -> [B, M/S, S] -> [S, B, M/S]
    return np.ascontiguousarray(page_table.reshape(b, m // num_shards, num_shards)
                                .transpose(2, 0, 1))


def local_page_table_jnp(page_table: jnp.ndarray, num_shards: int) -> jnp.ndarray:
    """jnp twin of `local_page_table`."""
    b, m = page_table.shape
    if m % num_shards:
        raise ValueError(f"page table width {m} must be a multiple of {num_shards=}")
    return page_table.reshape(b, m // num_shards, num_shards).transpose(2, 0, 1)


def owner_shard_jnp(page: jnp.ndarray, num_shards: int, rotation) -> jnp.ndarray:
    """jnp twin of `owner_shard`; `rotation` broadcasts against `page`."""
    return (page + rotation) % num_shards


def local_page_jnp(page: jnp.ndarray, num_shards: int, rotation) -> jnp.ndarray:
    """jnp twin of `local_page`."""
    return (page + rotation) // num_shards


def global_page_jnp(local: jnp.ndarray, shard, num_shards: int, rotation) -> jnp.ndarray:
    """jnp twin of `global_page`."""
    return local * num_shards + shard - rotation
