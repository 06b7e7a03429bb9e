"""DSA indexer page scores for decode on XLA:CPU as one native pass (an XLA FFI handler).

At a query or a few per sequence, the indexer's work per key is a handful of multiply-adds, and
what costs is memory. XLA:CPU runs `xla_indexer`'s page gather, bf16 -> f32 widening and
product as separate passes over the keys; the handler in `native/indexer_page_scores.cc` reads
each page once, widens and scores it in registers, and prefetches the pages ahead. Measured on
the development machine (2-core x86, AVX2), one device, a shard of a million-token context
(1024 pages of 64 bf16 keys x 16 dims, 2.1 MB): 0.58 ms through `xla_indexer`, 0.17 ms here.

The handler is compiled on first use and cached (kernels/native_build.py); compiling takes
about 2 s.

`indexer_page_scores` has `xla_indexer`'s signature and result. It takes the native pass when
all of these hold, and `xla_indexer` otherwise:
  - the program runs on CPU (chosen per platform at lowering, `lax.platform_dependent`);
  - the keys are bf16 (the pool's indexer dtype below f32 latents);
  - a sequence has at most `NATIVE_MAX_ROWS` indexer rows (queries x heads): beyond that the
    work per key is a matrix product, which `xla_indexer`'s tiles do at the matmul rate;
  - the library built. If it cannot be (no compiler), a warning says why, once per process.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cp_runtime.kernels import native_build, xla_indexer
from cp_runtime.kernels.native_build import NativeBuildError

__all__ = ["indexer_page_scores", "uses_native", "native_status", "library_path",
           "NativeBuildError", "NATIVE_MAX_ROWS"]

SOURCE = pathlib.Path(__file__).parent / "native" / "indexer_page_scores.cc"
TARGET = "cp_runtime_indexer_page_scores"
NATIVE_MAX_ROWS = 4


def library_path() -> pathlib.Path:
    """Where the library for this source, these flags and this jaxlib is (or will be) cached."""
    return native_build.library_path(SOURCE)


@functools.cache
def native_status() -> str:
    """'native' when the handler is registered, else 'unavailable: <why>' (warned once)."""
    return native_build.status(SOURCE, "CpIndexerPageScores", TARGET,
                               "native indexer unavailable, decode uses xla_indexer")


def _native_call(q, w, keys, local_pages, q_pos, shard, rotation, *, num_shards: int,
                 vectorized: bool) -> jax.Array:
    """The handler on keys u16[P + 1, ps, D] (bf16 bits; bf16 values are bit-cast to them)."""
    b, m = local_pages.shape
    if keys.dtype == jnp.bfloat16:
        keys = lax.bitcast_convert_type(keys, jnp.uint16)
    out = jax.ShapeDtypeStruct((b, q.shape[1], m), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(
        q.astype(jnp.float32), w.astype(jnp.float32), keys, local_pages.astype(jnp.int32),
        q_pos.astype(jnp.int32), jnp.asarray(shard, jnp.int32).reshape(()),
        rotation.astype(jnp.int32), num_shards=np.int64(num_shards),
        vectorized=np.int64(vectorized))


def uses_native(q_shape: tuple[int, ...], key_dtype, cache_dtype=None) -> bool:
    """Whether `indexer_page_scores` takes the native pass on CPU for these operands."""
    value_dtype = np.dtype(key_dtype if cache_dtype is None else cache_dtype)
    rows = q_shape[1] * q_shape[2]
    return (value_dtype == np.dtype(jnp.bfloat16) and np.dtype(key_dtype).itemsize == 2
            and rows <= NATIVE_MAX_ROWS and native_status() == "native")


def indexer_page_scores(q: jax.Array, w: jax.Array, k_cache: jax.Array, local_pages: jax.Array,
                        q_pos: jax.Array, shard: jax.Array, rotation: jax.Array | None = None, *,
                        num_shards: int, key_block_pages: int = 0, cache_dtype=None,
                        vectorized: bool = True) -> jax.Array:
    """`reference.indexer_page_scores` (same arguments and result, f32[B, Q, M]): the native
    pass where it applies (module docstring), else `xla_indexer.indexer_page_scores`.
    `vectorized=False` takes the handler's portable loop instead of its AVX2 one (tests)."""
    kw = dict(num_shards=num_shards, key_block_pages=key_block_pages, cache_dtype=cache_dtype)
    if not uses_native(q.shape, k_cache.dtype, cache_dtype):
        return xla_indexer.indexer_page_scores(q, w, k_cache, local_pages, q_pos, shard,
                                               rotation, **kw)
    b = local_pages.shape[0]
    rotation = jnp.zeros((b,), jnp.int32) if rotation is None else rotation
    native = functools.partial(_native_call, num_shards=num_shards, vectorized=vectorized)
    tiled = functools.partial(xla_indexer.indexer_page_scores, **kw)
    args = (q, w, k_cache, local_pages, q_pos, shard, rotation)
    return lax.platform_dependent(*args, cpu=native, default=tiled)
