"""Rows in fp8: e4m3 values with one f32 scale a row. Two users: a prefill chunk's MLP rows
(below) and the indexer's query heads and keys in a chunk's fp8 scoring
(`indexer.quantized_scores_inputs`).

Why the MLP's rows. Where the residual stream is split by row, every device gathers every row
of the chunk (its experts hold a slice of every expert's features) and runs all T k (token,
expert) rows through its slice: the [T, hidden] rows cross the interconnect, and the
[T k, hidden] rows are written by a gather and read by the gate and up kernel. Those are the MLP's largest arrays
(GLM-5.2, 16K chunk: 201 MB and 1.6 GB a layer in bf16); in fp8 each is half the bytes.

One scale a row. e4m3 is a float, so a scale only places a row's range of normal values
(about 2^15 wide) under its largest one; every value within it is rounded to the same 3 bits
of mantissa whatever the scale. Finer scales (DeepSeek-V3's 128-value groups) would keep values
more than 2^15 below their row's largest, which add nothing next to it, and would make the
experts' kernel scale each 128-wide run of every product instead of each row's sums once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Fp8Rows", "E4M3", "E4M3_MAX", "quantize", "dequantize"]

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0


class Fp8Rows(NamedTuple):
    """Rows r standing for values[r] * scales[r]."""

    values: jax.Array        # f8e4m3[..., F]
    scales: jax.Array        # f32[..., 1]


def quantize(x: jax.Array) -> Fp8Rows:
    """x f[..., F] -> its rows in e4m3, each scaled so its largest magnitude is E4M3_MAX (a
    row of zeros keeps scale 1)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scales = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    # The clip keeps a quotient a rounding above the largest value off e4m3's NaN.
    values = jnp.clip(x / scales, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return Fp8Rows(values, scales)


def dequantize(rows: Fp8Rows) -> jax.Array:
    """The f32[..., F] the rows stand for."""
    return rows.values.astype(jnp.float32) * rows.scales
