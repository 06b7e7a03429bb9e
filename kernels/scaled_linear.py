"""A linear layer straight from block-scaled fp8 weights: the Pallas TPU kernel of
`reference.scaled_linear` (`x @ dequantised(W).T`, W in the checkpoints' [out, in] layout).

Why. XLA:TPU fuses the fp8 -> bf16 dequantisation into the matmul only when the scales,
broadcast to the weight's full shape in f32, fit in VMEM; otherwise it writes that broadcast to
HBM and reads it back, 4 bytes a weight value against the 1 the weight itself takes. In a
GLM-5.2 decode step on TPU7x that is o_proj in every MoE layer (25 MB written and read again a
layer, 6 GB a step; docs/performance.md). Here the scales stay [N / ga, K / gb] and each weight
block is dequantised once, in VMEM, as it is used.

Numerics are `weight()`'s in cp_runtime.model.forward: each value times its block's scale,
rounded to bf16, then a bf16 matmul accumulated in f32. The output stays f32.

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
The dequantisation is ~3 VPU operations a weight value, left out of the estimate (the same
work XLA's fused form does); a grid step's fixed overhead (a few hundred ns) is left out too.
On a TPU the scale runs must be whole tiles (gb a multiple of 128 lanes, ga of 32 fp8
sublanes: `supports`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels import expert_matmul
from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.storage import cdiv
from cp_runtime.kernels.vmem import LANES, VMEM_BUDGET_BYTES, tiled_bytes

__all__ = ["scaled_linear", "supports", "row_tile", "column_tile", "cost"]

ROW_TILE = 256                  # rows per tile at most
FP8_SUBLANES = 32               # rows of an fp8 (8-bit) sublane tile


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


def cost(num_rows: int, w_shape: tuple[int, int], s_shape: tuple[int, int],
         w_itemsize: int = 1, x_itemsize: int = 2) -> dict:
    """HBM bytes, flops and VMEM bytes of one call (module docstring)."""
    n, k = w_shape
    ga = n // s_shape[0]
    tm = row_tile(num_rows)
    rows = cdiv(num_rows, tm) * tm
    tn = column_tile(n, k, ga, w_itemsize)
    vmem = (2 * (tiled_bytes((tm, k), x_itemsize) + tiled_bytes((tn, k), w_itemsize)
                 + tiled_bytes((tm, tn), 4)) + tiled_bytes((tn, k), 2))
    return {"flops": 2 * rows * k * n,
            "bytes": (n * k * w_itemsize + s_shape[0] * s_shape[1] * 4
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
    tm = row_tile(t)
    t_pad = cdiv(t, tm) * tm
    ga = n // scales.shape[0]
    tn = column_tile(n, k, ga, w.dtype.itemsize)
    padded = rows if t_pad == t else jnp.pad(rows, ((0, t_pad - t), (0, 0)))
    figures = cost(t, w.shape, scales.shape, w.dtype.itemsize, rows.dtype.itemsize)
    out = pl.pallas_call(
        functools.partial(_kernel, k_runs=scales.shape[1], ga=ga),
        grid=(n // tn, t_pad // tm),
        in_specs=[pl.BlockSpec((tm, k), lambda j, i: (i, 0)),
                  pl.BlockSpec((tn, k), lambda j, i: (j, 0)),
                  pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((tm, tn), lambda j, i: (i, j)),
        scratch_shapes=[pltpu.VMEM((tn, k), jnp.bfloat16)],
        out_shape=jax.ShapeDtypeStruct((t_pad, n), jnp.float32),
        **call_options("scaled_linear", figures, ("parallel", "arbitrary"), interpret),
    )(padded, w, scales.astype(jnp.float32).reshape(-1))
    return (out if t_pad == t else out[:t]).reshape(*lead, n)
