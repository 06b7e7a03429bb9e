"""Paged DSA attention on one `cp` shard, called inside the SPMD step (`shard_map`).

Per layer, for a batch of queries (with split weights each shard first gathers every head of
the indexer's q, which `full` layers need in step 2; in the gather_q layout in the same
all-gather as step 4's q heads, one collective for both):
  1. the owner shard writes the new KV into its page; the others write to their sentinel page;
  2. (`full` layers) each shard scores its own pages and keeps its top-K candidates;
  3. the candidates are all-gathered and every shard ranks the same global top-K;
then the queries meet the pages one of two ways (runtime field `attention`):
  gather_q   4. every head of q goes to every shard (split weights); each shard attends the
                selected pages it owns and returns partials (o, lse);
             5. the partials are merged exactly over the axis and projected to hidden space
                (cp_runtime.parallel.merge.combine: where they meet depends on the merge
                variant and weight split).
  gather_kv  4. every shard gets the cached pages of the rows' page tables (one all-gather of
                this layer's pages as the step found them, the step's rows written into the
                gathered copy after); each attends its own heads over all K + 1 selected
                pages: its partials are already whole. Where the step splits its rows
                (`splits_rows`) and it pays (`row_attention_mode`, runtime field
                `row_attention`), each shard attends every head of its own rows instead, so
                a page read serves all H heads: an all-to-all trades its heads of every row
                for every head of its rows and a second trades the outputs back ("rows"),
                or the step gathers the head-split weights whole ("weights", the layer
                stack's `WeightShards.whole_heads`) and each shard projects its rows itself;
             5. its heads are projected (W_uv, o_proj columns) and a psum in hidden space
                joins the heads (a reduce-scatter to each row's device where the step
                splits its rows).
Which way, and how split rows attend, is priced in cp_runtime.model.attention_modes; steps 2-3
are cp_runtime.model.shard_selection. `shared` layers reuse step 2-3's selection from the last
`full` layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cp_runtime.cache.layout import local_page_jnp, owner_shard_jnp
from cp_runtime.cache.pool import PoolSpec
from cp_runtime.config import ModelConfig, ResolvedStrategy, RuntimeConfig
from cp_runtime.kernels.cache_write import owned_tiles_bound, tiles_bound, write_tile_rows
from cp_runtime.kernels.dispatch import Kernels, select_kernels
from cp_runtime.kernels.reference import mask_words
from cp_runtime.model import host_latent
from cp_runtime.model.attention_modes import attention_layout, row_attention_mode
from cp_runtime.model.indexer_inputs import IndexerInputs
from cp_runtime.model.scopes import phase
from cp_runtime.model.shard_selection import attended_entries, select_beside_gathers
from cp_runtime.parallel.merge import combine
from cp_runtime.parallel.selection import entries_per_query
from cp_runtime.weights.shards import WeightShards

__all__ = ["ShardState", "ShardAttention"]


@dataclasses.dataclass(frozen=True)
class ShardState:
    """This shard's pool blocks and the current selection i32[B, Q, K] (None before layer 0):
    logical token positions in token selection, pages in page selection, NO_PAGE where none.

    every: gather_kv's gathered pages T[S * (B * M/S + 1), ps, D_lat] of the layer just run,
    with its rows written, where a second half of the chunk's rows attends them next in the
    same layer (`ShardAttention.hands_over`, cp_runtime.model.halves); None otherwise.
    ahead: `every_page`'s pages of coming layers, gathered ahead by cp_runtime.model.halves,
    as (layer, pages) pairs; a layer found there attends them instead of gathering its own.
    tie_ahead: the layers among `ahead` whose gathers this call's indexer kernel is to run
    beside (`indexer_page_scores`' `tie`)."""

    latent: tuple[jax.Array, ...]    # T[P + 1, ps, D_lat] per layer
    indexer: tuple[jax.Array, ...]   # T[P + 1, ps, D_idx] per full layer
    selection: jax.Array | None
    every: jax.Array | None = None
    ahead: tuple[tuple[int, jax.Array], ...] = ()
    tie_ahead: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ShardAttention:
    """Step-wide inputs of one shard; `__call__` is the `attend` callback of `layers.forward`.

    local_table: i32[B, M] slot of this shard's local page j, which holds logical page
                 j * S + shard - rotation (cp_runtime.cache.layout; sentinel where unallocated)
    rotation:    i32[B]    each row's rotation
    pos:         i32[B, Q] query positions (-1 = padding)
    strategy:    RuntimeConfig.strategy resolved for the platform (config.resolve_strategy):
                 the merge variant (cp_runtime.parallel.merge), the gathers, the layout,
                 the residual, how split rows attend, and indexer_scores ("cache" or "fp8":
                 how a step of more than one query a row scores its keys)
    ws:          how the weights are split (and, split rows, whether they attend from
                 weights gathered whole)
    combine:     cp_runtime.parallel.merge.combine, or a stand-in with its signature (a benchmark
                 timing a step without its merge)
    hands_over:  the step runs its rows as two halves (cp_runtime.model.halves): a call hands
                 the pages it gathered to the next half in its state (`ShardState.every`), and
                 the next half's in-place writes wait for this call's reads of the pool
    latent_storage: the dtype the latent pages take in HBM (the pool's storage dtype on this
                 platform) where the pool holds them in host memory (cp_runtime.model.
                 host_latent); unused otherwise
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
    strategy: ResolvedStrategy
    ws: WeightShards
    combine: Callable = combine
    rows_attend: str = "heads"       # where the rows are split: `row_attention_mode`'s choice
    hands_over: bool = False
    layout: str | None = None        # `attention_layout`'s choice made for the whole chunk
                                     # (its halves keep it); None: this call's rows choose
    latent_storage: object = None

    @property
    def num_shards(self) -> int:
        return self.runtime.num_shards

    @property
    def page_size(self) -> int:
        return self.runtime.page_size

    @property
    def fp8_scores(self) -> bool:
        """Whether this step's indexer scores in fp8: a chunk's, where `indexer_scores` is."""
        return self.strategy.indexer_scores == "fp8" and self.pos.shape[1] > 1

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
        # Each row's queries sit at consecutive positions on round-robin pages, which bounds
        # the tiles this shard's pages take from them.
        b, q = self.pos.shape
        max_tiles = owned_tiles_bound(b, q, self.page_size, self.num_shards,
                                      write_tile_rows(cache.shape, cache_dtype))
        with phase("cache_write"):
            return self.kernels.write_kv(cache, rows.reshape(-1, rows.shape[-1]),
                                         slots.reshape(-1), offsets.reshape(-1),
                                         cache_dtype=cache_dtype, max_tiles=max_tiles)

    def _write_latent(self, cache: jax.Array, rows: jax.Array) -> jax.Array:
        """`_write` of the latent rows f[B, Q, D], wherever the pool holds them."""
        if not self.pool.latent_on_host:
            return self._write(cache, rows, self.pool.latent_dtype)
        return host_latent.write_rows(self, cache, rows)

    @property
    def token_selection(self) -> bool:
        return self.runtime.selection == "token"

    @property
    def entries(self) -> int:
        """N, the attention entries of each query (`entries_per_query`)."""
        return entries_per_query(self.model.index_topk, self.page_size,
                                 self.local_table.shape[1] * self.num_shards,
                                 self.runtime.selection)

    def __call__(self, layer: int, state: ShardState, q_row: jax.Array, kv_row: jax.Array,
                 index: IndexerInputs | None, project) -> tuple[jax.Array, ShardState]:
        latent, every_in = list(state.latent), state.every
        gather_q = self.chosen_layout(latent[layer]) == "gather_q"
        if gather_q and self.ws.rows_split:
            raise ValueError("the rows are split only where the step runs gather_kv "
                             "(`splits_rows`); this layer runs gather_q")
        if gather_q:
            q_row, index = self._gather_queries(q_row, index)
        elif index is not None:
            with phase("attention_inputs"):
                index = (index.rounded() if self.fp8_scores else index).gathered(self.ws)
        before = latent[layer]
        latent[layer] = self._write_latent(before, kv_row)
        indexer, selection = state.indexer, state.selection
        if index is not None:
            slot = self.model.indexer_slot(layer)
            indexer = list(indexer)
            indexer[slot] = self._write(indexer[slot], index.k, self.pool.indexer_dtype)
            selection, state = select_beside_gathers(self, indexer[slot], index, state)
            if self.hands_over:      # the next half's write waits for this half's scores:
                # else XLA copies the whole block first (207 MB a GLM-5.2 layer on tpu7x-16)
                indexer[slot], selection = lax.optimization_barrier((indexer[slot], selection))
            indexer = tuple(indexer)
        pages, masks = attended_entries(self, selection)                     # [B, Q, N]
        state = dataclasses.replace(state, latent=tuple(latent), indexer=indexer,
                                    selection=selection, every=None)
        if gather_q:
            return self._attend_own_pages(q_row, latent[layer], pages, masks, project), state
        every = self._gathered_pages(layer, before, state) if every_in is None else every_in
        every = self._write_every(every, kv_row)
        out = self._attend_every_page(q_row, every, pages, masks, project)
        if not self.hands_over:
            return out, state
        # Without the tie XLA cannot order the next half's in-place write after this half's
        # kernel reads of the same pages, and copies them first (0.7 GB a layer at 1M).
        every, out = lax.optimization_barrier((every, out))
        return out, dataclasses.replace(state, every=every)

    def _gathered_pages(self, layer: int, before: jax.Array, state: ShardState) -> jax.Array:
        """`every_page`'s pages of `layer`: those gathered ahead, else gathered now."""
        ahead = dict(state.ahead).get(layer)
        return self.every_page(before) if ahead is None else ahead

    def splits_rows(self, cache: jax.Array) -> bool:
        """Whether the step splits its residual stream by row (runtime field `residual`,
        cp_runtime.weights.shards): where it runs gather_kv (`cache`: any layer's latent
        cache) and its rows divide evenly over the shards. gather_kv's heads come back as
        one sum per row, which a reduce-scatter can hand to the row's device; gather_q's
        merges return every row to every device."""
        b, q = self.pos.shape
        return (self.strategy.residual == "auto" and self.ws.split and self.num_shards > 1
                and (b * q) % self.num_shards == 0 and self.chosen_layout(cache) == "gather_kv")

    def chosen_layout(self, cache: jax.Array) -> str:
        """gather_q or gather_kv for this step (`attention_layout`; `cache`: any layer's latent
        cache), or the one fixed for the whole chunk (`layout`)."""
        if self.layout is not None:
            return self.layout
        b, q = self.pos.shape
        return attention_layout(
            self.strategy.attention, rows=b * q, heads=self.model.num_attention_heads,
            latent_dim=self.model.latent_dim, value_dim=self.model.kv_lora_rank,
            table_pages=b * self.local_table.shape[1] * self.num_shards,
            page_size=self.page_size, cache_itemsize=np.dtype(self.pool.latent_dtype).itemsize,
            num_shards=self.num_shards, split=self.ws.split,
            wire_itemsize=2 if self.ws.wire_dtype == "bf16" else 4)

    def _gather_queries(self, q_row: jax.Array, index: IndexerInputs | None
                        ) -> tuple[jax.Array, IndexerInputs | None]:
        """gather_q: every head of q f[B, Q, H', D] to every shard and, in a full layer, every
        head of the indexer's q with it, in one all-gather (its f32 values exact: the
        selection must be the one S = 1 makes)."""
        heads = self.model.num_attention_heads
        with phase("q_gather"):
            if index is None or index.heads is None:
                return self.ws.gather(q_row, -2, heads, wire=True), index
            q_row, index_q = self.ws.gather_heads(q_row, heads, index.q, index.heads)
            return q_row, dataclasses.replace(index, q=index_q, heads=None)

    def _attend_own_pages(self, q_row, cache, pages, masks, project) -> jax.Array:
        """gather_q: q_row f[B, Q, H, D] (every head, `_gather_queries`) over the pages this
        shard owns (their tokens in `masks`, `shard_selection.attended_entries`); the partials
        merged."""
        if self.pool.latent_on_host:
            with phase("sparse_attention"):
                cache, slots = host_latent.selected_pages(self, cache, pages)
        else:
            slots = self._slots_of(pages, -1)
        with phase("sparse_attention"):
            o, lse = self.kernels.sparse_attention(
                q_row, cache, slots, pages, self.pos,
                value_dim=self.model.kv_lora_rank, scale=self.model.softmax_scale,
                query_block=self.runtime.query_block, cache_dtype=self.pool.latent_dtype,
                sel_masks=masks)
        with phase("merge"):
            return self.combine(self.strategy.merge, o, lse, project, self.axis_name, self.ws,
                                self.strategy.gathers)

    def every_page(self, before: jax.Array) -> jax.Array:
        """gather_kv: the pages of the rows' tables from every shard.

        before: this shard's cache T[P + 1, ps, D] as the step found it
        returns: T[S * (B * M/S + 1), ps, D]: shard s's block holds its B * M/S table pages
                 then one spare page (the last block's spare takes the discarded rows of
                 `_write_every`, `_every_slot`)
        The pages are gathered from the cache before this layer's write, which the step's
        inputs alone determine, and the step's rows are written into the gathered copy after
        (`_write_every`): nothing of the layer's own work comes before the all-gather, so XLA
        may issue it early. Left to XLA:TPU, a 1M-token prompt's last chunk starts it after
        the indexer's kernel, with almost nothing beside it
        (docs/notes/2026-12-05-prefill-schedule.md, "What the schedule leaves exposed"); a chunk run
        as two halves gathers it ahead, beside an earlier layer's indexer kernels or attention
        (cp_runtime.model.halves, `ShardState.ahead`).
        """
        sentinel = before.shape[0] - 1
        table = jnp.append(self.local_table.reshape(-1), sentinel)          # [B * M/S + 1]
        with phase("kv_gather"):
            mine = (host_latent.table_pages(self, before) if self.pool.latent_on_host
                    else before[table])
            return lax.all_gather(mine, self.axis_name, tiled=True)

    def _write_every(self, every: jax.Array, kv_row: jax.Array) -> jax.Array:
        """The step's rows kv_row f[B, Q, D] (every shard holds them all) written into
        `every_page`'s pages, in place."""
        with phase("cache_write"):
            page = jnp.where(self.pos >= 0, self.pos // self.page_size, -1)
            b, q = self.pos.shape
            max_tiles = tiles_bound(b, q, write_tile_rows(every.shape, self.pool.latent_dtype))
            return self.kernels.write_kv(
                every, kv_row.reshape(-1, kv_row.shape[-1]),
                self._every_slot(page, every.shape[0]).reshape(-1),
                (jnp.maximum(self.pos, 0) % self.page_size).reshape(-1),
                cache_dtype=self.pool.latent_dtype, max_tiles=max_tiles)

    def _every_slot(self, pages: jax.Array, every_pages: int) -> jax.Array:
        """Where logical pages i32[B, ...] sit among `every_page`'s pages: the owner's block,
        row b's table in it, the local page; -1 pages at the last (discard) page."""
        b, m_local = self.local_table.shape
        rot = self.rotation.reshape((b,) + (1,) * (pages.ndim - 1))
        owner = owner_shard_jnp(pages, self.num_shards, rot)
        local = local_page_jnp(pages, self.num_shards, rot)
        row = jnp.arange(b, dtype=jnp.int32).reshape(rot.shape)
        return jnp.where(pages >= 0, owner * (b * m_local + 1) + row * m_local + local,
                         every_pages - 1)

    def _attend_every_page(self, q_row, every, pages, masks, project) -> jax.Array:
        """gather_kv: this shard's heads q_row f[B, Q, H', D] over every selected page of
        `every_page`'s pages; the heads' projections joined by a psum (into each row's
        device where the rows are split, which may attend them there: `_attend_own_rows`).
        With the weights gathered whole (`rows_attend` "weights"), q_row is every head of
        this shard's rows f[R / S, H, D], and `project` takes them to hidden space whole.
        masks: the entries' token masks (`shard_selection.attended_entries`), or None."""
        with phase("sparse_attention"):
            slots = jnp.where(pages >= 0, self._every_slot(pages, every.shape[0]), -1)
        if self.rows_attend == "weights":
            own = self.ws.own_rows
            o = self._every_page_attention(q_row[None], every, own(slots)[None],
                                           own(pages)[None], own(self.pos)[None],
                                           None if masks is None else own(masks)[None])
            with phase("merge"):
                return project(o[0])              # every head: this row's whole output
        if self.rows_attend == "rows":
            o = self._attend_own_rows(q_row, every, slots, pages, masks)
        else:
            o = self._every_page_attention(q_row, every, slots, pages, self.pos, masks)
        with phase("merge"):
            return self.ws.join_rows(project(o))

    def _attend_own_rows(self, q_row, every, slots, pages, masks) -> jax.Array:
        """gather_kv with the rows split: every head of this device's R / S rows attends, so
        each selected page a block of queries reads serves all H heads, not H / S: S times
        fewer page reads than attending its heads of every row, for two all-to-alls of the
        rows' q and outputs. q_row f[B, Q, H', D] -> o f[B, Q, H', V] (its heads again)."""
        own = self.ws.own_rows
        with phase("q_gather"):
            q_own = self.ws.heads_to_rows(q_row)                        # [R / S, S H', D]
        o = self._every_page_attention(q_own[None], every, own(slots)[None], own(pages)[None],
                                       own(self.pos)[None],
                                       None if masks is None else own(masks)[None])
        with phase("merge"):
            return self.ws.rows_to_heads(o[0], self.pos.shape)

    def row_mode(self, head_weight_bytes: int, dequantised_elements: int) -> str:
        """`row_attention_mode` for this step, where its rows are split, over the pages
        `every_page` gathers; head_weight_bytes: this shard's q_b, kv_b and o_proj of a
        layer, with their scales; dequantised_elements: the values of those weights, whole,
        that XLA would dequantise."""
        b, q = self.pos.shape
        every_pages = self.num_shards * (b * self.local_table.shape[1] + 1)
        heads = -(-self.model.num_attention_heads // self.num_shards) * self.num_shards
        return row_attention_mode(
            self.strategy.row_attention, rows=b * q, heads=heads,
            latent_dim=self.model.latent_dim, value_dim=self.model.kv_lora_rank,
            hidden=self.model.hidden_size, q_lora_rank=self.model.q_lora_rank,
            entries=self.entries, every_pages=every_pages,
            page_size=self.page_size, cache_dtype=self.pool.latent_dtype,
            num_shards=self.num_shards, wire_itemsize=2 if self.ws.wire_dtype == "bf16" else 4,
            query_block=self.runtime.query_block, head_weight_bytes=head_weight_bytes,
            dequantised_elements=dequantised_elements,
            mask_words=mask_words(self.page_size) if self.token_selection else 0)

    def _every_page_attention(self, q, every, slots, pages, pos, masks) -> jax.Array:
        """The sparse kernel over `every_page`'s pages: q f[B', Q', h, D], slots and pages
        i32[B', Q', N], pos i32[B', Q'], masks i32[B', Q', N, W] or None -> o f32[B', Q', h, V]."""
        with phase("sparse_attention"):
            o, _ = self._every_page_kernels.sparse_attention(
                q, every, slots, pages, pos, value_dim=self.model.kv_lora_rank,
                scale=self.model.softmax_scale, query_block=self.runtime.query_block,
                cache_dtype=self.pool.latent_dtype, sel_masks=masks)
        return o

    @property
    def _every_page_kernels(self) -> Kernels:
        """The kernel set for a cache whose pages are all this shard's (the XLA path sizes its
        page unions by the shards' count)."""
        return select_kernels(self.kernels.name, 1)
