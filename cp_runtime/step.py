"""The SPMD model step: one jitted program over the `cp` mesh axis that writes a batch's KV into
the sharded pool (in place: the pool is donated) and returns logits.

A step is described by host arrays that the engine decides once and that every process receives
identically (a step plan); `StepInputs.to_device` turns them into global arrays with
`jax.make_array_from_callback`, which works with one process or many.

    tokens:      i32[B, Q]   (padding: any token at position -1)
    positions:   i32[B, Q]   (-1 = padding query; it writes to the sentinel and attends nothing)
    page_table:  i32[B, M]   physical slot of logical page m (M a multiple of S; unused entries
                             hold the sentinel), split per owner into local tables [S, B, M / S]
    logit_index: i32[B]      which query of each row to return logits for
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cp_runtime.attention import ShardAttention, ShardState
from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.kernels_dispatch import Kernels
from cp_runtime.layout import local_page_table
from cp_runtime.model import forward, logits
from cp_runtime.pool import CP_AXIS, KVPool, PoolSpec
from cp_runtime.weights import Params

__all__ = ["StepInputs", "make_step"]


def _to_global(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds in full."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


@dataclasses.dataclass(frozen=True)
class StepInputs:
    tokens: np.ndarray
    positions: np.ndarray
    page_table: np.ndarray
    logit_index: np.ndarray

    def __post_init__(self) -> None:
        b, q = self.tokens.shape
        if self.positions.shape != (b, q) or self.page_table.shape[0] != b:
            raise ValueError(f"step shapes disagree: tokens {self.tokens.shape}, positions "
                             f"{self.positions.shape}, page_table {self.page_table.shape}")
        if self.logit_index.shape != (b,):
            raise ValueError(f"logit_index {self.logit_index.shape} must be [{b}]")

    def to_device(self, mesh: Mesh, num_shards: int) -> tuple[jax.Array, ...]:
        replicated = NamedSharding(mesh, PartitionSpec())
        sharded = NamedSharding(mesh, PartitionSpec(CP_AXIS))
        local = local_page_table(self.page_table.astype(np.int32), num_shards)   # [S, B, M/S]
        return (_to_global(self.tokens.astype(np.int32), replicated),
                _to_global(self.positions.astype(np.int32), replicated),
                _to_global(local, sharded),
                _to_global(self.logit_index.astype(np.int32), replicated))


def _shard_body(params, latent, indexer, tokens, pos, local_tables, logit_index, *,
                model: ModelConfig, runtime: RuntimeConfig, pool: PoolSpec, kernels: Kernels,
                all_logits: bool):
    """Runs on one shard: pool blocks arrive as [1, P + 1, ps, D]."""
    attend = ShardAttention(model=model, runtime=runtime, pool=pool, kernels=kernels,
                            axis_name=CP_AXIS,
                            shard=lax.axis_index(CP_AXIS), local_table=local_tables[0], pos=pos)
    state = ShardState(latent=tuple(x[0] for x in latent), indexer=tuple(x[0] for x in indexer),
                       selection=None)
    hidden, state = forward(params, model, tokens, pos, attend, state)     # [B, Q, hidden]
    if not all_logits:
        hidden = jnp.take_along_axis(hidden, logit_index[:, None, None], axis=1)[:, 0]
    out = logits(params, hidden)
    return (out, tuple(x[None] for x in state.latent), tuple(x[None] for x in state.indexer))


def make_step(model: ModelConfig, runtime: RuntimeConfig, pool: PoolSpec, mesh: Mesh,
              kernels: Kernels, *, all_logits: bool = False):
    """Returns step(params, pool, tokens, pos, local_tables, logit_index) -> (logits, pool).

    logits: f32[B, V] (or f32[B, Q, V] with all_logits). The pool argument is donated.
    """
    sharded, rep = PartitionSpec(CP_AXIS), PartitionSpec()
    body = functools.partial(_shard_body, model=model, runtime=runtime, pool=pool,
                             kernels=kernels, all_logits=all_logits)
    spmd = jax.shard_map(body, mesh=mesh, in_specs=(rep, sharded, sharded, rep, rep, sharded, rep),
                         out_specs=(rep, sharded, sharded), check_vma=False)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params: Params, pool: KVPool, tokens, pos, local_tables, logit_index):
        out, latent, indexer = spmd(params, pool.latent, pool.indexer, tokens, pos,
                                    local_tables, logit_index)
        return out, KVPool(latent=latent, indexer=indexer)

    return step
