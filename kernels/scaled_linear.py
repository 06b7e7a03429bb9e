"""A linear layer straight from block-scaled fp8 weights: the Pallas TPU kernel of
`reference.scaled_linear` (`x @ dequantised(W).T`, W in the checkpoints' [out, in] layout).

Why. XLA:TPU fuses the fp8 -> bf16 dequantisation into the matmul only when the scales,
broadcast to the weight's full shape in f32, fit in VMEM; otherwise it writes that broadcast to
HBM and reads it back, 4 bytes a weight value against the 1 the weight itself takes. In a
GLM-5.2 decode step on TPU7x that is o_proj in every MoE layer
(docs/notes/2026-12-03-decode-step.md,
"Decode's fp8 linears from VMEM, and a router on every device"). Here the scales stay
[N / ga, K / gb] and each weight block is dequantised once, in VMEM, as it is used.

Numerics are `weight()`'s in cp_runtime.model.ops: each value times its block's scale,
rounded to bf16, then a bf16 matmul accumulated in f32. The output stays f32.

Two forms, by the number of rows T:

Few rows (T <= ROW_TILE: decode steps, a few sequences' rows):
Grid:   (N / tn column tiles, T / tm row tiles); column tiles parallel, row tiles in order, so
        a weight block crosses HBM once and is dequantised on its first row tile only.
Blocks: rows [tm, K] by row tile in their own dtype (the model's f32: cast to bf16 in the
        kernel, where XLA spent an op on the cast), weight f8[tn, K] by column tile (VMEM),
        output f32[tm, tn]; every scale, flat, in SMEM (a few KB: a block of [tn / ga, K / gb]
        breaks Mosaic's tiling when tn / ga is not a multiple of 8); scratch: the dequantised
        block bf16[tn, K].
VMEM:   2 * (tm * K * x + tn * K * w + tm * tn * 4) + tn * K * 2   (x, w: input, weight bytes)
Per call:
        flops = 2 * T' * K * N                          (T' = T padded to tm)
        bytes = N * K * w + (N / ga) * (K / gb) * 4 + (N / tn) * T' * K * x + T' * N * 4
Many rows (T > ROW_TILE: a prefill chunk's rows). The weight as one [tn, K] block would
leave room for few rows, and the rows [T, K] would cross HBM once per column tile (GLM-5.2's
whole o_proj, K = 16,384, for the 1,024 rows of a device at a 16K chunk: 24 times). So K is
tiled too, and the row tiles are tall:
Grid:   (N / tn column tiles, T / tm row tiles, K / tk input tiles); the input tiles last, in
        order, summed into the output block, which stays in VMEM over them. (Where K is one
        input tile, the few-rows kernel runs with these taller tiles.)
Blocks: rows [tm, tk], weight f8[tn, tk], output f32[tm, tn]; scales flat in SMEM as above;
        scratch: the dequantised block bf16[tn, tk], made again on every step (~3 VPU
        operations a weight value against 2 * tm MXU flops: with tm in the hundreds the
        MXU's work is the longer).
VMEM:   2 * (tm * tk * x + tn * tk * w + tm * tn * 4) + tn * tk * 2
        + tm * tn * 4 + tm * tk * 2     (the product [tm, tn] and the rows in bf16: Mosaic's)
Per call:
        flops = 2 * T' * K * N
        bytes = (T' / tm) * N * K * w + (N / ga) * (K / gb) * 4 + (N / tn) * T' * K * x
                + T' * N * 4
The dequantisation is ~3 VPU operations a weight value, left out of the estimate (the same
work XLA's fused form does); a grid step's fixed overhead (a few hundred ns) is left out too.
On a TPU the scale runs must be whole tiles (gb a multiple of 128 lanes, ga of 32 fp8
sublanes: `supports`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels import expert_matmul
from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.storage import cdiv
from cp_runtime.kernels.vmem import LANES, VMEM_BUDGET_BYTES, largest_divisor, tiled_bytes

__all__ = ["scaled_linear", "supports", "row_tile", "column_tile", "tiles", "cost"]

ROW_TILE = 256                  # rows per tile at most, few-rows form; more take the tiled form
FP8_SUBLANES = 32               # rows of an fp8 (8-bit) sublane tile
# The tiled form's tiles at most: rows, output columns (the f32 output block [tm, tn] is
# 8 MB at these two), input columns.
TILED_ROWS = 1024
TILED_COLUMNS = 2048
TILED_INPUTS = 512


def supports(w_shape: tuple[int, ...], s_shape: tuple[int, ...]) -> bool:
    """Whether a TPU compiles the kernel for a weight [N, K] with scales [N/ga, K/gb]: the
    scale runs along K must be whole 128-lane tiles and those along N whole fp8 sublane tiles
    (32 rows: kv_a_proj's 576 rows have runs of 64), and the column tile must fit VMEM."""
    if len(w_shape) != 2 or len(s_shape) != 2:
        return False
    (n, k), (sn, sk) = w_shape, s_shape
    if n % sn or k % sk:
        return False
    ga, gb = n // sn, k // sk
    return (ga % FP8_SUBLANES == 0 and gb % LANES == 0
            and cost(ROW_TILE, w_shape, s_shape, x_itemsize=4)["vmem_bytes"]
            <= VMEM_BUDGET_BYTES)


def row_tile(num_rows: int) -> int:
    """tm: all the rows when they fit one tile (a block as tall as the array needs no padding:
    a decode step's few rows go in as they are), else ROW_TILE."""
    return max(num_rows, 1) if num_rows <= ROW_TILE else ROW_TILE


def column_tile(n: int, k: int, ga: int, itemsize: int) -> int:
    """tn: the widest divisor of N that is whole scale runs and whole lane tiles (the output
    block [tm, tn] must be, unless it is all of N) and whose weight block [tn, K] stays within
    the experts' kernel's block budget; the narrowest such when none does (N itself for
    kv_a_proj's 576 rows: 3.5 MB)."""
    fits = [tn for tn in range(ga, n + 1, ga)
            if n % tn == 0 and (tn % LANES == 0 or tn == n)]
    within = [tn for tn in fits if tn * k * itemsize <= expert_matmul.WEIGHT_BLOCK_BYTES]
    return max(within) if within else min(fits)


def tiles(num_rows: int, w_shape: tuple[int, int], s_shape: tuple[int, int],
          w_itemsize: int = 1) -> tuple[int, int, int]:
    """(tm, tn, tk) of a call on `num_rows` rows. Few rows: (`row_tile`, `column_tile`, K).
    Many: row tiles of at most TILED_ROWS, as even as 16-row multiples allow; tn the widest
    divisor of N of whole scale runs and lane tiles up to TILED_COLUMNS; tk the widest
    divisor of K of whole scale runs up to TILED_INPUTS."""
    n, k = w_shape
    ga, gb = n // s_shape[0], k // s_shape[1]
    if num_rows <= ROW_TILE:
        return row_tile(num_rows), column_tile(n, k, ga, w_itemsize), k
    row_tiles = cdiv(num_rows, TILED_ROWS)
    tm = cdiv(cdiv(num_rows, row_tiles), 16) * 16
    return (tm, largest_divisor(n, math.lcm(ga, LANES), TILED_COLUMNS),
            largest_divisor(k, math.lcm(gb, LANES), TILED_INPUTS))


def cost(num_rows: int, w_shape: tuple[int, int], s_shape: tuple[int, int],
         w_itemsize: int = 1, x_itemsize: int = 2) -> dict:
    """HBM bytes, flops and VMEM bytes of one call (module docstring; the few-rows form is
    the tiled one's formula with tk = K, one row tile's weight reads)."""
    n, k = w_shape
    tm, tn, tk = tiles(num_rows, w_shape, s_shape, w_itemsize)
    rows = cdiv(num_rows, tm) * tm
    weight_reads = 1 if tk == k else rows // tm
    vmem = (2 * (tiled_bytes((tm, tk), x_itemsize) + tiled_bytes((tn, tk), w_itemsize)
                 + tiled_bytes((tm, tn), 4)) + tiled_bytes((tn, tk), 2))
    if tk != k:       # the product before it joins the sum, and the rows cast to bf16
        vmem += tiled_bytes((tm, tn), 4) + tiled_bytes((tm, tk), 2)
    return {"flops": 2 * rows * k * n,
            "bytes": (weight_reads * n * k * w_itemsize + s_shape[0] * s_shape[1] * 4
                      + (n // tn) * rows * k * x_itemsize + rows * n * 4),
            "vmem_bytes": vmem}


def _kernel(x_ref,            # [tm, K] f32 or bf16
            w_ref,            # [tn, K] fp8 (or any float)
            s_ref,            # [N / ga * K / gb] f32 SMEM: every scale, row-major
            out_ref,          # [tm, tn] f32
            w_bf16_ref,       # [tn, K] bf16 scratch: the dequantised block
            *, k_runs: int, ga: int):
    tn, k = w_ref.shape
    n_runs, gb = tn // ga, k // k_runs
    first = pl.program_id(0) * n_runs * k_runs             # this block's first scale

    @pl.when(pl.program_id(1) == 0)        # the block's first row tile: dequantise it once
    def _():
        def run(i, carry):
            nr, kr = i // k_runs, i % k_runs
            n0 = pl.multiple_of(nr * ga, ga)
            k0 = pl.multiple_of(kr * gb, gb)
            block = w_ref[pl.ds(n0, ga), pl.ds(k0, gb)].astype(jnp.float32)
            w_bf16_ref[pl.ds(n0, ga), pl.ds(k0, gb)] = (
                block * s_ref[first + i]).astype(jnp.bfloat16)
            return carry

        jax.lax.fori_loop(0, n_runs * k_runs, run, 0)

    out_ref[...] = jax.lax.dot_general(x_ref[...].astype(jnp.bfloat16), w_bf16_ref[...],
                                       (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)


def _tiled_kernel(x_ref,        # [tm, tk] f32 or bf16
                  w_ref,        # [tn, tk] fp8 (or any float)
                  s_ref,        # [N / ga * K / gb] f32 SMEM: every scale, row-major
                  out_ref,      # [tm, tn] f32: the sum so far, in VMEM over the input tiles
                  w_bf16_ref,   # [tn, tk] bf16 scratch: the dequantised block
                  *, k_runs: int, ga: int, gb: int):
    tn, tk = w_ref.shape
    n_runs, tile_runs = tn // ga, tk // gb
    j, kt = pl.program_id(0), pl.program_id(2)

    def run(i, carry):
        nr, kr = i // tile_runs, i % tile_runs
        n0 = pl.multiple_of(nr * ga, ga)
        k0 = pl.multiple_of(kr * gb, gb)
        scale = s_ref[(j * n_runs + nr) * k_runs + kt * tile_runs + kr]
        block = w_ref[pl.ds(n0, ga), pl.ds(k0, gb)].astype(jnp.float32)
        w_bf16_ref[pl.ds(n0, ga), pl.ds(k0, gb)] = (block * scale).astype(jnp.bfloat16)
        return carry

    jax.lax.fori_loop(0, n_runs * tile_runs, run, 0)
    part = jax.lax.dot_general(x_ref[...].astype(jnp.bfloat16), w_bf16_ref[...],
                               (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(kt == 0)
    def _():
        out_ref[...] = part

    @pl.when(kt > 0)
    def _():
        out_ref[...] += part


def _call(rows: jax.Array, w: jax.Array, scales: jax.Array, figures: dict,
          tm: int, tn: int, tk: int, interpret) -> jax.Array:
    """The pallas_call of either form on rows [T', K] (T' a multiple of tm) -> f32[T', N]."""
    (t, k), n = rows.shape, w.shape[0]
    ga, gb = n // scales.shape[0], k // scales.shape[1]
    flat_scales = scales.astype(jnp.float32).reshape(-1)
    out_shape = jax.ShapeDtypeStruct((t, n), jnp.float32)
    if tk == k:
        return pl.pallas_call(
            functools.partial(_kernel, k_runs=scales.shape[1], ga=ga),
            grid=(n // tn, t // tm),
            in_specs=[pl.BlockSpec((tm, k), lambda j, i: (i, 0)),
                      pl.BlockSpec((tn, k), lambda j, i: (j, 0)),
                      pl.BlockSpec(memory_space=pltpu.SMEM)],
            out_specs=pl.BlockSpec((tm, tn), lambda j, i: (i, j)),
            scratch_shapes=[pltpu.VMEM((tn, k), jnp.bfloat16)], out_shape=out_shape,
            **call_options("scaled_linear", figures, ("parallel", "arbitrary"), interpret),
        )(rows, w, flat_scales)
    return pl.pallas_call(
        functools.partial(_tiled_kernel, k_runs=scales.shape[1], ga=ga, gb=gb),
        grid=(n // tn, t // tm, k // tk),
        in_specs=[pl.BlockSpec((tm, tk), lambda j, i, kt: (i, kt)),
                  pl.BlockSpec((tn, tk), lambda j, i, kt: (j, kt)),
                  pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((tm, tn), lambda j, i, kt: (i, j)),
        scratch_shapes=[pltpu.VMEM((tn, tk), jnp.bfloat16)], out_shape=out_shape,
        **call_options("scaled_linear", figures, ("parallel", "parallel", "arbitrary"),
                       interpret),
    )(rows, w, flat_scales)


@functools.partial(jax.jit, static_argnames=("interpret",))
def scaled_linear(x: jax.Array, w: jax.Array, scales: jax.Array, *,
                  interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.scaled_linear`.

    x:       f[..., K]        cast to bf16 in the kernel (the MXU's input)
    w:       f8[N, K]         (or any float dtype) the checkpoint's [out, in] layout
    scales:  f32[N/ga, K/gb]  one scale per ga x gb block of w
    returns: f32[..., N]
    """
    *lead, k = x.shape
    n, kw = w.shape
    if kw != k or scales.ndim != 2 or n % scales.shape[0] or k % scales.shape[1]:
        raise ValueError(f"input {x.shape}, weight {w.shape} and scales {scales.shape} do "
                         "not fit together")
    rows = x.reshape(-1, k)
    t = rows.shape[0]
    tm, tn, tk = tiles(t, w.shape, scales.shape, w.dtype.itemsize)
    t_pad = cdiv(t, tm) * tm
    padded = rows if t_pad == t else jnp.pad(rows, ((0, t_pad - t), (0, 0)))
    figures = cost(t, w.shape, scales.shape, w.dtype.itemsize, rows.dtype.itemsize)
    out = _call(padded, w, scales, figures, tm, tn, tk, interpret)
    return (out if t_pad == t else out[:t]).reshape(*lead, n)
