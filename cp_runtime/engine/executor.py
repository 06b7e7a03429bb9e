"""Executors run step plans on devices. The engine decides everything (pages, positions, batch);
an executor only turns a plan into a device step and hands back logits.

`LocalExecutor` runs on S devices of this process. `cluster.RayExecutor` implements the same
interface over Ray worker actors, one per host, each running the same SPMD program.
"""

from __future__ import annotations

import abc
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.kernels_dispatch import select_kernels
from cp_runtime.pool import CP_AXIS, KVPool, PoolSpec
from cp_runtime.step import StepInputs, make_step
from cp_runtime.weights import Params

__all__ = ["Executor", "LocalExecutor", "pool_spec_for"]


def pool_spec_for(model: ModelConfig, runtime: RuntimeConfig) -> PoolSpec:
    return PoolSpec(model=model, kv_cache_dtype=runtime.kv_cache_dtype,
                    num_shards=runtime.num_shards, pages_per_shard=runtime.pages_per_shard,
                    page_size=runtime.page_size)


class Executor(abc.ABC):
    """Contract: `run` executes one step plan and returns its logits as host f32 arrays
    ([B, V], or [B, Q, V] with all_logits); `copy_page` copies one physical page (all layers)
    on one shard, for forks. Calls are made in order and never concurrently."""

    pool_spec: PoolSpec

    @abc.abstractmethod
    def run(self, inputs: StepInputs, *, all_logits: bool = False) -> np.ndarray: ...

    @abc.abstractmethod
    def copy_page(self, shard: int, src: int, dst: int) -> None: ...

    def close(self) -> None:
        """Release devices/workers. Default: nothing to release."""


def make_page_copy(mesh):
    """copy(pool, shard, src, dst) -> pool: page src -> dst on one shard, every layer, in place.

    Other shards copy their sentinel onto itself, so every shard runs the same program."""
    sharded, rep = PartitionSpec(CP_AXIS), PartitionSpec()

    def body(pool: KVPool, shard, src, dst) -> KVPool:
        mine = jax.lax.axis_index(CP_AXIS) == shard

        def copy(buf):                                        # [1, P + 1, ps, D]
            sentinel = buf.shape[1] - 1
            s, d = jnp.where(mine, src, sentinel), jnp.where(mine, dst, sentinel)
            return buf.at[0, d].set(buf[0, s])

        return jax.tree.map(copy, pool)

    spmd = jax.shard_map(body, mesh=mesh, in_specs=(sharded, rep, rep, rep), out_specs=sharded,
                         check_vma=False)
    return jax.jit(spmd, donate_argnums=(0,))


class LocalExecutor(Executor):
    """Runs steps on the first S devices of this process."""

    def __init__(self, model: ModelConfig, runtime: RuntimeConfig, params: Params):
        devices = jax.devices()
        if len(devices) < runtime.num_shards:
            raise ValueError(f"num_shards={runtime.num_shards} needs that many devices, "
                             f"{len(devices)} available (on CPU set jax_num_cpu_devices)")
        self.model, self.runtime = model, runtime
        self.mesh = jax.make_mesh((runtime.num_shards,), (CP_AXIS,),
                                  devices=devices[: runtime.num_shards])
        self.pool_spec = pool_spec_for(model, runtime)
        self.pool = KVPool.allocate(self.pool_spec, self.mesh)
        self.params = jax.device_put(params, NamedSharding(self.mesh, PartitionSpec()))
        self.kernels = select_kernels(runtime.backend, runtime.num_shards)
        self._copy_page = make_page_copy(self.mesh)
        self._steps = {flag: make_step(model, runtime, self.pool_spec, self.mesh, self.kernels,
                                        all_logits=flag)
                       for flag in (False, True)}

    def run(self, inputs: StepInputs, *, all_logits: bool = False) -> np.ndarray:
        args = inputs.to_device(self.mesh, self.runtime.num_shards)
        out, self.pool = self._steps[all_logits](self.params, self.pool, *args)
        return np.asarray(out)

    def copy_page(self, shard: int, src: int, dst: int) -> None:
        self.pool = self._copy_page(self.pool, jnp.int32(shard), jnp.int32(src), jnp.int32(dst))
