"""Executors run step plans on devices. The engine decides everything (pages, positions, batch,
sampling seeds); an executor only turns a plan into a device step and hands back its outputs.

`LocalExecutor` runs on S devices of this process. An executor spanning several hosts
implements the same interface, running the same SPMD program on every host in lockstep.
"""

from __future__ import annotations

import abc
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from cp_runtime.cache import host_pages
from cp_runtime.cache.pool import CP_AXIS, CacheRows, KVPool, PoolSpec
from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.engine.step import Segment, make_step
from cp_runtime.kernels.dispatch import Kernels, select_kernels
from cp_runtime.kernels.page_words import is_words
from cp_runtime.kernels.storage import from_storage, pool_dtype, storage_dtype
from cp_runtime.weights.format import device_tensors, resolve_runtime_weights
from cp_runtime.weights.params import Params, model_layout
from cp_runtime.weights.placement import (ArrayBlocks, BlockSource, device_memory_bytes,
                                          param_structs, place_weights,
                                          weight_bytes_per_device)
from cp_runtime.weights.regroup import ExpertRegrouping

log = logging.getLogger(__name__)

__all__ = ["Executor", "LocalExecutor", "experts_for_plan", "pool_spec_for"]


def pool_spec_for(model: ModelConfig, runtime: RuntimeConfig) -> PoolSpec:
    return PoolSpec(model=model, kv_cache_dtype=runtime.kv_cache_dtype,
                    num_shards=runtime.num_shards, pages_per_shard=runtime.pages_per_shard,
                    page_size=runtime.page_size, latent_memory=runtime.latent_memory,
                    latent_device_pages=runtime.latent_device_pages)


class Executor(abc.ABC):
    """Contract: `run` executes one step plan (a tuple of `Segment`s, in order)
    and returns each segment's output as host arrays (None for "fill"; a (tokens i32[B],
    logprobs f32[B]) pair for "sample"; f32 logits for "logits"/"all_logits"); `copy_pages`
    copies physical pages (all layers), for forks and for spills to host memory. Calls are
    made in order and never concurrently."""

    pool_spec: PoolSpec
    platform: str = "cpu"          # the devices' platform: "cpu", "tpu"
    # Host seconds of the last `run` around the device program: moving the plan to the
    # devices and fetching the outputs (None where an executor does not split it out). The
    # launch is not in it: XLA:CPU runs part of a program before the call returns.
    last_host_s: float | None = None

    @abc.abstractmethod
    def run(self, plan: tuple[Segment, ...]) -> list: ...

    def compile(self, plan: tuple[Segment, ...]) -> None:
        """Compile (or load from the persistent compilation cache) the programs `run(plan)`
        would run, without running them (cp_runtime.engine.precompile)."""
        raise NotImplementedError(f"{type(self).__name__} cannot compile ahead")

    def compile_page_copy(self, copies: int = 1) -> None:
        """Compile the program `copy_pages` runs for `copies` copies (1: a fork's) without
        running it; an executor that cannot compile ahead compiles it on first use."""

    @abc.abstractmethod
    def copy_pages(self, shard: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        """Page src[i] -> dst[i] on shard[i] (i32[N] each), every layer; all read before any is
        written."""

    def read_rows(self, shard: np.ndarray, slot: np.ndarray, offset: np.ndarray) -> CacheRows:
        """The cached rows at (shard, slot, offset) i32[N] each, every layer (snapshots)."""
        raise NotImplementedError(f"{type(self).__name__} cannot read cache rows")

    def write_rows(self, shard: np.ndarray, slot: np.ndarray, offset: np.ndarray,
                   rows: CacheRows) -> None:
        """Write rows (from `read_rows`, any pool) at (shard, slot, offset) i32[N] each."""
        raise NotImplementedError(f"{type(self).__name__} cannot write cache rows")

    @abc.abstractmethod
    def rebuild(self) -> None:
        """After a failed `run` (whose pool may be gone: it was donated), get a fresh, empty
        pool; the engine then rebuilds every session's cache from its token log."""

    def stats(self, pages_used_per_shard: list[int] | None = None) -> dict:
        """What `stats` shows of the executor (a multi-host one: every worker's health and
        its hosts' pool usage, from the engine's pages in use per shard)."""
        return {"executor": type(self).__name__}

    def close(self) -> None:
        """Release devices/workers. Default: nothing to release."""


# The most copies one page-copy call takes: a host-held cache stages a call's pages in HBM,
# [copies, ps / pk, D] a layer (42 MB for GLM-5.2's pages of 64), and a spill of a 1M session
# is 16,384 copies over 16 shards.
MAX_COPIES = 1024


def copy_batch(n: int) -> int:
    """The entries a page-copy program takes for n <= MAX_COPIES copies: a power of two, at
    least `host_pages.GROUP` (a fork's page and a spill's batches: two compiled programs)."""
    return max(host_pages.GROUP, 1 << max(n - 1, 0).bit_length())


def make_page_copy(mesh):
    """copy(pool, shard, src, dst) -> pool: page src[i] -> dst[i] on shard[i] (i32[N] each;
    shard -1, nobody's), every layer, in place (donated).

    Each shard copies its own entries, the others pointing at its sentinel. No entry may write
    a page another reads (a fork's copy is one page; a spill's go from HBM slots to host
    ones)."""
    sharded, rep = PartitionSpec(CP_AXIS), PartitionSpec()

    def body(pool: KVPool, shard, src, dst) -> KVPool:
        mine = jax.lax.axis_index(CP_AXIS) == shard

        def copy(buf):                                        # [1, P + 1, ps, D]
            one = buf[0]
            sentinel = one.shape[0] - 1
            s, d = jnp.where(mine, src, sentinel), jnp.where(mine, dst, sentinel)
            order, count = host_pages.owned_first(s, sentinel)
            if is_words(one):                                 # a latent cache on the host
                staged = host_pages.read_pages(one, s[order], count)
                return host_pages.write_pages(one, staged[:s.shape[0]], d[order], count)[None]
            return _copy_in_place(one, s[order], d[order], count)[None]

        return jax.tree.map(copy, pool, is_leaf=host_pages.is_tiered)

    spmd = jax.shard_map(body, mesh=mesh, in_specs=(sharded, rep, rep, rep), out_specs=sharded,
                         check_vma=False)
    return jax.jit(spmd, donate_argnums=(0,))


def _copy_in_place(buf: jax.Array, src: jax.Array, dst: jax.Array,
                   count: jax.Array) -> jax.Array:
    """Pages src[i] -> dst[i] of buf T[P + 1, ps, D] for i < count, one in-place update each
    (a scatter of a batch of pages into an fp8 pool is a copy of the pool on TPU)."""
    def one(i, buf):
        return jax.lax.dynamic_update_slice_in_dim(
            buf, jax.lax.dynamic_slice_in_dim(buf, src[i], 1), dst[i], axis=0)

    return jax.lax.fori_loop(0, count, one, buf)


def _join_rows(rows: jax.Array, mine: jax.Array) -> jax.Array:
    """Rows T[N, D] held by one shard each -> the same rows on every shard, in the host form
    (storage.storage_dtype: unsigned integers for narrow floats, whatever the pool's form).
    Integers are summed as i32, so the join is exact and needs no narrow-float collective."""
    host = from_storage(rows, storage_dtype(rows.dtype))       # a bitcast, or nothing
    if host.dtype == jnp.float32:
        return jax.lax.psum(jnp.where(mine, host, 0), CP_AXIS)
    wide = jnp.where(mine, host.astype(jnp.int32), 0)
    return jax.lax.psum(wide, CP_AXIS).astype(host.dtype)


def make_row_io(mesh, kernels: Kernels, spec: PoolSpec):
    """(read, write) of cached rows at (shard, slot, offset) i32[N], every layer:

    read(bufs, shard, slot, offset) -> rows [N, D] per buffer in the host form, replicated
        (each shard reads the rows it holds, zeros elsewhere, and a psum joins them);
    write(pool, shard, slot, offset, latent rows, indexer rows) -> pool, in place (donated),
        through the step's own cache write (`kernels.write_kv`): each shard writes its own
        rows, the others go to its sentinel page. (A plain scatter into an fp8 pool is a
        whole-pool copy on TPU: the compiler asked for 106 GiB of temporaries.)
    """
    sharded, rep = PartitionSpec(CP_AXIS), PartitionSpec()

    storage = pool_dtype(spec.latent_dtype, mesh.devices.flat[0].platform)

    def rows_of(buf, slot, offset):
        if is_words(buf):                                     # a latent cache on the host
            return host_pages.read_rows(buf, slot, offset, storage)
        return buf[slot, offset]

    def read_body(bufs, shard, slot, offset):
        mine = (shard == jax.lax.axis_index(CP_AXIS))[:, None]
        return tuple(_join_rows(rows_of(b[0], slot, offset), mine) for b in bufs)

    def write_body(kv: KVPool, shard, slot, offset, latent, indexer) -> KVPool:
        mine = shard == jax.lax.axis_index(CP_AXIS)

        def write(cache, rows, slots, offsets, dtype):
            return kernels.write_kv(cache, rows, slots, offsets, cache_dtype=dtype,
                                    max_tiles=rows.shape[0])

        def put_one(buf, rows, dtype):                        # buf: [P + 1, ps, D]
            slots = jnp.where(mine, slot, buf.shape[0] - 1)
            if is_words(buf):                                 # a latent cache on the host
                return host_pages.write_rows(buf, rows, slots, offset, storage,
                                             functools.partial(write, dtype=dtype))
            return write(buf, rows, slots, offset, dtype)

        def put(bufs, rows, dtype):                           # bufs: [1, P + 1, ps, D] each
            return tuple(put_one(b[0], from_storage(r, dtype), dtype)[None]
                         for b, r in zip(bufs, rows))

        return KVPool(latent=put(kv.latent, latent, spec.latent_dtype),
                      indexer=put(kv.indexer, indexer, spec.indexer_dtype))

    read = jax.shard_map(read_body, mesh=mesh, in_specs=(sharded, rep, rep, rep), out_specs=rep,
                         check_vma=False)
    write = jax.shard_map(write_body, mesh=mesh, in_specs=(sharded, rep, rep, rep, rep, rep),
                          out_specs=sharded, check_vma=False)
    return jax.jit(read), jax.jit(write, donate_argnums=(0,))


def experts_for_plan(plan: tuple[Segment, ...], regroup: int, chunk_size: int,
                     now: int) -> int:
    """The groups the routed experts should be in for `plan`, when they are `now` in that many
    (1: as placed) and may be regrouped into `regroup` (RuntimeConfig.prefill_expert_groups):
    `regroup` for a plan with a whole chunk of prefill (`chunk_size` queries), 1 for one of
    decode rows alone, else as they are (a prompt's last, shorter chunk runs as its others
    did; a short prompt between decode steps does not pay two exchanges)."""
    if regroup == 1:
        return 1
    prefills = [seg for seg in plan if seg.inputs.tokens.shape[1] > 1]
    if any(int(np.sum(seg.inputs.positions >= 0)) >= chunk_size for seg in prefills):
        return regroup
    return now if prefills else 1


class LocalExecutor(Executor):
    """Runs steps on the first S devices of this process (or of every process, when JAX is
    distributed), with weights whole on each device or split over them (runtime.weights), in
    runtime.weight_dtype ("auto" of either is resolved here: `self.runtime` is concrete).

    weights: in-memory weights (HF or model layout), or a `BlockSource` that reads only the
    blocks this process's devices hold (a checkpoint).

    With runtime.prefill_expert_groups g > 1 the routed experts move between one group and g
    (cp_runtime.weights.regroup) before a plan that wants the other (`experts_for_plan`);
    `experts_in` says which they are in, and each layout has its own step program."""

    def __init__(self, model: ModelConfig, runtime: RuntimeConfig,
                 weights: Params | BlockSource):
        devices = jax.devices()
        if len(devices) < runtime.num_shards:
            raise ValueError(f"num_shards={runtime.num_shards} needs that many devices, "
                             f"{len(devices)} available (on CPU set jax_num_cpu_devices)")
        runtime = resolve_runtime_weights(runtime, model, device_memory_bytes())
        self.model, self.runtime = model, runtime
        self.platform = devices[0].platform
        self.mesh = jax.make_mesh((runtime.num_shards,), (CP_AXIS,),
                                  devices=devices[: runtime.num_shards])
        t0 = time.perf_counter()
        self.pool_spec = pool_spec_for(model, runtime)
        self.pool = KVPool.allocate(self.pool_spec, self.mesh)
        jax.block_until_ready(self.pool)
        log.info("pool: %d pages of %d tokens a shard over %d shards (%s) in %.1f s",
                 runtime.pages_per_shard, runtime.page_size, runtime.num_shards,
                 runtime.kv_cache_dtype, time.perf_counter() - t0)
        t0 = time.perf_counter()
        blocks = (ArrayBlocks(model_layout(weights, model)) if isinstance(weights, dict)
                  else weights)
        self.weight_tensors = device_tensors(blocks.shapes, model, runtime.weights,
                                             runtime.weight_dtype, runtime.num_shards,
                                             blocks.block, runtime.expert_groups)
        self.params = place_weights(blocks, self.weight_tensors, self.mesh, CP_AXIS)
        jax.block_until_ready(self.params)
        log.info("weights: %s, %s, on the devices in %.1f s", runtime.weights,
                 runtime.weight_dtype, time.perf_counter() - t0)
        self._shapes_run: set[tuple] = set()        # programs compiled so far, for the log
        self.kernels = select_kernels(runtime.strategy.backend, runtime.num_shards)
        self._copy_pages = make_page_copy(self.mesh)
        self._read_rows, self._write_rows = make_row_io(self.mesh, self.kernels, self.pool_spec)
        self.experts_in = 1
        self._regrouping = (ExpertRegrouping(self.mesh, self.weight_tensors,
                                             runtime.prefill_expert_groups, CP_AXIS)
                            if runtime.prefill_expert_groups > 1 else None)
        self._step = make_step(model, runtime, self.pool_spec, self.mesh, self.kernels,
                               self.weight_tensors)
        self._regrouped_step = None if self._regrouping is None else make_step(
            model, runtime, self.pool_spec, self.mesh, self.kernels, self._regrouping.grouped,
            experts_regrouped=self._regrouping.groups)

    def _step_for(self, groups: int):
        """The step program for the experts in `groups` groups (1: as placed)."""
        return self._step if groups == 1 else self._regrouped_step

    def _experts_for(self, plan: tuple[Segment, ...]) -> int:
        return experts_for_plan(plan, self.runtime.prefill_expert_groups,
                                self.runtime.chunk_size, self.experts_in)

    def _regroup(self, groups: int) -> None:
        """The routed experts into `groups` groups (1: back as placed), in place (an exchange
        that fails part-way puts back the layers it moved, then raises)."""
        if groups == self.experts_in:
            return
        t0 = time.perf_counter()
        if groups == 1:
            self._regrouping.to_one(self.params)
        else:
            self._regrouping.to_groups(self.params)
        self.experts_in = groups
        log.info("experts: in %d group%s, exchanged in %.2f s", groups,
                 "" if groups == 1 else "s", time.perf_counter() - t0)

    def run(self, plan: tuple[Segment, ...]) -> list:
        # One program per segment, in order: a step of decode rows plus a prefill chunk would
        # otherwise compile once per (rows, decode table width, prefill table width) and stall
        # serving for seconds at each new combination; separately their compiles add up.
        outs, host_s = [], 0.0
        self._regroup(self._experts_for(plan))
        step = self._step_for(self.experts_in)
        for seg in plan:
            t0 = time.perf_counter()
            args = seg.to_device(self.mesh, self.runtime.num_shards)
            host_s += time.perf_counter() - t0
            shape = _program_shape(seg, args)
            t0 = time.perf_counter()
            out, self.pool = step(self.params, self.pool, args, kind=seg.kind,
                                  in_hbm=seg.in_hbm)
            outs.append(out)
            # Wait for each program even when it returns nothing ("fill"): two SPMD programs
            # in flight at once deadlock XLA:CPU's collectives (their 16 device threads each
            # wait in a rendezvous the other program's threads never reach).
            jax.block_until_ready(self.pool)
            if shape not in self._shapes_run:
                self._shapes_run.add(shape)
                log.info("compile: a %s step of %dx%d tokens compiled and ran in %.1f s (its "
                         "first run; %d programs so far)", seg.kind, *seg.inputs.tokens.shape,
                         time.perf_counter() - t0, len(self._shapes_run))
        t0 = time.perf_counter()
        results = [_to_host(out, seg.kind) for out, seg in zip(outs, plan)]
        self.last_host_s = host_s + time.perf_counter() - t0
        return results

    def compile(self, plan: tuple[Segment, ...]) -> None:
        """Compile (or load from the persistent cache) each segment's program without running
        it; the next `run` of the same shapes finds them compiled. A multi-process group does
        this before a new shape's first step, so no process waits in a collective's rendezvous
        while another is still compiling (gloo gives a rendezvous 30 s). A plan that moves the
        experts compiles its exchange and the other layout's step."""
        groups = self._experts_for(plan)
        params = self.params
        if groups != self.experts_in:
            regrouping = self._regrouping
            exchange = regrouping.to_one_layer if groups == 1 else regrouping.to_groups_layer
            exchange.lower(regrouping.layer_arguments(self.params)).compile()
            params = param_structs(regrouping.grouped if groups > 1 else self.weight_tensors,
                                   self.mesh)
        for seg in plan:
            args = seg.to_device(self.mesh, self.runtime.num_shards)
            self._step_for(groups).lower(params, self.pool, args, kind=seg.kind,
                                         in_hbm=seg.in_hbm).compile()
            self._shapes_run.add(_program_shape(seg, args))

    def rebuild(self) -> None:
        self.pool = KVPool.allocate(self.pool_spec, self.mesh)

    def weight_bytes(self) -> dict[int, int]:
        """{device id: bytes of weights on it} (this process's devices)."""
        return weight_bytes_per_device(self.params)

    def stats(self, pages_used_per_shard: list[int] | None = None) -> dict:
        per_device = self.weight_bytes()
        return {"executor": type(self).__name__, "weights": self.runtime.weights,
                "weight_dtype": self.runtime.weight_dtype,
                "weight_bytes_per_device": max(per_device.values()),
                "expert_groups_now": self.experts_in if self._regrouping is not None
                else self.runtime.expert_groups}

    def read_rows(self, shard, slot, offset) -> CacheRows:
        where = tuple(np.asarray(a, np.int32) for a in (shard, slot, offset))
        latent, indexer = (self._read_rows(bufs, *where)
                           for bufs in (self.pool.latent, self.pool.indexer))
        return CacheRows(latent=np.stack([np.asarray(x) for x in latent]),
                         indexer=np.stack([np.asarray(x) for x in indexer]))

    def write_rows(self, shard, slot, offset, rows: CacheRows) -> None:
        where = tuple(np.asarray(a, np.int32) for a in (shard, slot, offset))
        self.pool = self._write_rows(self.pool, *where, tuple(rows.latent), tuple(rows.indexer))
        jax.block_until_ready(self.pool)

    def copy_pages(self, shard, src, dst) -> None:
        for first in range(0, len(shard), MAX_COPIES):
            part = [np.asarray(a[first:first + MAX_COPIES], np.int32) for a in (shard, src, dst)]
            n = copy_batch(len(part[0]))
            padded = (np.pad(a, (0, n - len(a)), constant_values=-1) for a in part)
            # numpy in: jnp.asarray would compile a program of its own per shape.
            self.pool = self._copy_pages(self.pool, *padded)
        jax.block_until_ready(self.pool)

    def compile_page_copy(self, copies: int = 1) -> None:
        """Compile the page-copy program that `copies` copies take (1: a fork's)."""
        entries = np.zeros(copy_batch(copies), np.int32)
        self._copy_pages.lower(self.pool, entries, entries, entries).compile()


def _program_shape(seg: Segment, args: tuple) -> tuple:
    """What a segment's step program is compiled for: its kind, tier, sampling variant and
    argument shapes."""
    return (seg.kind, seg.in_hbm, seg.sampling and seg.sampling.variant,
            *(a.shape for a in jax.tree.leaves(args)))


def _to_host(out, kind: str):
    if kind == "fill":
        return None
    if kind == "sample":
        tokens, logprobs = out
        return np.asarray(tokens), np.asarray(logprobs)
    return np.asarray(out)
