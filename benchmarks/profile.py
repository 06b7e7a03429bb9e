"""Where the time of a step goes: each phase of a decode step and of a prefill chunk, timed on
its own at several context lengths and shard counts, next to the whole step, with each phase's
minimum bytes and flops and the fraction of this machine's measured bandwidth and matmul rate
it achieves.

    cp-runtime bench profile --quick          # 8K and 32K, S = 16 and 2 (writes out/profile.*)
    cp-runtime bench profile                  # 8K, 128K and 1M, S = 16 and 2
    cp-runtime bench profile --model-tpu      # and the TPU v7x model table (tpu_model.py)

Method: timed sub-programs, not JAX's profiler (XLA:CPU's trace names fused ops, not phases).
Each device phase is its own jitted `shard_map` program over the `cp` mesh, given inputs shaped
like the real step's: the step's own device inputs (tokens, positions, per-shard page tables,
rotation, from the same `build_segment` the engine plans with), the engine's pool, and random
activations of the step's shapes. A phase runs for every layer it runs in (a Python loop, as in
the step) and returns what it computes, so XLA keeps all of it. Time = median of `--repeats`
calls after a warm-up call that compiles, each waited for with `block_until_ready`.

Phases, as the step delimits them (cp_runtime/model/attention.py, model.py, step.py):

    host planning and dispatch   the engine's planning and applying of results (its `host_s`)
                                 + the executor's transfer of the plan to the devices + launching
                                 a program that takes the step's arguments and does nothing
                                 (dispatch) + the outputs to the host
    cache write                  write_kv of the step's rows: latent (every layer) and indexer
                                 keys (full layers), owner shard only, pool donated (in place)
    indexer scoring              indexer_page_scores over the shard's pages (full layers)
    local top-K and all-gather   local_candidates, then global_top_pages (full layers), its
                                 gather flat or staged as --gathers says
    sparse attention             attended_pages, owned slots, sparse_attention (every layer)
    merge                        cp_runtime.parallel.merge.combine with --merge and --gathers (every
                                 layer), the output projection left to the dense phase; the
                                 engine runs the same variant
    dense and MoE layers         model.forward with attention replaced by a stub that only adds
                                 its inputs: embedding, norms, MLA and indexer projections, RoPE,
                                 W_uv/W_o, MLPs and experts, final norm
    sampling                     lm head on the sampled row and sample_tokens (decode only: a
                                 prefill chunk is a "fill" segment, it samples nothing)

Only what the step keeps is timed: a prefill chunk returns nothing but the cache, so XLA drops
its last layer's attention and merge (and a selection only that layer uses) and everything after
the last cache rows; the phase programs drop the same.

The whole step is an engine step (`Engine.step`, a one-token generation or one prefill chunk)
with its host and device seconds (`StepTiming`); the device program is the executor's compiled
step on the same segment, call to done. The sum of phases is shown beside both: it misses the
step's glue between phases and adds each phase program's own launch (at S = 16 virtual CPU
devices a launch alone is most of a small phase: compare S = 2).

Context: a decode step "at N" runs the token at position N - 1 of an N-token session; a prefill
chunk "at N" writes positions [N - chunk, N). The pool is synthetic: random values in every
page, and a session whose page table covers N tokens (nothing is prefilled), so 1M tokens cost
seconds; content decides which pages are selected, not how many.

Minimum work (throughput.py's accounting, all shards together; t the step's query positions,
ps the page size, K = index_topk / ps, L layers, F full layers, S shards):

    cache write      rows x bytes_per_token (capacity.py)                 no flops
    indexer          throughput.indexer_work: keys of every earlier page per query
    top-K, gather    F x (sum_t (t // ps) x 4 [scores read] + S (S - 1) K 8 x rows [received])
    attention        throughput.attention_work: own page + min(K, t // ps) pages per query;
                     pages read: a chunk's own pages + the K its first query selects
    merge            L x S x rows x H x (2 Dv + 1) x 4 bytes (read partials, write result),
                     L x S x rows x H x Dv x 2 flops (rescale and add)
    dense and MoE    throughput.projection_work, replicated on every shard (the CPU design);
                     for a prefill chunk it also counts the last layer's dropped projections
    sampling         its lm-head share of projection_work (1 logit row)

Fractions are achieved / peak, the peak from benchmarks/roofline.py measured in the same run
over the same S devices (aggregate over the devices). Elementwise phases report a bandwidth
fraction and little or no flop fraction; collectives are counted as bytes moved.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tqdm import tqdm
from jax.sharding import NamedSharding, PartitionSpec

from cp_runtime.benchmarks import tpu_model
from cp_runtime.benchmarks.common import init_shard_devices, machine, print_table, write_json
from cp_runtime.benchmarks.plots import stacked_bar_chart, token_label
from cp_runtime.benchmarks.roofline import measure_roofline
from cp_runtime.benchmarks.throughput import (Work, attention_work, cache_write_work,
                                              indexer_work, projection_work)
from cp_runtime.cache.layout import cdiv, local_page_jnp, owner_shard_jnp
from cp_runtime.cache.pool import CP_AXIS, KVPool
from cp_runtime.cli.args import (HelpFormatter, add_backend, add_chunk_size, add_gathers,
                                 add_kv_cache_dtype, add_model, add_no_progress, add_out,
                                 add_page_size, add_shard_counts, add_weight_dtype,
                                 check_not_below_page, check_out_dir, check_page_size,
                                 check_page_size_for_model, length_list, positive_int)
from cp_runtime.config import MERGE_VARIANTS, ModelConfig, RuntimeConfig, load_model_config
from cp_runtime.engine import Engine, LocalExecutor
from cp_runtime.engine.plans import Row, build_segment, sampling_arrays
from cp_runtime.engine.requests import Extend, Generate, SamplingParams
from cp_runtime.kernels.dispatch import resolve_backend, select_kernels
from cp_runtime.kernels.storage import to_storage
from cp_runtime.model.forward import forward, logits
from cp_runtime.model.sampler import sample_tokens
from cp_runtime.parallel.merge import combine
from cp_runtime.parallel.selection import attended_pages, global_top_pages, local_candidates
from cp_runtime.weights.params import init_params
from cp_runtime.weights.shards import WeightShards

__all__ = ["PHASES", "StepShape", "phase_work", "build_parser", "parse_args", "main"]

# (key, label) of each phase, in step order; host first (it precedes and follows the program).
PHASES = (("host", "host planning and dispatch"), ("cache_write", "cache write"),
          ("indexer", "indexer scoring"), ("top_k", "local top-K and all-gather"),
          ("attention", "sparse attention"), ("merge", "merge"),
          ("dense", "dense and MoE layers"), ("sampling", "sampling"))
DECODE_PHASES = tuple(key for key, _ in PHASES)
PREFILL_PHASES = tuple(key for key in DECODE_PHASES if key != "sampling")
LABELS = dict(PHASES)
FULL_LENGTHS = "8k,128k,1m"
QUICK_LENGTHS = "8k,32k"
METHOD = ("timed sub-programs: one jitted shard_map program per phase on the step's own inputs "
          "and pool, median of the repeats after a compiling call; host = the engine's host time "
          "+ plan transfer + an empty program with the step's arguments + output fetch")


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One profiled step: a decode step or a prefill chunk that ends with `length` tokens in
    the session. It runs the queries at positions [start, length)."""

    kind: str            # "decode" or "prefill"
    length: int
    start: int

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.length)

    @property
    def phases(self) -> tuple[str, ...]:
        return DECODE_PHASES if self.kind == "decode" else PREFILL_PHASES

    def live_layers(self, model: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(layers whose attention output the step uses, full-layer slots whose selection they
        use). A decode step samples from the last layer, so every layer counts; a prefill
        chunk returns only the cache, so the last layer's attention (and a selection only it
        uses) is dead code that XLA drops from the step, and the profile drops it too."""
        layers = tuple(range(model.num_hidden_layers - (self.kind == "prefill")))
        return layers, tuple(sorted({model.indexer_slot(layer) for layer in layers}))


def step_shape(kind: str, length: int, chunk: int) -> StepShape:
    return StepShape(kind, length, length - 1 if kind == "decode" else max(0, length - chunk))


# -- the runtime's model, merge and executor: every call into them is here ------------------
def _merge(runtime: RuntimeConfig, o: jax.Array, lse: jax.Array) -> jax.Array:
    """The step's merge of one layer's partials over `cp` (weights whole on every shard, as
    the profile's engine holds them): o f32[B, Q, H, Dv], lse f32[B, Q, H] of this shard ->
    the merged result, with the output projection (timed in the dense phase) left out."""
    return combine(runtime.merge, o, lse, lambda merged: merged, CP_AXIS, WeightShards(),
                   runtime.gathers)


def _dense_layers(params, model: ModelConfig, tokens: jax.Array, pos: jax.Array,
                  keep_hidden: bool):
    """model.forward with attention replaced by a stub that only adds its inputs (so none of
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


def _executor_parts(executor) -> tuple:
    """(mesh, params on the mesh) of a LocalExecutor."""
    return executor.mesh, executor.params


def _pool(executor) -> KVPool:
    return executor.pool


def _set_pool(executor, pool: KVPool) -> None:
    executor.pool = pool


def _start_step(executor, args: tuple, kind: str):
    """Start the executor's compiled step (the engine's program: same jit, same shapes, no new
    compile) on device inputs `args`; it updates the pool in place as a step does. Returns the
    segment's output and the new pool, not waited for."""
    _, params = _executor_parts(executor)
    (out,), pool = executor._step(params, _pool(executor), args, kinds=(kind,))
    _set_pool(executor, pool)
    return out, pool


def _start_empty_step(executor, args: tuple, noop) -> jax.Array:
    """Start `noop` (make_noop) on what the step takes: the cost of launching a program with
    the step's arguments on the S devices, without the step's work."""
    _, params = _executor_parts(executor)
    return noop(params, _pool(executor), args)


def make_noop(mesh) -> Callable:
    """A jitted program over every device of `mesh` that takes any arguments, keeps them (as
    the step's program does) and computes nothing: f32[S] zeros."""
    return jax.jit(lambda *args: jnp.zeros((mesh.size,), jnp.float32), keep_unused=True,
                   out_shardings=NamedSharding(mesh, PartitionSpec(CP_AXIS)))


# -- minimum work --------------------------------------------------------------------------
def phase_work(model: ModelConfig, shape: StepShape, *, page_size: int, kv_cache_dtype: str,
               shards: int, param_bytes: int, rows: int = 1) -> dict[str, Work]:
    """Minimum bytes and flops of each phase of one step, all shards together (module doc),
    over the layers the step keeps (StepShape.live_layers)."""
    t, ps, s = shape.positions, page_size, shards
    k = model.index_topk // ps
    layers, slots = shape.live_layers(model)
    live = len(layers) / model.num_hidden_layers                 # attention, merge
    live_full = len(slots) / model.num_full_layers              # indexer, top-K
    earlier = (t // ps) * ps                                      # keys of earlier pages
    selected = np.minimum(k, t // ps)
    own_pages = cdiv(shape.length, ps) - shape.start // ps
    queries = rows * len(t)
    merged = len(layers) * s * queries * model.num_attention_heads
    dv = model.kv_lora_rank
    dense = projection_work(model, queries, logit_rows=0, param_bytes=param_bytes, replicas=s)
    head = projection_work(model, queries, logit_rows=rows, param_bytes=param_bytes, replicas=s)
    work = {
        "host": Work(),
        "cache_write": cache_write_work(model, queries, kv_cache_dtype=kv_cache_dtype),
        "indexer": indexer_work(model, rows * int(earlier.sum()), rows * int(earlier.max()),
                                kv_cache_dtype=kv_cache_dtype).scaled(live_full),
        "top_k": Work(0, len(slots) * rows * (4 * int((t // ps).sum())
                                              + s * (s - 1) * k * 8 * len(t))),
        "attention": attention_work(model, rows * int((selected * ps + t % ps + 1).sum()),
                                    rows * (own_pages + int(selected[0])), page_size=ps,
                                    kv_cache_dtype=kv_cache_dtype).scaled(live),
        "merge": Work(merged * dv * 2, merged * (2 * dv + 1) * 4),
        "dense": dense,
        "sampling": Work(head.flops - dense.flops, head.bytes - dense.bytes),
    }
    return {key: work[key] for key in shape.phases}


# -- the synthetic pool and session ---------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _random_maker(shape: tuple[int, ...], sharding, value_dtype):
    """key -> a pool buffer (storage form) of N(0, 1) values of `value_dtype`, made on the
    devices; one compile per (shape, sharding, dtype), shared by a pool's equal buffers."""
    return jax.jit(lambda key: to_storage(jax.random.normal(key, shape, jnp.float32),
                                          value_dtype), out_shardings=sharding)


def _random_buffer(shape: tuple[int, ...], sharding, value_dtype, key: jax.Array) -> jax.Array:
    """A pool buffer (storage form) of N(0, 1) values of `value_dtype`, made on the devices."""
    return _random_maker(tuple(shape), sharding, value_dtype)(key)


def fill_pool(executor, seed: int = 0) -> None:
    """Random values in every page of every pool buffer (what a prefill would have left)."""
    spec, pool = executor.pool_spec, _pool(executor)
    latent = [(b.shape, b.sharding) for b in pool.latent]
    indexer = [(b.shape, b.sharding) for b in pool.indexer]
    keys = iter(jax.random.split(jax.random.key(seed), len(latent) + len(indexer)))
    _set_pool(executor, None)                               # free the zeros before the values
    del pool

    def fill(layout, dtype):
        return tuple(_random_buffer(shape, sharding, dtype, next(keys))
                     for shape, sharding in layout)

    _set_pool(executor, KVPool(latent=fill(latent, spec.latent_dtype),
                               indexer=fill(indexer, spec.indexer_dtype)))


def synthetic_session(engine, length: int, cached: int, vocab: int):
    """A session of `cached` tokens whose page table already covers `length` tokens, all
    'in the cache' (the pool holds random values): a long context without a prefill."""
    session = engine.create_session()
    session.table = engine.allocator.grow(session.table, cdiv(length, engine.runtime.page_size))
    session.tokens = np.random.default_rng(length).integers(0, vocab, cached).tolist()
    session.kv_len = cached
    return session


def _rewind(session, tokens: int) -> None:
    """Back to the first `tokens` tokens, all cached (its pages stay reserved). Truncated in
    place: a sliced copy would be exactly full, and the step's one append would then copy all
    of it (0.6 ms at a million tokens), which serving's amortised appends never do."""
    del session.tokens[tokens:]
    session.kv_len = tokens


# -- timing ---------------------------------------------------------------------------------
def _median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `call()` waited for, after one compiling, warming call."""
    jax.block_until_ready(call())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def engine_steps(engine, session, shape: StepShape, repeats: int) -> dict:
    """Median host and device seconds of `repeats` engine steps of `shape` (after a warm-up
    step), each from the same session state. Leaves the session at `shape.length` tokens."""
    tokens = np.random.default_rng(shape.start).integers(0, engine.model.vocab_size,
                                                         shape.length - shape.start)
    timings = []
    for i in range(1 + repeats):
        if shape.kind == "prefill":
            _rewind(session, shape.start)
            engine.submit(Extend(id=("profile", i), session=session.id, tokens=tokens))
        else:
            _rewind(session, shape.length)
            engine.submit(Generate(id=("profile", i), session=session.id,
                                   sampling=SamplingParams(max_tokens=1)))
        engine.step()
        if engine.has_work:
            raise RuntimeError(f"a {shape.kind} step at {shape.length} took more than one step")
        timings.append(engine.timings[-1])
    _rewind(session, shape.length)
    host = statistics.median(t.host_s for t in timings[1:])
    device = statistics.median(t.device_s for t in timings[1:])
    whole = statistics.median(t.host_s + t.device_s for t in timings[1:])
    return {"engine_host_s": host, "engine_device_s": device, "whole_step_s": whole}


def step_segment(engine, session, shape: StepShape):
    """The segment the engine plans for `shape` (same rows, widths and page table)."""
    rt = engine.runtime
    tokens = np.random.default_rng(shape.start).integers(
        0, engine.model.vocab_size, shape.length - shape.start).tolist()
    row = Row(session.table, tokens, shape.start)
    common = dict(page_size=rt.page_size, num_shards=rt.num_shards,
                  sentinel=engine.allocator.sentinel)
    if shape.kind == "decode":
        return build_segment("sample", [row], **common,
                             sampling=sampling_arrays([SamplingParams(max_tokens=1)], [0]))
    return build_segment("fill", [row], width=rt.chunk_size, **common)


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
        self.kernels = select_kernels(runtime.backend, runtime.num_shards)
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
                                        gathers=self.runtime.gathers))
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
    model, (mesh, params) = programs.model, _executor_parts(executor)
    tokens, pos, tables, rotation, logit_index, sampling = segment.to_device(
        mesh, programs.runtime.num_shards)
    b, q = segment.inputs.tokens.shape
    f, layers, dlat = model.num_full_layers, model.num_hidden_layers, model.latent_dim
    hi, di, h = model.index_n_heads, model.index_head_dim, model.num_attention_heads
    live, slots = len(programs.layers), len(programs.slots)
    seconds = {}

    def write():
        pool = _pool(executor)
        latent, indexer = programs.cache_write(pool.latent, pool.indexer, kv_rows, key_rows,
                                               pos, tables, rotation)
        _set_pool(executor, KVPool(latent=latent, indexer=indexer))
        return latent, indexer

    kv_rows = _random(mesh, (layers, b, q, dlat), act_dtype, 1)
    key_rows = _random(mesh, (f, b, q, di), act_dtype, 2)
    seconds["cache_write"] = _median_seconds(write, repeats)

    iq = _random(mesh, (slots, b, q, hi, di), act_dtype, 3)
    iw = _random(mesh, (slots, b, q, hi), act_dtype, 4)

    def score():
        return programs.indexer(_pool(executor).indexer, iq, iw, pos, tables, rotation)

    seconds["indexer"] = _median_seconds(score, repeats)
    scores = score()
    seconds["top_k"] = _median_seconds(lambda: programs.top_k(scores, pos, rotation), repeats)
    selection = programs.top_k(scores, pos, rotation)

    q_rows = _random(mesh, (live, b, q, h, dlat), act_dtype, 5, scale=0.1)

    def attend():
        return programs.attention(_pool(executor).latent, q_rows, selection, pos, tables,
                                  rotation)

    seconds["attention"] = _median_seconds(attend, repeats)
    o, lse = attend()
    seconds["merge"] = _median_seconds(lambda: programs.merge(o, lse), repeats)
    seconds["dense"] = _median_seconds(lambda: programs.dense(params, tokens, pos), repeats)
    if segment.kind == "sample":
        hidden = _random(mesh, (b, model.hidden_size), act_dtype, 6)
        position = jnp.take_along_axis(pos, logit_index[:, None], axis=1)[:, 0] + 1
        seconds["sampling"] = _median_seconds(
            lambda: programs.sampling(params, hidden, sampling, position), repeats)
    return seconds


def program_parts(executor, segment, repeats: int) -> dict[str, float]:
    """Median seconds of the parts of the executor running `segment` (after a compiling run):
    transfer (the plan's arrays onto the devices), dispatch (an empty program with the step's
    arguments, call to done), device (the step's program, call to done) and fetch (outputs to
    host arrays)."""
    mesh, _ = _executor_parts(executor)
    noop, parts = make_noop(mesh), []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        args = jax.block_until_ready((segment.to_device(mesh, executor.runtime.num_shards),))
        t1 = time.perf_counter()
        jax.block_until_ready(_start_empty_step(executor, args, noop))
        t2 = time.perf_counter()
        out = jax.block_until_ready(_start_step(executor, args, segment.kind))[0]
        t3 = time.perf_counter()
        jax.tree.map(np.asarray, out)
        parts.append((t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3))
    names = ("transfer_s", "dispatch_s", "device_s", "fetch_s")
    return {name: statistics.median(p[i] for p in parts[1:]) for i, name in enumerate(names)}


# -- one shard count ------------------------------------------------------------------------
def _runtime(model: ModelConfig, shards: int, args) -> RuntimeConfig:
    """A pool just big enough for the longest length (plus a page of slack per shard)."""
    pages = cdiv(cdiv(max(args.lengths), args.page_size), shards) + 2
    return RuntimeConfig(model=model.name, kv_cache_dtype=args.kv_cache_dtype,
                         num_shards=shards, pages_per_shard=pages, page_size=args.page_size,
                         chunk_size=args.chunk_size, backend=args.backend, merge=args.merge,
                         gathers=args.gathers, weight_dtype=args.weight_dtype)


def _fractions(work: Work, seconds: float, roof: dict) -> dict:
    gbs, gflops = work.bytes / seconds / 1e9, work.flops / seconds / 1e9
    return {"min_bytes": work.bytes, "min_flops": work.flops, "gb_per_s": gbs,
            "gflop_per_s": gflops, "bw_pct": 100 * gbs / roof["memory_gb_per_s"],
            "flop_pct": 100 * gflops / roof["matmul_gflop_per_s"]}


def profile_step(engine, programs: PhasePrograms, shape: StepShape, roof: dict, *,
                 param_dtype, repeats: int) -> dict:
    """Every phase of one step shape, the whole step and the device program, on a fresh
    synthetic session (closed afterwards)."""
    model, rt, executor = engine.model, engine.runtime, engine.executor
    cached = shape.start if shape.kind == "prefill" else shape.length
    session = synthetic_session(engine, shape.length, cached, model.vocab_size)
    try:
        whole = engine_steps(engine, session, shape, repeats)
        segment = step_segment(engine, session, shape)
        program = program_parts(executor, segment, repeats)
        seconds = time_phases(programs, executor, segment, np.dtype(param_dtype), repeats)
    finally:
        engine.close_session(session.id)
    seconds["host"] = (whole["engine_host_s"] + program["transfer_s"] + program["dispatch_s"]
                       + program["fetch_s"])
    work = phase_work(model, shape, page_size=rt.page_size, kv_cache_dtype=rt.kv_cache_dtype,
                      shards=rt.num_shards, param_bytes=np.dtype(param_dtype).itemsize)
    phases = [{"phase": key, "label": LABELS[key], "seconds": seconds[key],
               **_fractions(work[key], seconds[key], roof)} for key in shape.phases]
    device = sum(p["seconds"] for p in phases if p["phase"] != "host")
    return {"kind": shape.kind, "length": shape.length, "shards": rt.num_shards,
            "queries": shape.length - shape.start, "layers": list(programs.layers),
            "full_layer_slots": list(programs.slots), "phases": phases, **whole,
            **{f"program_{k}": v for k, v in program.items()}, "program_s": program["device_s"],
            "device_phases_s": device, "phases_sum_s": device + seconds["host"]}


def profile_shards(model: ModelConfig, params, shards: int, args, progress) -> dict:
    """Roofline and every (length, kind) step at one shard count, on one engine."""
    roof = measure_roofline(jax.devices()[:shards], mem_mib=args.roofline_mib,
                            matmul_n=args.matmul_n)
    rt = _runtime(model, shards, args)
    executor = LocalExecutor(model, rt, params)
    engine = Engine(model, rt, executor)
    fill_pool(executor)
    mesh, _ = _executor_parts(executor)
    param_dtype = params["model.embed_tokens.weight"].dtype            # the host copy's
    programs = {kind: PhasePrograms(model, rt, executor.pool_spec, mesh,
                                    step_shape(kind, max(args.lengths), args.chunk_size))
                for kind in ("decode", "prefill")}
    rows = []
    for length in args.lengths:
        for kind in ("decode", "prefill"):
            shape = step_shape(kind, length, args.chunk_size)
            rows.append(profile_step(engine, programs[kind], shape, roof,
                                     param_dtype=param_dtype, repeats=args.repeats))
            progress(f"{kind} {token_label(length)} S={shards}")
    executor.close()
    return {"roofline": roof, "rows": rows}


# -- output ---------------------------------------------------------------------------------
def _ms(seconds: float) -> float:
    return 1000 * seconds


def _summary_rows(row: dict) -> list[tuple[str, float]]:
    return [("sum of device phases", row["device_phases_s"]),
            ("device program (whole)", row["program_s"]),
            ("sum of phases", row["phases_sum_s"]),
            ("whole step (engine)", row["whole_step_s"])]


def print_tables(result: dict, args) -> None:
    info = machine()
    print_table([{"shards": s, **r["roofline"]} for s, r in result["by_shards"].items()],
                ["shards", "read_gb_per_s", "copy_gb_per_s", "matmul_n", "matmul_gflop_per_s"],
                title=f"roofline (measured in this run): {info['processor']}, "
                      f"{info['cpu_count']} cores, backend {info['backend']}")
    shards = list(result["by_shards"])
    for kind in ("decode", "prefill"):
        for length in args.lengths:
            rows = {s: next(r for r in result["by_shards"][s]["rows"]
                            if (r["kind"], r["length"]) == (kind, length)) for s in shards}
            print()
            print_table(_comparison(rows, shards), _columns(shards),
                        title=_title(kind, length, rows[shards[0]], args))


def _title(kind: str, length: int, row: dict, args) -> str:
    what = (f"decode step at {token_label(length)} (1 row)" if kind == "decode" else
            f"prefill chunk at {token_label(length)} ({row['queries']} tokens)")
    return (f"{what}: {args.model}, {args.kv_cache_dtype}, page {args.page_size}; ms, minimum "
            "MB and MFLOP, % of the measured bandwidth and matmul rate")


def _columns(shards: list[int]) -> list[str]:
    cols = ["phase"] + [f"S={s} ms" for s in shards]
    if len(shards) > 1:
        cols.append(f"S={shards[0]}/S={shards[-1]}")
    for s in shards:
        cols += [f"S={s} MB", f"S={s} MFLOP", f"S={s} bw%", f"S={s} flop%"]
    return cols


def _comparison(rows: dict[int, dict], shards: list[int]) -> list[dict]:
    """One table row per phase (then the sums), the shard counts side by side."""
    first, last = shards[0], shards[-1]
    out = []
    for i, phase in enumerate(rows[first]["phases"]):
        line = {"phase": phase["label"]}
        for s in shards:
            p = rows[s]["phases"][i]
            line |= {f"S={s} ms": _ms(p["seconds"]), f"S={s} MB": p["min_bytes"] / 1e6,
                     f"S={s} MFLOP": p["min_flops"] / 1e6, f"S={s} bw%": p["bw_pct"],
                     f"S={s} flop%": p["flop_pct"]}
        line[f"S={first}/S={last}"] = (rows[first]["phases"][i]["seconds"]
                                       / rows[last]["phases"][i]["seconds"])
        out.append(line)
    for j, (label, _) in enumerate(_summary_rows(rows[first])):
        line = {"phase": label}
        for s in shards:
            line[f"S={s} ms"] = _ms(_summary_rows(rows[s])[j][1])
        line[f"S={first}/S={last}"] = (_summary_rows(rows[first])[j][1]
                                       / _summary_rows(rows[last])[j][1])
        out.append(line)
    return out


def plot(result: dict, path: pathlib.Path, model: str) -> pathlib.Path:
    """Stacked bars of phase ms, one bar per (length, S); decode and prefill in two panels,
    a black tick at each whole engine step."""
    panels = []
    for kind in ("decode", "prefill"):
        rows = [r for s in result["by_shards"] for r in result["by_shards"][s]["rows"]
                if r["kind"] == kind]
        rows.sort(key=lambda r: (r["length"], -r["shards"]))
        keys = DECODE_PHASES if kind == "decode" else PREFILL_PHASES
        series = {LABELS[k]: [_ms(next(p["seconds"] for p in r["phases"] if p["phase"] == k))
                              for r in rows] for k in keys}
        groups = [f"{token_label(r['length'])}\nS={r['shards']}" for r in rows]
        panels.append((f"{kind} {'step' if kind == 'decode' else 'chunk'}", groups, series,
                       [_ms(r["whole_step_s"]) for r in rows]))
    return stacked_bar_chart(path, panels, ylabel="ms", title=f"{model}: time per phase "
                             "(bars) and whole engine step (ticks)")


# -- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cp-runtime bench profile", formatter_class=HelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:3]))
    add_model(p, "small")
    p.add_argument("--lengths", type=length_list, default=None, metavar="N[,N...]",
                   help=f"context lengths (default: {FULL_LENGTHS}; with --quick "
                        f"{QUICK_LENGTHS})")
    add_shard_counts(p, "16,2", why="S = 2 beside 16 shows what 16 devices' launches cost")
    add_kv_cache_dtype(p, "fp8_e4m3")
    add_weight_dtype(p)
    add_page_size(p, 64, why="64-token pages, as the TPU deployment configs use")
    add_chunk_size(p, 1024)
    add_backend(p, "auto")
    p.add_argument("--merge", choices=[m for m in MERGE_VARIANTS if m != "head_scatter"],
                   default="auto",
                   help="merge of the partial attention results (cp_runtime.parallel.merge; "
                        "weights are whole here, so not head_scatter)")
    add_gathers(p)
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed calls per phase and step (the median is reported)")
    p.add_argument("--quick", action="store_true",
                   help=f"lengths {QUICK_LENGTHS} unless --lengths is given (minutes on a CPU)")
    p.add_argument("--model-tpu", action="store_true",
                   help="also print the GLM-5.2 tpu7x-16 model table of `cp-runtime bench "
                        "tpu_model` (its defaults)")
    p.add_argument("--roofline-mib", type=positive_int, default=None,
                   help="bandwidth array size, all devices together (unset: by backend)")
    p.add_argument("--matmul-n", type=positive_int, default=None,
                   help="roofline matmul side per device (unset: by backend)")
    add_no_progress(p)
    add_out(p, "out")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for the largest of `--shards`
    set up, then `--out` created."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.lengths is None:
        args.lengths = length_list(QUICK_LENGTHS if args.quick else FULL_LENGTHS)
    args.lengths = sorted(set(args.lengths))
    args.shards = list(dict.fromkeys(args.shards))
    check_page_size(parser, args.page_size)
    check_page_size_for_model(parser, args.model, args.page_size)
    check_not_below_page(parser, "--lengths", args.lengths, args.page_size)
    init_shard_devices(parser, max(args.shards))
    check_out_dir(parser, args.out)
    return args


def run(args) -> dict:
    model = load_model_config(args.model)
    params = init_params(model, seed=0)
    t0 = time.perf_counter()
    with tqdm(total=len(args.shards) * len(args.lengths) * 2, desc="profile", leave=False,
              disable=args.no_progress) as bar:
        def progress(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()

        by_shards = {s: profile_shards(model, params, s, args, progress) for s in args.shards}
    return {"method": METHOD, "model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
            "page_size": args.page_size, "chunk_size": args.chunk_size, "merge": args.merge,
            "backend": resolve_backend(args.backend), "repeats": args.repeats,
            "lengths": args.lengths, "shards": args.shards,
            "seconds": time.perf_counter() - t0, "by_shards": by_shards}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_tables(result, args)
    out = pathlib.Path(args.out)
    path = write_json(out / "profile.json", {"args": vars(args), **result})
    png = plot(result, out / "profile.png", args.model)
    print(f"\n{result['seconds']:.0f} s in all; wrote {path}, {png}")
    if args.model_tpu:
        print()
        tpu_model.main(["--out", str(out)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
