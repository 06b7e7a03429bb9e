"""The SPMD model step: one jitted program over the `cp` mesh axis that writes a plan's KV into
the sharded pool (in place: the pool is donated) and returns what each segment asks for.

A step plan is host arrays that the engine decides once and every process receives identically.
It holds one or more segments run one after another (a batch of decode rows and a prefill chunk,
say). `make_step` compiles one segment: each segment of a plan is its own program, since one
program for a mix would compile once per combination of the segments' shapes. Each segment is
a `StepInputs` plus what it returns:

    "fill"        nothing (prefill chunks whose logits nobody needs: no lm-head work)
    "sample"      token ids i32[B] and their log-probabilities f32[B], sampled on the device
                  (with SamplingArrays.alternatives K: [B, 1 + K], the K likeliest after each
                  row's token; cp_runtime.model.sampler)
    "logits"      logits f32[B, V] of the `logit_index` query of each row
    "all_logits"  logits f32[B, Q, V] of every query

`StepInputs` (one segment):
    tokens:      i32[B, Q]   (padding: any token at position -1)
    positions:   i32[B, Q]   (-1 = padding query; it writes to the sentinel and attends nothing)
    page_table:  i32[B, M]   in rotated coordinates (cp_runtime.cache.layout): entry `i + rotation`
                             is the slot of logical page i, the sentinel elsewhere; M a
                             multiple of S; split per owner into local tables [S, B, M / S]
    rotation:    i32[B]      each row's rotation
    logit_index: i32[B]      which query of each row to return logits for (or sample after)
    sampling:    SamplingArrays, for "sample" segments

`to_device` turns the arrays into global arrays: one batched `jax.device_put` in one process,
`jax.make_array_from_callback` (each process places its own devices' parts) across several.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cp_runtime.cache.layout import local_page_table
from cp_runtime.cache.pool import CP_AXIS, KVPool, PoolSpec
from cp_runtime.config import (ModelConfig, ResolvedStrategy, RuntimeConfig,
                               resolve_strategy)
from cp_runtime.kernels.dispatch import MODEL_KERNELS, Kernels
from cp_runtime.kernels.storage import pool_dtype
from cp_runtime.model.attention import ShardAttention, ShardState
from cp_runtime.model.attention_inputs import HEAD_SPLIT_WEIGHTS
from cp_runtime.model.halves import forward_in_halves, halves_fit
from cp_runtime.model.layers import forward
from cp_runtime.model.ops import logits
from cp_runtime.model.scopes import phase
from cp_runtime.model.sampler import SamplingArrays, sample_tokens
from cp_runtime.parallel.merge import combine
from cp_runtime.weights.format import SCALE_SUFFIX, DeviceTensor
from cp_runtime.weights.sharding import split_of
from cp_runtime.weights.params import Params
from cp_runtime.weights.placement import param_specs
from cp_runtime.weights.shards import WeightShards

__all__ = ["KINDS", "Segment", "StepInputs", "make_step"]

KINDS = ("fill", "sample", "logits", "all_logits")


def _to_global(arrays: list[np.ndarray], shardings: list[NamedSharding]) -> list[jax.Array]:
    """Global arrays from host arrays every process holds in full. In one process, one batched
    transfer for all of them (a step's inputs are several small arrays, and each separate
    transfer to S devices costs about 0.1 ms here); across processes each process places its
    own devices' parts."""
    if jax.process_count() == 1:
        return jax.device_put(arrays, shardings)
    return [jax.make_array_from_callback(x.shape, s, lambda index, x=x: x[index])
            for x, s in zip(arrays, shardings)]


@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: np.ndarray
    positions: np.ndarray
    page_table: np.ndarray
    logit_index: np.ndarray
    rotation: np.ndarray | None = None

    def __post_init__(self) -> None:
        b, q = self.tokens.shape
        if self.positions.shape != (b, q) or self.page_table.shape[0] != b:
            raise ValueError(f"step shapes disagree: tokens {self.tokens.shape}, positions "
                             f"{self.positions.shape}, page_table {self.page_table.shape}")
        if self.logit_index.shape != (b,):
            raise ValueError(f"logit_index {self.logit_index.shape} must be [{b}]")
        if self.rotation is None:
            object.__setattr__(self, "rotation", np.zeros((b,), np.int32))
        if self.rotation.shape != (b,):
            raise ValueError(f"rotation {self.rotation.shape} must be [{b}]")

    def host_arrays(self, mesh: Mesh, num_shards: int
                    ) -> tuple[list[np.ndarray], list[NamedSharding]]:
        """The step's inputs as host arrays, with the sharding each takes on `mesh`."""
        replicated = NamedSharding(mesh, PartitionSpec())
        sharded = NamedSharding(mesh, PartitionSpec(CP_AXIS))
        local = local_page_table(self.page_table.astype(np.int32), num_shards)   # [S, B, M/S]
        arrays = [self.tokens, self.positions, local, self.rotation, self.logit_index]
        return ([np.asarray(x, np.int32) for x in arrays],
                [replicated, replicated, sharded, replicated, replicated])

    def to_device(self, mesh: Mesh, num_shards: int) -> tuple[jax.Array, ...]:
        return tuple(_to_global(*self.host_arrays(mesh, num_shards)))


@dataclasses.dataclass(frozen=True)
class Segment:
    """One part of a step plan: inputs, what it returns (one of KINDS), its sampling, and
    whether it runs over a tiered pool's HBM tier alone."""

    kind: str
    inputs: StepInputs
    sampling: SamplingArrays | None = None
    in_hbm: bool = False      # every page in a tiered pool's HBM tier (the tables' sentinel
                              # then that tier's last page): `make_step`'s in_hbm

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"segment kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == "sample") != (self.sampling is not None):
            raise ValueError("a 'sample' segment, and only it, carries sampling arrays")

    def to_device(self, mesh: Mesh, num_shards: int) -> tuple:
        """The segment's inputs as global arrays, all moved in one transfer."""
        arrays, shardings = self.inputs.host_arrays(mesh, num_shards)
        leaves, treedef = jax.tree.flatten(self.sampling)
        placed = _to_global(arrays + [np.asarray(x) for x in leaves],
                            shardings + [NamedSharding(mesh, PartitionSpec())] * len(leaves))
        sampling = None if self.sampling is None else treedef.unflatten(placed[len(arrays):])
        return (*placed[:len(arrays)], sampling)


def _segment_body(params, latent, indexer, tokens, pos, local_tables, rotation, logit_index,
                  sampling, *, model: ModelConfig, runtime: RuntimeConfig, pool: PoolSpec,
                  kernels: Kernels, kind: str, combine_fn, strategy: ResolvedStrategy,
                  experts_regrouped: int, latent_storage):
    """Runs on one shard: pool blocks arrive as [1, P + 1, ps, D]; weights whole or this
    shard's part (runtime.weights). strategy: runtime.strategy resolved for the mesh's
    platform; with strategy.chunk_halves a chunk whose rows split, each device attending
    every head of its own, runs them as two halves.
    experts_regrouped: 1, the routed experts as placed (runtime.expert_groups); g > 1, held
    regrouped into g groups (cp_runtime.weights.regroup)."""
    sharded = runtime.weights == "sharded"
    groups = runtime.expert_groups if experts_regrouped == 1 else experts_regrouped
    ws = WeightShards(CP_AXIS if sharded else None, wire_dtype=strategy.wire_dtype,
                      mlp_rows=strategy.mlp_rows,
                      expert_groups=groups if sharded else 1,
                      groups_strided=experts_regrouped > 1)
    attend = ShardAttention(model=model, runtime=runtime, pool=pool, kernels=kernels,
                            axis_name=CP_AXIS, shard=lax.axis_index(CP_AXIS),
                            local_table=local_tables[0], rotation=rotation, pos=pos,
                            strategy=strategy, ws=ws, combine=combine_fn,
                            latent_storage=latent_storage)
    state = ShardState(latent=tuple(x[0] for x in latent), indexer=tuple(x[0] for x in indexer),
                       selection=None)
    if attend.splits_rows(state.latent[0]):
        ws = dataclasses.replace(ws, rows_split=True)
        mode = dataclasses.replace(attend, ws=ws).row_mode(
            *_head_weights(params, model, attend.num_shards, pos.size // attend.num_shards))
        ws = dataclasses.replace(ws, whole_heads=mode == "weights")
        attend = dataclasses.replace(attend, ws=ws, rows_attend=mode)
    if strategy.chunk_halves and ws.whole_heads and halves_fit(pos.shape, attend.num_shards):
        half = pos.shape[1] // 2
        layout = attend.chosen_layout(state.latent[0])    # the whole chunk's, not a half's
        attends = tuple(dataclasses.replace(attend, pos=p, hands_over=True, layout=layout)
                        for p in (pos[:, :half], pos[:, half:]))
        hidden, state = forward_in_halves(params, model, tokens, pos, attends, state, ws,
                                          kernels.expert_matmul)
    else:
        hidden, state = forward(params, model, tokens, pos, attend, state, ws,
                                kernels.expert_matmul)                   # [B, Q, hidden]
    new_pool = (tuple(x[None] for x in state.latent), tuple(x[None] for x in state.indexer))
    if kind == "fill":
        return (), *new_pool
    with phase("dense"):
        if kind != "all_logits":
            hidden = jnp.take_along_axis(hidden, logit_index[:, None, None], axis=1)[:, 0]
        out = logits(params, hidden, ws, model.vocab_size)           # [B, V] or [B, Q, V]
    if kind == "sample":
        with phase("sampling"):
            sampled_pos = jnp.take_along_axis(pos, logit_index[:, None], axis=1)[:, 0] + 1
            out = sample_tokens(out, sampling, sampled_pos)
    return out, *new_pool


def _head_weights(params, model: ModelConfig, num_shards: int, rows: int) -> tuple[int, int]:
    """This device's bytes of layer 0's head-split attention weights with their scales, and
    how many of their values, gathered whole over `num_shards`, XLA would dequantise for a
    device's `rows` rows (`ModelKernels.dequantised_whole`)."""
    held, dequantised = 0, 0
    for name in (f"model.layers.0.{n}" for n in HEAD_SPLIT_WEIGHTS):
        w, s = params[name], params.get(name + SCALE_SUFFIX)
        held += w.size * w.dtype.itemsize + (0 if s is None else s.size * s.dtype.itemsize)
        if s is None:
            continue
        axis = split_of(name, w.shape, model).axis
        whole_w, whole_s = (tuple(d * num_shards if i == axis else d
                                  for i, d in enumerate(x.shape)) for x in (w, s))
        if MODEL_KERNELS.dequantised_whole(model, name, whole_w, whole_s, rows):
            dequantised += w.size * num_shards
    return held, dequantised


def compiler_options(tpu_schedule: str, mesh: Mesh) -> dict[str, bool] | None:
    """XLA options the step compiles with (Strategy.tpu_schedule), None for XLA's own.

    With the pool sized to fill HBM, every step program sits near the latency-hiding
    scheduler's memory limit, and there XLA:TPU issued each all-gather, reduce-scatter and
    SparseCore gather or scatter only when its result was next needed, beside almost no
    compute (docs/notes/2026-12-05-prefill-schedule.md, "The scheduler's memory-pressure tracking").
    All-to-alls (a decode step's merge) run asynchronously."""
    if tpu_schedule == "xla" or mesh.devices.flat[0].platform != "tpu":
        return None
    return {"xla_tpu_enable_scheduler_memory_pressure_tracking": False,
            # XLA:TPU runs an all-to-all synchronously unless told, with nothing beside it:
            # a decode step's merge (docs/notes/2026-12-07-expert-groups.md, "The experts exchanged
            # inside each chunk").
            "xla_tpu_enable_async_all_to_all": True}


def make_step(model: ModelConfig, runtime: RuntimeConfig, pool: PoolSpec, mesh: Mesh,
              kernels: Kernels, weight_tensors: dict[str, DeviceTensor], *,
              combine_fn=combine, experts_regrouped: int = 1):
    """Returns step(params, pool, segment, kind=..., in_hbm=False) -> (output, pool), jitted.

    weight_tensors: the arrays the weights are held in (cp_runtime.weights.format.device_tensors,
    for runtime.weights and runtime.weight_dtype, both concrete).
    combine_fn: how attention partials meet (cp_runtime.parallel.merge.combine; a benchmark may
    pass a stand-in to time the step without its merge).
    experts_regrouped: g > 1 for the weights with their routed experts held regrouped into g
    groups (cp_runtime.weights.regroup; weight_tensors then say so).
    segment: the argument tuple of `Segment.to_device(...)`; kind: what it returns (static);
    in_hbm: the segment's pages all lie in the HBM tier of a pool whose latent cache is
    otherwise on the hosts (`Segment.in_hbm`; static): its program is a device pool's.
    output: what `kind` returns (see the module docstring). The pool argument is donated.
    """
    sharded, rep = PartitionSpec(CP_AXIS), PartitionSpec()
    weights = param_specs(weight_tensors, CP_AXIS)
    platform = mesh.devices.flat[0].platform
    strategy = resolve_strategy(runtime.strategy, model, platform)

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("kind", "in_hbm"),
                       compiler_options=compiler_options(strategy.tpu_schedule, mesh))
    def step(params: Params, kv: KVPool, segment: tuple, *, kind: str, in_hbm: bool = False):
        # in_hbm: every page the segment touches lies in a tiered pool's HBM tier, so it runs
        # the device pool's program over that tier; the host words pass through untouched.
        spec = pool.hbm_view() if in_hbm else pool
        body = functools.partial(_segment_body, model=model, runtime=runtime, pool=spec,
                                 kernels=kernels, kind=kind, combine_fn=combine_fn,
                                 strategy=strategy, experts_regrouped=experts_regrouped,
                                 latent_storage=pool_dtype(spec.latent_dtype, platform))
        spmd = jax.shard_map(body, mesh=mesh,
                             in_specs=(weights, sharded, sharded, rep, rep, sharded, rep, rep,
                                       rep),
                             out_specs=(rep, sharded, sharded), check_vma=False)
        latent = tuple(t.device for t in kv.latent) if in_hbm else kv.latent
        out, latent, indexer = spmd(params, latent, kv.indexer, *segment)
        if in_hbm:
            latent = tuple(dataclasses.replace(t, device=d) for t, d in zip(kv.latent, latent))
        return out, KVPool(latent=latent, indexer=indexer)

    return step
