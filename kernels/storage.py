"""How caches are stored, and the one integer helper every kernel needs.

Pool buffers hold narrow floats as same-width unsigned integers. XLA's CPU backend has no fp8 or
bf16 arithmetic, so a scatter into (or a gather from) an fp8/bf16 buffer is rewritten as
convert-the-whole-buffer, update, convert back: a full-pool copy per layer per step that grows
with the pool (measured: a tiny-model decode step's temporaries grew from 2.7 MB to 42 MB per
device as the pool went from 64 to 1024 pages per shard). Integer buffers are moved natively
everywhere; rows are bitcast on the way in and out, which is free on TPU.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

__all__ = ["cdiv", "storage_dtype", "to_storage", "from_storage"]

_STORAGE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def storage_dtype(dtype) -> np.dtype:
    """The dtype a pool buffer of `dtype` values is stored as."""
    return _STORAGE.get(np.dtype(dtype).itemsize, np.dtype(dtype))


def to_storage(x: jax.Array, dtype) -> jax.Array:
    """Cast x to the cache dtype (the single cast) and reinterpret it as storage."""
    x = x.astype(dtype)
    storage = storage_dtype(dtype)
    return x if storage == x.dtype else lax.bitcast_convert_type(x, storage)


def from_storage(raw: jax.Array, dtype) -> jax.Array:
    """Reinterpret storage (or values already of `dtype`) as `dtype` values."""
    return raw if raw.dtype == np.dtype(dtype) else lax.bitcast_convert_type(raw, dtype)
