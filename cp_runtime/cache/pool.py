"""The paged KV pool: per-layer latent buffers and per-`full`-layer indexer buffers, sharded by
page owner over the `cp` mesh axis.

    latent[l]:  T_lat[S, P + 1, ps, D_lat_pad]   (fp8/bf16/f32, `[c | k_pe]`, parts padded)
                or, held in host memory, its words u32[S, P + 1, ps / pk, D_lat_pad]
                (`latent_memory` "host", cp_runtime.cache.host_pages), the first
                `latent_device_pages` slots of each shard in HBM where there are any, as
                T_lat[S, Pd + 1, ps, D_lat_pad] (`host_pages.TieredPages`)
    indexer[i]: T_idx[S, P + 1, ps, D_idx]       (bf16 unless the latent is wider)

The buffers' dtype is `storage.pool_dtype` of the cache dtype on the mesh's platform: uint8 /
uint16 of the same bits on CPU (no full-pool converts on a backend without native narrow
floats), the fp8 / bf16 values themselves on TPU (where a bitcast of a pool is a copy).

Page `P` of every shard is the sentinel that non-owners write to. Buffers are donated to the
jitted steps, which update them in place; nothing here ever copies a whole buffer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cp_runtime.cache import host_pages
from cp_runtime.cache.capacity import bytes_per_token
from cp_runtime.config import ModelConfig
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype
from cp_runtime.kernels.page_words import page_words
from cp_runtime.kernels.storage import pool_dtype

__all__ = ["CacheRows", "KVPool", "PoolSpec", "CP_AXIS"]

CP_AXIS = "cp"


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """Static description of a pool: enough to allocate it and to account for its bytes."""

    model: ModelConfig
    kv_cache_dtype: str
    num_shards: int
    pages_per_shard: int
    page_size: int
    latent_memory: str = "device"
    latent_device_pages: int = 0       # with latent_memory "host": slots [0, this) in HBM

    @property
    def latent_on_host(self) -> bool:
        return self.latent_memory == "host"

    @property
    def latent_tiered(self) -> bool:
        """Whether each shard's latent words lie in two memories (`host_pages.TieredPages`)."""
        return self.latent_on_host and self.latent_device_pages > 0

    def hbm_view(self) -> "PoolSpec":
        """A tiered pool's HBM tier as a device pool of its own: a step whose pages all lie
        there runs over it (cp_runtime.engine.step, `in_hbm`)."""
        if not self.latent_tiered:
            raise ValueError("hbm_view: this pool has no HBM tier (it needs latent_memory "
                             "'host' and latent_device_pages > 0)")
        return dataclasses.replace(self, latent_memory="device", latent_device_pages=0,
                                   pages_per_shard=self.latent_device_pages)

    @property
    def latent_dtype(self):
        return latent_cache_dtype(self.kv_cache_dtype)

    @property
    def indexer_dtype(self):
        return indexer_cache_dtype(self.kv_cache_dtype)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        return (self.num_shards, self.pages_per_shard + 1, self.page_size, self.model.latent_dim)

    @property
    def latent_buffer_shape(self) -> tuple[int, ...]:
        """The latent buffer's shape: `latent_shape`, or held on the host, its words'."""
        if not self.latent_on_host:
            return self.latent_shape
        itemsize = np.dtype(self.latent_dtype).itemsize
        return self.latent_shape[:2] + page_words(
            self.page_size, self.model.latent_dim, itemsize)

    @property
    def indexer_shape(self) -> tuple[int, int, int, int]:
        return (self.num_shards, self.pages_per_shard + 1, self.page_size,
                self.model.index_head_dim)

    @property
    def capacity_tokens(self) -> int:
        return self.num_shards * self.pages_per_shard * self.page_size

    @property
    def planned_bytes(self) -> int:
        """Bytes of all buffers, sentinels included."""
        per_token = bytes_per_token(self.model, self.kv_cache_dtype)
        return per_token * self.num_shards * (self.pages_per_shard + 1) * self.page_size


@dataclasses.dataclass(frozen=True)
class KVPool:
    """The pool's device buffers (a pytree)."""

    latent: tuple[jax.Array, ...]
    indexer: tuple[jax.Array, ...]

    @staticmethod
    def sharding(mesh: Mesh) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(CP_AXIS))

    @staticmethod
    def buffer_shapes(spec: PoolSpec, mesh: Mesh) -> "KVPool":
        """The buffers as ShapeDtypeStructs on `mesh` (what `allocate` makes; compile-only
        programs lower against these)."""
        sharding = KVPool.sharding(mesh)
        platform = mesh.devices.flat[0].platform

        def buffer(shape, dtype):
            return jax.ShapeDtypeStruct(shape, pool_dtype(dtype, platform), sharding=sharding)

        def words(pages: int, place: NamedSharding) -> jax.ShapeDtypeStruct:
            shape = spec.latent_buffer_shape
            return jax.ShapeDtypeStruct(shape[:1] + (pages,) + shape[2:], jnp.uint32,
                                        sharding=place)

        def latent():
            if not spec.latent_on_host:
                return buffer(spec.latent_shape, spec.latent_dtype)
            on_host = host_pages.host_sharding(sharding)
            if not spec.latent_tiered:
                return words(spec.pages_per_shard + 1, on_host)
            device = spec.latent_device_pages
            return host_pages.TieredPages(
                device=buffer(spec.hbm_view().latent_shape, spec.latent_dtype),
                host=words(spec.pages_per_shard - device + 1, on_host))

        return KVPool(
            latent=tuple(latent() for _ in range(spec.model.num_hidden_layers)),
            indexer=tuple(buffer(spec.indexer_shape, spec.indexer_dtype)
                          for _ in range(spec.model.num_full_layers)),
        )

    @classmethod
    def allocate(cls, spec: PoolSpec, mesh: Mesh) -> "KVPool":
        """Zero-filled buffers, created directly in their sharded layout."""
        def zeros(like):
            return jax.jit(lambda: jnp.zeros(like.shape, like.dtype),
                           out_shardings=like.sharding)()

        return jax.tree.map(zeros, cls.buffer_shapes(spec, mesh))

    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.latent + self.indexer)


jax.tree_util.register_dataclass(KVPool, data_fields=["latent", "indexer"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class CacheRows:
    """The cached rows of N tokens, in storage form (cp_runtime.kernels.storage), on the host:
    what a session's cache is, independent of pages and shards.

    latent:  u8/u16/f32[L, N, D_lat_pad]     every layer
    indexer: u16/f32[F, N, D_idx]            every `full` layer
    """

    latent: np.ndarray
    indexer: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.latent.shape[1]
