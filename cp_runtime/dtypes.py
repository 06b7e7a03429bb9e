"""The kv-cache dtype table: one place that maps a `--kv-cache-dtype` name to array dtypes.

The latent (MLA) cache takes the named dtype. The indexer key cache is never narrower than bf16:
an error in an indexer key flips whole pages in or out of the top-k instead of averaging out in a
softmax (see `benchmarks/indexer_cache_dtype.py`, `cp-runtime bench selection`, for the
measurement), so fp8 latents keep a bf16 indexer.
No per-tensor scale: latents are post-norm / post-RoPE values of order 1, inside e4m3's range
(max 448) and above its subnormal floor (2**-6).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = [
    "KV_CACHE_DTYPES",

    "DEFAULT_MODEL_DTYPE",
    "latent_cache_dtype",
    "indexer_cache_dtype",
    "dtype_bytes",
]

# The model's own activation dtype, which "auto" follows.
DEFAULT_MODEL_DTYPE = jnp.bfloat16

# name -> dtype of the latent cache ("auto" = the model dtype). f32 exists for exactness tests.
KV_CACHE_DTYPES: dict[str, object] = {
    "auto": None,
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}


def latent_cache_dtype(name: str, model_dtype=DEFAULT_MODEL_DTYPE) -> np.dtype:
    """Dtype of the MLA latent cache for a `--kv-cache-dtype` name."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv-cache dtype {name!r}; choices: {', '.join(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[name]
    return np.dtype(model_dtype if dtype is None else dtype)


def dtype_bytes(dtype) -> int:
    return np.dtype(dtype).itemsize


def indexer_cache_dtype(name: str, model_dtype=DEFAULT_MODEL_DTYPE) -> np.dtype:
    """Indexer key cache dtype: the latent dtype, but bf16 whenever the latent is narrower."""
    latent = latent_cache_dtype(name, model_dtype)
    if dtype_bytes(latent) < dtype_bytes(jnp.bfloat16):
        return np.dtype(jnp.bfloat16)
    return latent

