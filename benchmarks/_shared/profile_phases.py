"""Timed per-phase sub-programs for `cp-runtime bench profile` (profile.py): one jitted
shard_map program per device phase of a step (cache write, indexer, top-K and gather,
attention, merge, dense layers, sampling), given inputs shaped like the step's and timed one
by one. Every call into the runtime's model and merge is here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from cp_runtime.benchmarks._shared.profile_steps import (executor_parts, executor_pool,
                                                         median_seconds, set_executor_pool)
from cp_runtime.benchmarks._shared.profile_work import StepShape
from cp_runtime.cache.layout import local_page_jnp, owner_shard_jnp
from cp_runtime.cache.pool import CP_AXIS, KVPool
from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.kernels.dispatch import select_kernels
from cp_runtime.model.layers import forward
from cp_runtime.model.ops import logits
from cp_runtime.model.sampler import sample_tokens
from cp_runtime.parallel.merge import combine
from cp_runtime.parallel.selection import attended_pages, global_top_pages, local_candidates
from cp_runtime.weights.shards import WeightShards

__all__ = ["PhasePrograms", "time_phases"]


# -- the runtime's model and merge: every call into them is here ----------------------------
def _merge(runtime: RuntimeConfig, o: jax.Array, lse: jax.Array) -> jax.Array:
    """The step's merge of one layer's partials over `cp` (weights whole on every shard, as
    the profile's engine holds them): o f32[B, Q, H, Dv], lse f32[B, Q, H] of this shard ->
    the merged result, with the output projection (timed in the dense phase) left out."""
    return combine(runtime.strategy.merge, o, lse, lambda merged: merged, CP_AXIS,
                   WeightShards(), runtime.strategy.gathers)


def _dense_layers(params, model: ModelConfig, tokens: jax.Array, pos: jax.Array,
                  keep_hidden: bool):
    """layers.forward with attention replaced by a stub that only adds its inputs (so none of
    them is dead code): tokens i32[B, Q] -> hidden f[B, Q, hidden], or, without keep_hidden,
    the rows the cache takes (kv_row per layer, indexer key per full layer), so that XLA drops
    what a "fill" step drops (the last layer after its cache rows, the final norm)."""
    def stub(layer, rows, q_row, kv_row, index, *project):
        o = q_row[..., :model.kv_lora_rank] + kv_row[..., None, :model.kv_lora_rank]
        rows = rows + (kv_row,)
        if index is not None:
            o = o + (index.q.sum((-1, -2)) + index.w.sum(-1))[..., None, None]
            rows = rows + (index.k,)
        # A forward that hands attention the output projection wants it applied there.
        return (project[0](o) if project else o), rows

    hidden, rows = forward(params, model, tokens, pos, stub, ())
    return hidden if keep_hidden else rows


def _lm_head(params, hidden: jax.Array) -> jax.Array:
    """hidden f[B, hidden] -> logits f32[B, V]."""
    return logits(params, hidden)


# -- the phase programs ---------------------------------------------------------------------
def _slots_of(pages: jax.Array, table: jax.Array, rotation: jax.Array, shard: jax.Array,
              num_shards: int, sentinel: int) -> jax.Array:
    """Local slot of logical pages i32[B, ...] where this shard owns them, else `sentinel`
    (the lookup the step's attention does before each kernel). table i32[B, M / S]."""
    b = pages.shape[0]
    rot = rotation.reshape((b,) + (1,) * (pages.ndim - 1))
    local = jnp.clip(local_page_jnp(pages, num_shards, rot), 0, table.shape[1] - 1)
    slots = jnp.take_along_axis(table, local.reshape(b, -1), axis=1).reshape(pages.shape)
    owned = (pages >= 0) & (owner_shard_jnp(pages, num_shards, rot) == shard)
    return jnp.where(owned, slots, sentinel)


class PhasePrograms:
    """One jitted shard_map program per device phase of one kind of step, for one mesh; each
    runs its phase for every layer the step keeps (`layers`, full-layer `slots`). Shapes (per
    shard inside; B rows, Q queries, M table width, L' = len(layers), F' = len(slots)):

        cache_write(latent, indexer, kv_rows f[L, B, Q, D_lat], key_rows f[F, B, Q, Di], pos,
                    tables, rotation) -> (latent, indexer)         pool buffers donated
        indexer(indexer, q f[F', B, Q, Hi, Di], w f[F', B, Q, Hi], pos, tables, rotation)
                    -> scores f32[S, F', B, Q, M / S]
        top_k(scores, pos, rotation) -> selection i32[F', B, Q, K]
        attention(latent, q_rows f[L', B, Q, H, D_lat], selection, pos, tables, rotation)
                    -> o f32[S, L', B, Q, H, Dv], lse f32[S, L', B, Q, H]
        merge(o, lse) -> o f32[L', B, Q, H, Dv]
        dense(params, tokens, pos) -> hidden f[B, Q, hidden] (decode) or the cache rows
        sampling(params, hidden f[B, hidden], sampling arrays, position i32[B])
                    -> tokens i32[B], logprobs f32[B]
    """

    def __init__(self, model: ModelConfig, runtime: RuntimeConfig, pool_spec, mesh,
                 shape: StepShape):
        self.model, self.runtime, self.spec = model, runtime, pool_spec
        self.layers, self.slots = shape.live_layers(model)
        self.keep_hidden = shape.kind == "decode"
        self.kernels = select_kernels(runtime.strategy.backend, runtime.num_shards)
        sh, rep = PartitionSpec(CP_AXIS), PartitionSpec()

        def spmd(body, in_specs, out_specs, donate=()):
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                         out_specs=out_specs, check_vma=False),
                           donate_argnums=donate)

        self.cache_write = spmd(self._cache_write, (sh, sh, rep, rep, rep, sh, rep), (sh, sh),
                                donate=(0, 1))
        self.indexer = spmd(self._indexer, (sh, rep, rep, rep, sh, rep), sh)
        self.top_k = spmd(self._top_k, (sh, rep, rep), rep)
        self.attention = spmd(self._attention, (sh, rep, rep, rep, sh, rep), (sh, sh))
        self.merge = spmd(self._merge, (sh, sh), rep)
        self.dense = spmd(self._dense, (rep, rep, rep), rep)
        self.sampling = spmd(self._sampling, (rep, rep, rep, rep), rep)

    @property
    def _shards(self) -> int:
        return self.runtime.num_shards

    def _cache_write(self, latent, indexer, kv_rows, key_rows, pos, tables, rotation):
        ps, shard = self.runtime.page_size, lax.axis_index(CP_AXIS)
        page = jnp.where(pos >= 0, pos // ps, -1)
        slots = _slots_of(page, tables[0], rotation, shard, self._shards,
                          latent[0].shape[1] - 1).reshape(-1)
        offsets = (jnp.maximum(pos, 0) % ps).reshape(-1)

        def write(buf, rows, dtype):
            return self.kernels.write_kv(buf[0], rows.reshape(-1, rows.shape[-1]), slots,
                                         offsets, cache_dtype=dtype)[None]

        return (tuple(write(b, kv_rows[i], self.spec.latent_dtype) for i, b in enumerate(latent)),
                tuple(write(b, key_rows[i], self.spec.indexer_dtype)
                      for i, b in enumerate(indexer)))

    def _indexer(self, indexer, q, w, pos, tables, rotation):
        shard = lax.axis_index(CP_AXIS)
        return jnp.stack([self.kernels.indexer_page_scores(
            q[i], w[i], indexer[slot][0], tables[0], pos, shard, rotation,
            num_shards=self._shards, key_block_pages=self.runtime.key_block_pages,
            cache_dtype=self.spec.indexer_dtype) for i, slot in enumerate(self.slots)])[None]

    def _top_k(self, scores, pos, rotation):
        k, shard = self.model.index_topk // self.runtime.page_size, lax.axis_index(CP_AXIS)
        out = []
        for layer_scores in scores[0]:
            cand_scores, cand_pages = local_candidates(
                layer_scores, pos, shard, rotation, num_shards=self._shards,
                page_size=self.runtime.page_size, k=k)
            out.append(global_top_pages(cand_scores, cand_pages, k=k, axis_name=CP_AXIS,
                                        gathers=self.runtime.strategy.gathers))
        return jnp.stack(out)

    def _attention(self, latent, q_rows, selection, pos, tables, rotation):
        shard, outs = lax.axis_index(CP_AXIS), []
        for i, layer in enumerate(self.layers):
            chosen = selection[self.slots.index(self.model.indexer_slot(layer))]
            pages = attended_pages(chosen, pos, self.runtime.page_size)
            slots = _slots_of(pages, tables[0], rotation, shard, self._shards, -1)
            outs.append(self.kernels.sparse_attention(
                q_rows[i], latent[layer][0], slots, pages, pos,
                value_dim=self.model.kv_lora_rank, scale=self.model.softmax_scale,
                query_block=self.runtime.query_block, cache_dtype=self.spec.latent_dtype))
        return (jnp.stack([o for o, _ in outs])[None], jnp.stack([lse for _, lse in outs])[None])

    def _merge(self, o, lse):
        return jnp.stack([_merge(self.runtime, o[0, i], lse[0, i]) for i in range(o.shape[1])])

    def _dense(self, params, tokens, pos):
        return _dense_layers(params, self.model, tokens, pos, self.keep_hidden)

    def _sampling(self, params, hidden, sampling, position):
        return sample_tokens(_lm_head(params, hidden), sampling, position)


def _random(mesh, shape: tuple[int, ...], dtype, seed: int, scale: float = 1.0) -> jax.Array:
    """N(0, scale^2) values, replicated over the mesh (as the step's activations are)."""
    x = np.random.default_rng(seed).standard_normal(shape, np.float32) * scale
    return jax.device_put(x.astype(dtype), NamedSharding(mesh, PartitionSpec()))


def time_phases(programs: PhasePrograms, executor, segment, act_dtype,
                repeats: int) -> dict[str, float]:
    """Median seconds of each device phase on `segment`'s inputs and the executor's pool, with
    activations of `act_dtype` (the weights' dtype). Phases feed the next one what the step
    would (scores -> selection -> partials)."""
    model, (mesh, params) = programs.model, executor_parts(executor)
    tokens, pos, tables, rotation, logit_index, sampling = segment.to_device(
        mesh, programs.runtime.num_shards)
    b, q = segment.inputs.tokens.shape
    f, layers, dlat = model.num_full_layers, model.num_hidden_layers, model.latent_dim
    hi, di, h = model.index_n_heads, model.index_head_dim, model.num_attention_heads
    live, slots = len(programs.layers), len(programs.slots)
    seconds = {}

    def write():
        pool = executor_pool(executor)
        latent, indexer = programs.cache_write(pool.latent, pool.indexer, kv_rows, key_rows,
                                               pos, tables, rotation)
        set_executor_pool(executor, KVPool(latent=latent, indexer=indexer))
        return latent, indexer

    kv_rows = _random(mesh, (layers, b, q, dlat), act_dtype, 1)
    key_rows = _random(mesh, (f, b, q, di), act_dtype, 2)
    seconds["cache_write"] = median_seconds(write, repeats)

    iq = _random(mesh, (slots, b, q, hi, di), act_dtype, 3)
    iw = _random(mesh, (slots, b, q, hi), act_dtype, 4)

    def score():
        return programs.indexer(executor_pool(executor).indexer, iq, iw, pos, tables, rotation)

    seconds["indexer"] = median_seconds(score, repeats)
    scores = score()
    seconds["top_k"] = median_seconds(lambda: programs.top_k(scores, pos, rotation), repeats)
    selection = programs.top_k(scores, pos, rotation)

    q_rows = _random(mesh, (live, b, q, h, dlat), act_dtype, 5, scale=0.1)

    def attend():
        return programs.attention(executor_pool(executor).latent, q_rows, selection, pos, tables,
                                  rotation)

    seconds["attention"] = median_seconds(attend, repeats)
    o, lse = attend()
    seconds["merge"] = median_seconds(lambda: programs.merge(o, lse), repeats)
    seconds["dense"] = median_seconds(lambda: programs.dense(params, tokens, pos), repeats)
    if segment.kind == "sample":
        hidden = _random(mesh, (b, model.hidden_size), act_dtype, 6)
        position = jnp.take_along_axis(pos, logit_index[:, None], axis=1)[:, 0] + 1
        seconds["sampling"] = median_seconds(
            lambda: programs.sampling(params, hidden, sampling, position), repeats)
    return seconds

