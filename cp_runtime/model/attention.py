"""Paged DSA attention on one `cp` shard, called inside the SPMD step (`shard_map`).

Per layer, for a batch of queries (DESIGN.md, "Context parallelism"):
  1. the owner shard writes the new KV into its page; the others write to their sentinel page;
  2. (`full` layers) each shard scores its own pages and keeps its top-K candidates;
  3. the candidates are all-gathered and every shard ranks the same global top-K;
  4. each shard attends the selected pages it owns and returns partials (o, lse);
  5. the partials are merged exactly over the axis and projected to hidden space
     (cp_runtime.parallel.merge.combine: where they meet depends on the merge variant and
     weight split).
`shared` layers reuse step 2-3's selection from the last `full` layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from cp_runtime.cache.layout import local_page_jnp, owner_shard_jnp
from cp_runtime.cache.pool import PoolSpec
from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.kernels.cache_write import tiles_bound, write_tile_rows
from cp_runtime.kernels.dispatch import Kernels
from cp_runtime.model.forward import IndexerInputs
from cp_runtime.model.phases import phase
from cp_runtime.parallel.merge import combine
from cp_runtime.parallel.selection import attended_pages, global_top_pages, local_candidates
from cp_runtime.weights.shards import WeightShards

__all__ = ["ShardState", "ShardAttention"]


@dataclasses.dataclass(frozen=True)
class ShardState:
    """This shard's pool blocks and the current selection i32[B, Q, K] (None before layer 0)."""

    latent: tuple[jax.Array, ...]    # T[P + 1, ps, D_lat] per layer
    indexer: tuple[jax.Array, ...]   # T[P + 1, ps, D_idx] per full layer
    selection: jax.Array | None


@dataclasses.dataclass(frozen=True)
class ShardAttention:
    """Step-wide inputs of one shard; `__call__` is the `attend` callback of `model.forward`.

    local_table: i32[B, M] slot of this shard's local page j, which holds logical page
                 j * S + shard - rotation (cp_runtime.cache.layout; sentinel where unallocated)
    rotation:    i32[B]    each row's rotation
    pos:         i32[B, Q] query positions (-1 = padding)
    merge:       the merge variant (cp_runtime.parallel.merge); ws: how the weights are split
    combine:     cp_runtime.parallel.merge.combine, or a stand-in with its signature (a benchmark
                 timing a step without its merge)
    """

    model: ModelConfig
    runtime: RuntimeConfig
    pool: PoolSpec
    kernels: Kernels
    axis_name: str
    shard: jax.Array
    local_table: jax.Array
    rotation: jax.Array
    pos: jax.Array
    merge: str
    ws: WeightShards
    combine: Callable = combine

    @property
    def num_shards(self) -> int:
        return self.runtime.num_shards

    @property
    def page_size(self) -> int:
        return self.runtime.page_size

    def _slots_of(self, pages: jax.Array, sentinel: int) -> jax.Array:
        """Local slot of logical pages i32[B, ...] if this shard owns them, else `sentinel`."""
        b = pages.shape[0]
        rot = self.rotation.reshape((b,) + (1,) * (pages.ndim - 1))
        local = jnp.clip(local_page_jnp(pages, self.num_shards, rot), 0,
                         self.local_table.shape[1] - 1)
        slots = jnp.take_along_axis(self.local_table, local.reshape(b, -1), axis=1)
        owned = (pages >= 0) & (owner_shard_jnp(pages, self.num_shards, rot) == self.shard)
        return jnp.where(owned, slots.reshape(pages.shape), sentinel)

    def _write(self, cache: jax.Array, rows: jax.Array, cache_dtype) -> jax.Array:
        """Write rows f[B, Q, D] of the step's tokens into this shard's cache (owner only)."""
        sentinel = cache.shape[0] - 1
        page = jnp.where(self.pos >= 0, self.pos // self.page_size, -1)
        slots = self._slots_of(page, sentinel)
        offsets = jnp.maximum(self.pos, 0) % self.page_size
        # Each row's queries sit at consecutive positions, which bounds the tiles they touch.
        b, q = self.pos.shape
        max_tiles = tiles_bound(b, q, write_tile_rows(cache.shape, cache_dtype))
        with phase("cache_write"):
            return self.kernels.write_kv(cache, rows.reshape(-1, rows.shape[-1]),
                                         slots.reshape(-1), offsets.reshape(-1),
                                         cache_dtype=cache_dtype, max_tiles=max_tiles)

    def _select(self, icache: jax.Array, index: IndexerInputs) -> jax.Array:
        k = self.model.index_topk // self.page_size
        with phase("indexer"):
            scores = self.kernels.indexer_page_scores(
                index.q, index.w, icache, self.local_table, self.pos, self.shard, self.rotation,
                num_shards=self.num_shards, key_block_pages=self.runtime.key_block_pages,
                cache_dtype=self.pool.indexer_dtype)
        with phase("selection"):
            cand_scores, cand_pages = local_candidates(
                scores, self.pos, self.shard, self.rotation, num_shards=self.num_shards,
                page_size=self.page_size, k=k)
            return global_top_pages(cand_scores, cand_pages, k=k, axis_name=self.axis_name,
                                    gathers=self.runtime.gathers)

    def __call__(self, layer: int, state: ShardState, q_row: jax.Array, kv_row: jax.Array,
                 index: IndexerInputs | None, project) -> tuple[jax.Array, ShardState]:
        latent = list(state.latent)
        latent[layer] = self._write(latent[layer], kv_row, self.pool.latent_dtype)
        indexer, selection = state.indexer, state.selection
        if index is not None:
            slot = self.model.indexer_slot(layer)
            indexer = list(indexer)
            indexer[slot] = self._write(indexer[slot], index.k, self.pool.indexer_dtype)
            selection = self._select(indexer[slot], index)
            indexer = tuple(indexer)
        with phase("sparse_attention"):
            pages = attended_pages(selection, self.pos, self.page_size)      # [B, Q, K + 1]
            sel_slots = self._slots_of(pages, -1)
            o, lse = self.kernels.sparse_attention(
                q_row, latent[layer], sel_slots, pages, self.pos,
                value_dim=self.model.kv_lora_rank, scale=self.model.softmax_scale,
                query_block=self.runtime.query_block, cache_dtype=self.pool.latent_dtype)
        with phase("merge"):
            out = self.combine(self.merge, o, lse, project, self.axis_name, self.ws,
                               self.runtime.gathers)
        return out, ShardState(latent=tuple(latent), indexer=indexer, selection=selection)
