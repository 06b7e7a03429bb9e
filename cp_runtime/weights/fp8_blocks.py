"""Block-scaled fp8 weights on the host: turn one block of a tensor, as a source holds it, into
what a device stores (cp_runtime.weights.format).

A weight W [..., a, b] in fp8 with block scales s holds

    W[..., i, j] = f32(q[..., i, j]) * s[..., i // ga, j // gb]

for runs of (ga, gb) values; a checkpoint's runs are its block [bo, bi], a device's runs
`cp_runtime.weights.format.scale_runs`. Moving fp8 values between the two grids re-indexes the
scales and leaves every value as it was, so an fp8 checkpoint reaches the device bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cp_runtime.weights.format import STORED_DTYPES

__all__ = ["HostBlock", "E4M3_MAX", "dequantize", "quantize", "regrid_scales", "to_stored"]

E4M3_MAX = 448.0
# Rows dequantised at a time: a bf16 target never stages more than this many rows in f32.
_ROWS_PER_PASS = 128


@dataclasses.dataclass(frozen=True)
class HostBlock:
    """Part of one tensor as a source holds it. values [..., n, m] in the stored dtype; for an
    fp8 weight, `scales` [..., A, B] are the whole tensor's scales (its last two axes; leading
    axes as values'), one per `block` [b0, b1] of values, and `first` is (row, column) of
    values[..., 0, 0] in the tensor."""

    values: np.ndarray
    scales: np.ndarray | None = None
    block: tuple[int, int] | None = None
    first: tuple[int, int] = (0, 0)


def _scale_index(first: int, count: int, step: int, block: int, limit: int) -> np.ndarray:
    """Checkpoint scale index of each of `count` runs of `step` values from `first`."""
    return np.minimum((first + np.arange(count) * step) // block, limit - 1)


def regrid_scales(block: HostBlock, runs: tuple[int, int]) -> np.ndarray:
    """The block's scales on a device grid of `runs` (each dividing the checkpoint block and
    the values' extent): [..., n / ga, m / gb]. Runs past the tensor's end (padding) take its
    last scale; their values are zero."""
    n, m = block.values.shape[-2:]
    rows = _scale_index(block.first[0], n // runs[0], runs[0], block.block[0],
                        block.scales.shape[-2])
    cols = _scale_index(block.first[1], m // runs[1], runs[1], block.block[1],
                        block.scales.shape[-1])
    return np.take(np.take(block.scales, rows, axis=-2), cols, axis=-1).astype(np.float32)


def dequantize(block: HostBlock, dtype: str) -> np.ndarray:
    """An fp8 block's values in `dtype` ("bf16" or "f32"), each one f32 product rounded once;
    a pass of at most _ROWS_PER_PASS rows is in f32 at a time."""
    q = block.values
    out = np.empty(q.shape, STORED_DTYPES[dtype])
    cols = _scale_index(block.first[1], q.shape[-1], 1, block.block[1], block.scales.shape[-1])
    for lo in range(0, q.shape[-2], _ROWS_PER_PASS):
        hi = min(lo + _ROWS_PER_PASS, q.shape[-2])
        rows = _scale_index(block.first[0] + lo, hi - lo, 1, block.block[0],
                            block.scales.shape[-2])
        scale = np.take(np.take(block.scales, rows, axis=-2), cols, axis=-1)
        out[..., lo:hi, :] = q[..., lo:hi, :].astype(np.float32) * scale.astype(np.float32)
    return out


def quantize(w: np.ndarray, runs: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w [..., n, m] (any float) -> (f8_e4m3 [..., n, m], f32 scales [..., n / ga, m / gb]):
    each run's largest magnitude maps to E4M3_MAX (an all-zero run gets scale 1)."""
    *lead, n, m = w.shape
    ga, gb = runs
    tiles = w.astype(np.float32).reshape(*lead, n // ga, ga, m // gb, gb)
    amax = np.abs(tiles).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    q = (tiles / scale[..., :, None, :, None]).astype(STORED_DTYPES["fp8"])
    return q.reshape(w.shape), scale


def to_stored(block: HostBlock, dtype: str, runs: tuple[int, int] | None
              ) -> tuple[np.ndarray, np.ndarray | None]:
    """(values, scales or None) as a device stores `block` in `dtype` ("fp8" with scales on a
    grid of `runs`, "bf16" or "f32")."""
    fp8 = block.scales is not None
    if dtype == "fp8":
        if fp8 and block.values.dtype == STORED_DTYPES["fp8"]:
            return block.values, regrid_scales(block, runs)
        return quantize(dequantize(block, "f32") if fp8 else block.values, runs)
    if fp8:
        return dequantize(block, dtype), None
    return block.values.astype(STORED_DTYPES[dtype], copy=False), None
