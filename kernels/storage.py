"""How caches are stored, and the one integer helper every kernel needs.

Storage form, chosen per backend in one place (`pool_dtype`):
  - XLA:CPU has no fp8 or bf16 arithmetic, so a scatter into (or a gather from) an fp8/bf16
    buffer is rewritten as convert-the-whole-buffer, update, convert back: a full-pool copy per
    layer per step that grows with the pool (measured: a tiny-model decode step's temporaries
    grew from 2.7 MB to 42 MB per device as the pool went from 64 to 1024 pages per shard). On
    CPU a pool of narrow floats is therefore held as same-width unsigned integers
    (`storage_dtype`), which XLA moves natively; rows are bitcast on the way in and out.
  - On a TPU the pool holds its values natively (fp8, bf16): there a bitcast or reshape of a
    whole pool buffer is not free but a copy (the compiled decode kernel's temporaries were
    twice its pool with the bitcast around it), and the Pallas kernels read native pages.

Cached rows on the host (snapshots, `CacheRows`) are always in the unsigned form, whatever the
pool's, so a snapshot taken on one backend restores on another.

Every write into a cache goes through `saturating_cast`: a plain `astype(float8_e4m3fn)` turns
500.0 into NaN (e4m3fn has no inf; anything past 464 rounds to its NaN code), and one NaN in a
page poisons every query that selects the page. So values are clipped to the cache dtype's finite
range first: 500 and 1e6 are stored as 448 (e4m3) or 57344 (e5m2, where 500 is 512). The clip is
an elementwise min/max that XLA fuses into the convert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["cdiv", "storage_dtype", "pool_dtype", "saturating_cast", "to_storage",
           "from_storage"]

_STORAGE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def storage_dtype(dtype) -> np.dtype:
    """The unsigned form of `dtype` values: a CPU pool's buffers, and cached rows on the host."""
    return _STORAGE.get(np.dtype(dtype).itemsize, np.dtype(dtype))


def pool_dtype(dtype, platform: str) -> np.dtype:
    """The dtype a pool buffer of `dtype` values has on `platform` ("cpu", "tpu", ...): the
    unsigned form on CPU, the values themselves elsewhere (module docstring)."""
    return storage_dtype(dtype) if platform == "cpu" else np.dtype(dtype)


@functools.cache
def _finite_bound(src: np.dtype, dst: np.dtype) -> np.ndarray:
    """The largest `src` value whose cast to `dst` is finite: dst's max, rounded down into src.

    Rounding dst's max into src may round up (f16's 65504 becomes 65536 in bf16, which f16 then
    overflows to inf), hence the step back down."""
    hi = min(float(jnp.finfo(dst).max), float(jnp.finfo(src).max))
    bound = np.array(hi, src)
    if float(bound) > hi:
        bound = np.nextafter(bound, np.array(0, src))
    return bound


def saturating_cast(x: jax.Array, dtype) -> jax.Array:
    """x f[...] -> dtype[...]: clip to dtype's finite range, then cast. The one cast into a cache.

    Finite values inside the range (all of them for bf16/f32 from an f32 model) are unchanged, bit
    for bit. Outside it, the largest finite value of the sign: 500, 1e6 -> 448 in e4m3, 1e6 ->
    57344 in e5m2, an f32 3.4e38 -> bf16's 3.39e38 (a plain cast rounds it to inf).
    +-inf -> +-max as well: an overflowed activation is as large as the dtype can say, and an inf
    key would turn q.k into inf - inf = NaN in the softmax.
    NaN stays NaN: it means the model already produced NaN for that token (whose own logits are
    NaN), and writing a number in its place would hide the fault rather than contain it.
    Non-float inputs or targets are cast unchanged.
    """
    dtype = np.dtype(dtype)
    if not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(x.dtype, jnp.floating)):
        return x.astype(dtype)
    hi = _finite_bound(np.dtype(x.dtype), dtype)
    return jnp.clip(x, -hi, hi).astype(dtype)


def to_storage(x: jax.Array, dtype, storage=None) -> jax.Array:
    """Cast x to the cache dtype (the single, saturating cast) and reinterpret it as `storage`
    (default: the unsigned form)."""
    x = saturating_cast(x, dtype)
    storage = storage_dtype(dtype) if storage is None else np.dtype(storage)
    return x if storage == x.dtype else lax.bitcast_convert_type(x, storage)


def from_storage(raw: jax.Array, dtype) -> jax.Array:
    """Reinterpret storage (or values already of `dtype`) as `dtype` values."""
    return raw if raw.dtype == np.dtype(dtype) else lax.bitcast_convert_type(raw, dtype)
