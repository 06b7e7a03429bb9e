"""Placement of logical pages on `cp` shards, with a numpy twin and a jnp twin.

Logical page `i` of a session lives whole on shard `i % S`, as that shard's local page `i // S`.
Token position `t` is on logical page `t // ps` at offset `t % ps`. The twins are property-tested
against each other (bijection, per-shard counts summing to the total, S = 1 the identity).
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
    "local_page_table",
    "local_page_table_jnp",
    "owner_shard_jnp",
    "global_page_jnp",
]


def owner_shard(page, num_shards: int):
    """Shard that owns logical page(s) `page`. numpy or int."""
    return np.asarray(page) % num_shards


def local_page(page, num_shards: int):
    """Index of logical page(s) `page` among its owner's pages."""
    return np.asarray(page) // num_shards


def global_page(local, shard, num_shards: int):
    """Inverse of (owner_shard, local_page)."""
    return np.asarray(local) * num_shards + np.asarray(shard)


def pages_on_shard(num_pages: int, shard: int, num_shards: int) -> int:
    """How many of a session's first `num_pages` logical pages live on `shard`."""
    return max(0, cdiv(num_pages - shard, num_shards))


def local_page_table(page_table: np.ndarray, num_shards: int) -> np.ndarray:
    """Split a logical page table by owner.

    page_table: i32[B, M] physical slot of each logical page (M a multiple of S).
    returns:    i32[S, B, M // S]; `[r, b, j]` is the slot of logical page `j * S + r`.
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


def owner_shard_jnp(page: jnp.ndarray, num_shards: int) -> jnp.ndarray:
    return page % num_shards


def global_page_jnp(local: jnp.ndarray, shard, num_shards: int) -> jnp.ndarray:
    return local * num_shards + shard
