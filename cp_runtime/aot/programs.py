"""Every program the executor runs on a slice, as a jitted function and ShapeDtypeStruct
arguments placed on compile-only devices: nothing is allocated.

    decode          one "sample" segment: max_batch rows of one query each
    prefill_fill    one "fill" segment: a chunk of chunk_size queries, no lm head
    prefill_sample  the same chunk, then sampling after its last query
    prefill_logits  the same chunk, then the logits of its last query
    *_in_hbm        each of the four above over the HBM tier alone, in a pool whose latent
                    cache is on the hosts but for its first `latent_device_pages` pages a
                    shard (`Segment.in_hbm`)
    experts_to_groups  one MoE layer's routed experts from one group into
                       runtime.prefill_expert_groups (cp_runtime.weights.regroup), when that is
                       over 1; the prefill programs then take the experts so regrouped
    experts_to_one     the same layer's back to one group
    row_export      read a chunk's cached rows, every layer (snapshots): latent, then indexer
    row_import      write them back into the pool (restores)
    page_copy       copy a batch of pages, every layer, each on its shard (forks; spills to
                    the hosts' memory)

The step programs see a page table as wide as `context` tokens need (a session that long, its
pages spread over the shards by the layout rule) in a pool of `pages_per_shard` pages a shard.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cp_runtime.cache.pool import CP_AXIS, KVPool, PoolSpec
from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.engine.executor import (copy_batch, make_page_copy, make_row_io,
                                        pool_spec_for)
from cp_runtime.engine.step import StepInputs, make_step
from cp_runtime.kernels.dispatch import select_kernels
from cp_runtime.kernels.storage import cdiv, storage_dtype
from cp_runtime.model.sampler import SamplingArrays
from cp_runtime.weights.format import DeviceTensor, device_tensors
from cp_runtime.weights.params import model_shapes
from cp_runtime.weights.placement import param_structs
from cp_runtime.weights.regroup import ExpertRegrouping

__all__ = ["Program", "cut_model", "executor_programs", "pool_structs",
           "weight_tensors"]

@dataclasses.dataclass(frozen=True)
class Program:
    """One program: `fn.lower(*args, **kwargs)` lowers it; `weight_args` and `pool_args` are
    the positions of the weights and of the pool among its arguments."""

    name: str
    fn: Callable
    args: tuple
    kwargs: dict
    weight_args: tuple[int, ...] = ()
    pool_args: tuple[int, ...] = ()


def cut_model(model: ModelConfig, layers: int | None) -> ModelConfig:
    """The model's first `layers` layers at full width (all of them for None)."""
    if layers is None or layers >= model.num_hidden_layers:
        return model
    if layers < 1:
        raise ValueError(f"layers={layers} must be at least 1")
    return dataclasses.replace(
        model, num_hidden_layers=layers, indexer_types=model.indexer_types[:layers],
        first_k_dense_replace=min(model.first_k_dense_replace, layers))


def weight_tensors(model: ModelConfig, runtime: RuntimeConfig) -> dict[str, DeviceTensor]:
    """The arrays the executor places the weights in, for runtime.weights and
    runtime.weight_dtype (both concrete) with the public checkpoints' 128 x 128 blocks, the
    experts in runtime.expert_groups."""
    return device_tensors(model_shapes(model), model, runtime.weights, runtime.weight_dtype,
                          runtime.num_shards, expert_groups=runtime.expert_groups)


def pool_structs(spec: PoolSpec, mesh: Mesh) -> KVPool:
    return KVPool.buffer_shapes(spec, mesh)


def _structs(arrays: list[np.ndarray], shardings: list[NamedSharding]) -> list:
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(arrays, shardings)]


def _segment_structs(rows: int, queries: int, table_width: int, sampled: bool,
                     mesh: Mesh, num_shards: int) -> tuple:
    """A segment's argument tuple (as `Segment.to_device` makes it) as ShapeDtypeStructs."""
    zeros = np.zeros((rows, queries), np.int32)
    inputs = StepInputs(tokens=zeros, positions=zeros,
                        page_table=np.zeros((rows, table_width), np.int32),
                        logit_index=np.zeros((rows,), np.int32))
    args = _structs(*inputs.host_arrays(mesh, num_shards))
    sampling = None
    if sampled:
        rep = NamedSharding(mesh, PartitionSpec())
        sampling = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                                SamplingArrays.greedy(rows))
    return (*args, sampling)


def _table_width(context: int, page_size: int, num_shards: int) -> int:
    """Page-table entries of a `context`-token session: whole pages, a multiple of S (plus one
    S-block for the rotation, as the engine sizes it)."""
    return (cdiv(cdiv(context, page_size), num_shards) + 1) * num_shards


def _replicated(mesh: Mesh, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def executor_programs(model: ModelConfig, runtime: RuntimeConfig, mesh: Mesh, *,
                      context: int) -> list[Program]:
    """The programs of the module docstring, for `model` and `runtime` (its weight mode and
    dtype concrete) on `mesh` (runtime.num_shards devices), with backend
    runtime.strategy.backend."""
    spec = pool_spec_for(model, runtime)
    pool = pool_structs(spec, mesh)
    kernels = select_kernels(runtime.strategy.backend, runtime.num_shards)
    return (_step_programs(model, runtime, mesh, spec, pool, kernels, context)
            + _cache_programs(runtime, mesh, spec, pool, kernels))


def _step_programs(model, runtime, mesh, spec, pool, kernels, context: int) -> list[Program]:
    """The decode step and a prefill chunk (fill, sample, logits): weights, pool, segment;
    with the experts regrouped for long prompts, the exchanges of one layer's experts."""
    tensors = weight_tensors(model, runtime)
    params = param_structs(tensors, mesh)
    step = make_step(model, runtime, spec, mesh, kernels, tensors)
    prefill_step, prefill_params, exchanges = step, params, []
    if runtime.prefill_expert_groups > 1:
        regrouping = ExpertRegrouping(mesh, tensors, runtime.prefill_expert_groups, CP_AXIS)
        prefill_params = param_structs(regrouping.grouped, mesh)
        prefill_step = make_step(model, runtime, spec, mesh, kernels, regrouping.grouped,
                                 experts_regrouped=regrouping.groups)
        exchanges = [Program(name, fn, (regrouping.layer_arguments(p),), {}, weight_args=(0,))
                     for name, fn, p in (("experts_to_groups", regrouping.to_groups_layer, params),
                                         ("experts_to_one", regrouping.to_one_layer,
                                          prefill_params))]
    width = _table_width(context, runtime.page_size, runtime.num_shards)
    s = runtime.num_shards
    decode = _segment_structs(runtime.max_batch, 1, width, True, mesh, s)
    programs = [Program("decode", step, (params, pool, decode), {"kind": "sample"},
                        weight_args=(0,), pool_args=(1,))]
    for kind in ("fill", "sample", "logits"):
        chunk = _segment_structs(1, runtime.chunk_size, width, kind == "sample", mesh, s)
        programs.append(Program(f"prefill_{kind}", prefill_step, (prefill_params, pool, chunk),
                                {"kind": kind}, weight_args=(0,), pool_args=(1,)))
    if spec.latent_tiered:       # the same steps over the HBM tier alone (`Segment.in_hbm`)
        programs += [dataclasses.replace(p, name=f"{p.name}_in_hbm",
                                         kwargs={**p.kwargs, "in_hbm": True})
                     for p in programs]
    return programs + exchanges


def _cache_programs(runtime, mesh, spec, pool, kernels) -> list[Program]:
    """Snapshot row export (latent, indexer) and import of a chunk's rows; page copies (a
    fork's, a spill's)."""
    read, write = make_row_io(mesh, kernels, spec)
    n = runtime.chunk_size
    where = tuple(_replicated(mesh, (n,), jnp.int32) for _ in range(3))

    def rows(bufs, dtype):              # cached rows on the host: the unsigned form
        return tuple(_replicated(mesh, (n, b.shape[-1]), storage_dtype(dtype)) for b in bufs)

    # shard, src, dst: one batch of copies (a fork's page; a spill's run through the same code)
    page = tuple(_replicated(mesh, (copy_batch(1),), jnp.int32) for _ in range(3))
    return [
        Program("row_export_latent", read, (pool.latent, *where), {}, pool_args=(0,)),
        Program("row_export_indexer", read, (pool.indexer, *where), {}, pool_args=(0,)),
        Program("row_import", write, (pool, *where, rows(pool.latent, spec.latent_dtype),
                                         rows(pool.indexer, spec.indexer_dtype)), {},
                pool_args=(0,)),
        Program("page_copy", make_page_copy(mesh), (pool, *page), {}, pool_args=(0,)),
    ]
