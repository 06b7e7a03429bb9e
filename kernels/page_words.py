"""Pages of a cache as 32-bit words, the form a latent cache held in host memory takes
(cp_runtime.cache.host_pages) and its staged pages keep in HBM:

    words: u32[n, ps / pk, D]     pk = 4 / itemsize values packed in a word: word (i, l) holds
                                  rows pk i .. pk i + pk - 1 of lane l, its byte (or half) k
                                  row pk i + k

which is how a TPU packs narrow values into its 32-bit tiles: inside a kernel `pltpu.bitcast`
of a page's words to the values' dtype gives the page for free (kernels/sparse_decode.py).
Outside one, `from_words` and `to_words` are XLA's reinterpretations (on a TPU a relayout of
what they convert).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["WORD_BYTES", "packing", "page_words", "to_words", "from_words", "is_words"]

WORD_BYTES = 4


def packing(itemsize: int) -> int:
    """Values of `itemsize` bytes in one 32-bit word."""
    if WORD_BYTES % itemsize:
        raise ValueError(f"values of {itemsize} bytes do not pack into {WORD_BYTES}-byte words")
    return WORD_BYTES // itemsize


def page_words(page_size: int, latent_dim: int, itemsize: int) -> tuple[int, int]:
    """The words shape of one page of `page_size` rows of `latent_dim` values: (ps / pk, D)."""
    pk = packing(itemsize)
    if page_size % pk:
        raise ValueError(f"a page of {page_size} rows does not pack {pk} rows to a word")
    return page_size // pk, latent_dim


def to_words(pages: jax.Array) -> jax.Array:
    """Pages T[n, ps, D] -> their words u32[n, ps / pk, D] (module docstring)."""
    n, ps, d = pages.shape
    pk = packing(jnp.dtype(pages.dtype).itemsize)
    if pk == 1:
        return lax.bitcast_convert_type(pages, jnp.uint32)
    rows = jnp.swapaxes(pages.reshape(n, ps // pk, pk, d), -1, -2)     # [n, ps/pk, D, pk]
    return lax.bitcast_convert_type(rows, jnp.uint32)


def from_words(words: jax.Array, dtype) -> jax.Array:
    """Words u32[n, ps / pk, D] -> pages T[n, ps, D] of `dtype` (values or storage)."""
    values = lax.bitcast_convert_type(words, dtype)             # [n, ps/pk, D(, pk)]
    if values.ndim == words.ndim:
        return values
    n, m, d, pk = values.shape
    return jnp.swapaxes(values, -1, -2).reshape(n, m * pk, d)


def is_words(cache: jax.Array) -> bool:
    """Whether a cache (or staged pages) is in words: no pool holds u32 values."""
    return cache.dtype == jnp.uint32
