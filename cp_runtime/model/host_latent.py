"""A step's use of a latent cache held in host memory (`latent_memory = "host"`), one shard.

The shard's latent buffer is its pages' words in host memory, u32[P + 1, ps / pk, D]
(cp_runtime.cache.host_pages). Each way the step touches the cache stages the pages it needs
in HBM and runs the device path's own code on them:

  `write_rows`     the pages the step's rows land in: staged, turned into the pool's storage
                   dtype, written by the cache-write kernel, turned back and copied back;
  `selected_pages` the pages the step's queries selected (gather_q): staged as words, with the
                   slots that point into them (the attention kernels take words,
                   kernels/dispatch.py; the decode kernel reads them as they are); a chunk
                   whose selections outnumber its rows' tables stages the tables instead;
  `table_pages`    the pages of the rows' tables (gather_kv's `every_page`), in table order,
                   in the storage dtype.

`attend` is the step's `ShardAttention` (cp_runtime.model.attention): its page geometry (tables,
rotation, positions) says which pages are this shard's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cp_runtime.cache import host_pages
from cp_runtime.cache.layout import global_page_jnp, local_page_jnp, owner_shard_jnp
from cp_runtime.kernels.page_words import from_words, to_words

__all__ = ["write_rows", "selected_pages", "table_pages"]


def _stage(words: jax.Array, slots: jax.Array, order: jax.Array,
           count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stage this shard's pages among slots i32[N] in HBM, in `host_pages.owned_first`'s order.

    returns (staged u32[N', ps / pk, D], at i32[N]): entry i's page is staged[at[i]] where
    it is this shard's (`host_pages.read_pages`: its last page, a place to discard writes)."""
    staged = host_pages.read_pages(words, slots[order], count)
    at = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    return staged, at


def _stage_owned(words: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_stage` of slots i32[N], sentinel P where not this shard's."""
    order, count = host_pages.owned_first(slots, words.shape[0] - 1)
    return _stage(words, slots, order, count)


def _written_window(attend) -> tuple[jax.Array, jax.Array]:
    """Where this shard's pages the step writes sit in the rows' local tables: (local i32[B, J],
    touched bool[B, J]). A row's queries sit at consecutive positions, on at most `span`
    consecutive pages, so its pages on this shard are at most J = ceil(span / S) consecutive
    local pages, from the first of its pages at or after the row's first page."""
    b, q = attend.pos.shape
    ps, shards = attend.page_size, attend.num_shards
    span = (q + ps - 2) // ps + 1
    rot = attend.rotation[:, None]
    first = jnp.maximum(attend.pos[:, :1], 0) // ps
    last = jnp.max(attend.pos, axis=1, keepdims=True) // ps          # -1: a padding row
    lo = (local_page_jnp(first, shards, rot)
          + (attend.shard < owner_shard_jnp(first, shards, rot)).astype(jnp.int32))
    local = lo + jnp.arange(-(-span // shards), dtype=jnp.int32)[None]
    page = global_page_jnp(local, attend.shard, shards, rot)
    touched = (page <= last) & (local < attend.local_table.shape[1])
    return local, touched


def write_rows(attend, words: jax.Array, rows: jax.Array) -> jax.Array:
    """The step's rows f[B, Q, D] written into this shard's host cache u32[P + 1, ps / pk, D]."""
    sentinel = words.shape[0] - 1
    local, touched = _written_window(attend)
    b, m = attend.local_table.shape
    safe = jnp.clip(local, 0, m - 1)
    slots = jnp.where(touched, jnp.take_along_axis(attend.local_table, safe, axis=1), sentinel)
    flat = slots.reshape(-1)
    order, count = host_pages.owned_first(flat, sentinel)
    staged, at = _stage(words, flat, order, count)
    pages = from_words(staged, attend.latent_storage)
    discard = pages.shape[0] - 1
    # A table that points into the staged pages: the window's touched entries at their staged
    # page, everything else at the discard page (`_write`'s sentinel: the last page).
    staged_at = jnp.where(flat != sentinel, at, discard)
    table = jnp.full((b, m), discard, jnp.int32).at[
        jnp.arange(b, dtype=jnp.int32)[:, None], jnp.where(touched, local, m)].set(
        staged_at.reshape(local.shape), mode="drop")
    on_stage = dataclasses.replace(attend, local_table=table)
    pages = on_stage._write(pages, rows, attend.pool.latent_dtype)
    # The staged pages sit in `order`: the first `count` go back where they came from.
    return host_pages.write_pages(words, to_words(pages[:flat.shape[0]]), flat[order], count)


def selected_pages(attend, words: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """gather_q's pages: selected logical pages i32[B, Q, K + 1] -> (staged u32[N', ps / pk,
    D] (`host_pages.read_pages`), slots i32[B, Q, K + 1] into them, -1 where not this
    shard's)."""
    sentinel = words.shape[0] - 1
    b, m = attend.local_table.shape
    if pages.size <= b * m:
        slots = attend._slots_of(pages, sentinel).reshape(-1)
        staged, at = _stage_owned(words, slots)
        return staged, jnp.where(slots != sentinel, at, -1).reshape(pages.shape)
    staged, at = _stage_owned(words, attend.local_table.reshape(-1))
    by_staging = dataclasses.replace(attend, local_table=at.reshape(b, m))
    owned = attend._slots_of(pages, -1) >= 0
    return staged, jnp.where(owned, by_staging._slots_of(pages, -1), -1)


def table_pages(attend, words: jax.Array) -> jax.Array:
    """gather_kv's local part: this shard's pages of the rows' tables then its sentinel page,
    T[B * M/S + 1, ps, D], in table order (`ShardAttention.every_page`'s `before[table]`)."""
    sentinel = words.shape[0] - 1
    table = jnp.append(attend.local_table.reshape(-1), sentinel)
    staged = host_pages.read_pages(words, table, jnp.int32(table.shape[0]))
    return from_words(staged[:table.shape[0]], attend.latent_storage)

