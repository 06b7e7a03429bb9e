"""Random weights made on the host directly in the dtype each is stored in on the devices
(cp_runtime.weights.format), as a block source (cp_runtime.weights.placement.BlockSource): the
executor places them as it places a checkpoint's, one block at a time, so a large model's
random weights never exist in f32, on the host or on a device.

`init_params` (cp_runtime.weights.params) draws every tensor in f32 with JAX; that is exact and
seeded for the tests, but a full-width GLM-5.2 layer is 10 GB of fp8 weights, 40 GB in f32. Here
each tensor is drawn as random bits in its stored dtype instead:

    fp8 (e4m3)  sign, mantissa and the exponent's two low bits random, its two high bits
                fixed (magnitudes 2 to 30, RMS FP8_RMS: no NaN, nothing near the format's
                448); one f32 scale per checkpoint block, the same for every block of a
                tensor: std / FP8_RMS
    bf16        sign, mantissa and the exponent's low bit random, its other bits fixed so that
                the RMS is within a factor 2 of std
    f32         normal, times std (numpy's generator)

with std the one `init_params` uses: fan_in^-0.5 for a linear weight ([out, in] in HF layout;
[E, in, out] for a routed-expert stack), 1 for the embedding; norms are ones, biases zeros.
The values are random, not normal: what a benchmark needs is every weight's bytes in place
and activations of a sensible size. Each tensor's bits come from its own generator, seeded
by (seed, the tensor's name), so a tensor is the same whichever others are made.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import zlib

import numpy as np

from cp_runtime.config import ModelConfig
from cp_runtime.weights.format import FP8_BLOCK, STORED_DTYPES, stored_dtype
from cp_runtime.weights.fp8_blocks import HostBlock
from cp_runtime.weights.sharding import EXPERT_STACKS
from cp_runtime.weights.params import model_shapes

__all__ = ["FP8_RMS", "RandomBlocks", "random_tensor", "tensor_std"]

# RMS of the fp8 values drawn below: exponent e in {1, 2, 3, 4} (biased 8..11), mantissa m
# uniform in 0..7: sqrt(mean(4^e) * mean((1 + m / 8)^2)).
FP8_RMS = math.sqrt(sum(4.0 ** e for e in range(1, 5)) / 4
                    * sum((1 + m / 8) ** 2 for m in range(8)) / 8)
# RMS of the bf16 values drawn below over 2^e0: exponent e0 or e0 + 1, mantissa uniform.
_BF16_RMS = math.sqrt((1 + 4) / 2 * sum((1 + m / 128) ** 2 for m in range(128)) / 128)
# 64-bit words drawn per pass (128 MiB): passes run on a few threads, each from its own
# generator, so the bits do not depend on how many threads there are.
_PASS = 1 << 24
_THREADS = max(1, min(8, os.cpu_count() or 1))


def tensor_std(name: str, shape: tuple[int, ...]) -> float | None:
    """The standard deviation `init_params` gives tensor `name` (model layout), or None for a
    constant one (norms: ones; biases: zeros)."""
    if name.endswith(("norm.weight", ".bias", "e_score_correction_bias")) or len(shape) < 2:
        return None
    if name.endswith("embed_tokens.weight"):
        return 1.0
    fan_in = shape[-2] if name.endswith(EXPERT_STACKS) else shape[-1]
    return fan_in ** -0.5


def _random_bytes(seed: int, name: str, nbytes: int) -> np.ndarray:
    """nbytes random bytes (uint8), drawn from (seed, name) in passes of _PASS words."""
    words = np.empty(-(-nbytes // 8), np.uint64)
    key = zlib.crc32(name.encode())

    def draw(i: int) -> None:
        lo, hi = i * _PASS, min((i + 1) * _PASS, len(words))
        words[lo:hi] = np.random.SFC64([seed, key, i]).random_raw(hi - lo)

    passes = range(-(-len(words) // _PASS))
    if len(passes) > 1 and _THREADS > 1:
        with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
            list(pool.map(draw, passes))
    else:
        for i in passes:
            draw(i)
    return words.view(np.uint8)[:nbytes]


def _bits_fp8(seed: int, name: str, n: int) -> np.ndarray:
    """n random e4m3 bit patterns: exponent field 8..11 (magnitudes 2 to 30; no NaN)."""
    bits = _random_bytes(seed, name, n)
    np.bitwise_and(bits, 0x9F, out=bits)              # sign, exponent's low bits, mantissa
    np.bitwise_or(bits, 0x40, out=bits)               # exponent's high bits: 10
    return bits


def _bits_bf16(seed: int, name: str, n: int, std: float) -> np.ndarray:
    """n random bf16 bit patterns: exponent e0 or e0 + 1 (e0 even), e0 chosen so that the
    RMS, _BF16_RMS * 2^(e0 - 127), is within a factor 2 of `std`."""
    e0 = 2 * round((math.log2(std / _BF16_RMS) + 127) / 2)
    e0 = min(max(e0, 2), 252)
    bits = _random_bytes(seed, name, 2 * n).view(np.uint16)
    np.bitwise_and(bits, 0x80FF, out=bits)            # sign, exponent's low bit, mantissa
    np.bitwise_or(bits, np.uint16(e0 << 7), out=bits)
    return bits


def _scale_block(name: str, block: tuple[int, int]) -> tuple[int, int]:
    """The checkpoint block [out, in] as it lies on a model-layout tensor's last two axes (a
    routed-expert stack [E, in, out] is transposed)."""
    return (block[1], block[0]) if name.endswith(EXPERT_STACKS) else tuple(block)


def random_tensor(name: str, shape: tuple[int, ...], weight_dtype: str, seed: int,
                  block: tuple[int, int] = FP8_BLOCK) -> HostBlock:
    """Tensor `name` (model layout) of `shape`, random (module docstring), as a device stores
    it under a concrete `weight_dtype`: an fp8 weight with its block scales, else values."""
    dtype = stored_dtype(name, shape, weight_dtype)
    std = tensor_std(name, shape)
    if std is None:
        fill = 1.0 if name.endswith("norm.weight") else 0.0
        return HostBlock(np.full(shape, fill, STORED_DTYPES[dtype]))
    n = math.prod(shape)
    if dtype == "f32":
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        values = rng.standard_normal(n, np.float32) * np.float32(std)
        return HostBlock(values.reshape(shape))
    if dtype == "bf16":
        return HostBlock(_bits_bf16(seed, name, n, std).view(STORED_DTYPES["bf16"])
                         .reshape(shape))
    values = _bits_fp8(seed, name, n).view(STORED_DTYPES["fp8"]).reshape(shape)
    bo, bi = _scale_block(name, block)
    scales = np.full((*shape[:-2], -(-shape[-2] // bo), -(-shape[-1] // bi)),
                     std / FP8_RMS, np.float32)
    return HostBlock(values, scales=scales, block=(bo, bi))


class RandomBlocks:
    """A block source of random weights for `model` in a concrete `weight_dtype` ("fp8",
    "bf16" or "f32"), made on the host in that dtype. Each tensor is made once, when first
    read (or by `prepare`), and kept, so a second placement (another executor on the same
    weights) copies the same values without drawing them again; `nbytes` is what is kept."""

    block = FP8_BLOCK

    def __init__(self, model: ModelConfig, weight_dtype: str, seed: int = 0):
        if weight_dtype not in STORED_DTYPES:
            raise ValueError(f"weight dtype {weight_dtype!r}: resolve 'auto' first")
        self.model, self.weight_dtype, self.seed = model, weight_dtype, seed
        self.shapes = model_shapes(model)
        self._made: dict[str, HostBlock] = {}

    def prepare(self) -> None:
        """Make every tensor now (so that placing them times the copies alone)."""
        for name in self.shapes:
            self._tensor(name)

    @property
    def nbytes(self) -> int:
        return sum(b.values.nbytes + (0 if b.scales is None else b.scales.nbytes)
                   for b in self._made.values())

    def _tensor(self, name: str) -> HostBlock:
        if name not in self._made:
            self._made[name] = random_tensor(name, self.shapes[name], self.weight_dtype,
                                             self.seed, self.block)
        return self._made[name]

    def read(self, name: str, axis: int | None, lo: int, hi: int,
             experts: tuple[int, int] | None = None) -> HostBlock:
        whole = self._tensor(name)
        values, scales = whole.values, whole.scales
        if experts is not None:
            values = values[experts[0]:experts[1]]
            scales = None if scales is None else scales[experts[0]:experts[1]]
        if axis is None:
            return HostBlock(values, scales=scales, block=whole.block)
        index = [slice(None)] * values.ndim
        index[axis] = slice(lo, hi)
        first = [0, 0]
        if axis >= values.ndim - 2:
            first[axis - (values.ndim - 2)] = lo
        return HostBlock(values[tuple(index)], scales=scales, block=whole.block,
                         first=tuple(first))
