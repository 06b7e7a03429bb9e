"""The shared experts of a MoE layer added to the routed experts' sum, in one pass over a
prefill chunk's fp8 rows: the Pallas TPU kernel of `reference.shared_expert`.

Why. Where the residual stream is split by row, each device runs every row of the chunk
through its slice of the shared experts' features (GLM-5.2: 128 of 2,048), whose down
projection writes [T, hidden] and is then added to the routed sum [T, hidden]. XLA:TPU fused
that add and the cast to the wire's bf16 into the down projection, but priced the fusion at
0.41 ms a half-layer of a 32K chunk (16,384 rows a device; its gate product another 0.06), for
77 GFLOP and 0.5 GB of HBM traffic, 0.14 ms at the device's rates: most of it the f32
elementwise passes over [T, hidden]. Here each tile of rows makes its gated product
[tm, inner] once, in VMEM, and each output tile is the routed tile plus that product through
the down weight, written once in bf16.

Numerics are those of the XLA path it replaces (`mlp.swiglu` on `Fp8Rows`, then the add):
each weight value times its block's scale rounded to bf16, the rows' fp8 values exact in bf16,
bf16 products on the MXU; here they are accumulated in f32 where XLA rounds gate, up and down
products to bf16 first, so the two differ by bf16 roundings.

Grid:   (T / tm row tiles, N / tn output column tiles), in order: the first step dequantises
        the three weights into VMEM (they are small: inner = 128 a device), and each row
        tile's first column tile makes its gated product.
Blocks: rows f8[tm, K] and their scales f32[tm, 1] by row tile; routed bf16[tm, tn]; the
        weights whole (gate and up f8[I, K], down f8[N, I]), fetched once; every scale flat
        in SMEM; out bf16[tm, tn]. Scratch: the dequantised weights bf16 [I, K] x 2 and
        [N, I], the gated product bf16[tm, I].
VMEM:   2 * (tm K + tm 128 * 4 + 2 tm tn * 2 + (2 I K + N I))   (double-buffered blocks)
        + (2 I K + N I + tm I) * 2                                 (the bf16 scratch)
        + tm K * 2 + tm tn * 4      (the rows in bf16 and the down product in f32: Mosaic's)
Per call:
        flops = 2 T K I * 2 + 2 T I N;  transcendentals = T I (silu)
        bytes = T K + T * 4 + 2 * T N * 2 + (2 I K + N I) + scales * 4
The dequantisation (~3 VPU operations a weight value, once a call) is left out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels import scaled_linear
from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.scaled_linear import FP8_SUBLANES
from cp_runtime.kernels.vmem import LANES, VMEM_BUDGET_BYTES, largest_divisor, tiled_bytes

__all__ = ["shared_expert", "supports", "cost", "tiles"]

ROW_TILE = 512               # rows a tile at most (a multiple of FP8_SUBLANES)
COLUMN_TILE = 2048           # output columns a tile at most (whole lane tiles)


def tiles(rows: int, hidden: int) -> tuple[int, int]:
    """(tm, tn): the row and output column tiles for `rows` rows of `hidden` features (the
    axis itself where no tile divides it: `supports` then refuses the call)."""
    return (largest_divisor(rows, FP8_SUBLANES, ROW_TILE),
            largest_divisor(hidden, LANES, COLUMN_TILE))


def _runs(w_shape: tuple[int, int], s_shape: tuple[int, ...]) -> tuple[int, int]:
    """A block-scaled weight's block sizes (ga, gb)."""
    return w_shape[0] // s_shape[0], w_shape[1] // s_shape[1]


def supports(rows: int, gate_shape: tuple[int, int], gate_scales: tuple[int, ...],
             down_shape: tuple[int, int], down_scales: tuple[int, ...]) -> bool:
    """Whether a TPU compiles the kernel for `rows` rows through gate/up [I, K] and down
    [N, I] with these block scales: tiles that divide, each weight's scale runs whole tiles
    (as the linear kernel takes them, `scaled_linear.supports`), and VMEM."""
    (inner, _), (n, inner_d) = gate_shape, down_shape
    tm, tn = tiles(rows, n)
    if (inner_d != inner or inner % LANES or tm > ROW_TILE or tm % FP8_SUBLANES
            or tn > COLUMN_TILE or tn % LANES
            or not scaled_linear.supports(gate_shape, gate_scales)
            or not scaled_linear.supports(down_shape, down_scales)):
        return False
    return cost(rows, gate_shape, gate_scales, down_shape, down_scales)["vmem_bytes"] <= (
        VMEM_BUDGET_BYTES)


def cost(rows: int, gate_shape: tuple[int, int], gate_scales: tuple[int, ...],
         down_shape: tuple[int, int], down_scales: tuple[int, ...]) -> dict:
    """Flops, transcendentals, HBM bytes and VMEM bytes of one call (module docstring)."""
    (inner, k), (n, _) = gate_shape, down_shape
    tm, tn = tiles(rows, n)
    weights = 2 * inner * k + n * inner
    scales = 2 * gate_scales[0] * gate_scales[1] + down_scales[0] * down_scales[1]
    vmem = (2 * (tiled_bytes((tm, k), 1) + tiled_bytes((tm, 1), 4)
                 + 2 * tiled_bytes((tm, tn), 2) + 2 * tiled_bytes((inner, k), 1)
                 + tiled_bytes((n, inner), 1))
            + 2 * tiled_bytes((inner, k), 2) + tiled_bytes((n, inner), 2)
            + tiled_bytes((tm, inner), 2) + tiled_bytes((tm, k), 2) + tiled_bytes((tm, tn), 4))
    return {"flops": 2 * rows * k * inner * 2 + 2 * rows * inner * n,
            "transcendentals": rows * inner,
            "bytes": rows * k + rows * 4 + 2 * rows * n * 2 + weights + scales * 4,
            "vmem_bytes": vmem}


def _dequantise(w_ref, s_ref, dst_ref, *, ga: int, gb: int) -> None:
    """dst bf16[a, b] = w f8[a, b] times its block scales s (flat, row-major, SMEM)."""
    a, b = w_ref.shape
    runs_b = b // gb

    def run(i, carry):
        r0 = pl.multiple_of(i // runs_b * ga, ga)
        c0 = pl.multiple_of(i % runs_b * gb, gb)
        block = w_ref[pl.ds(r0, ga), pl.ds(c0, gb)].astype(jnp.float32)
        dst_ref[pl.ds(r0, ga), pl.ds(c0, gb)] = (block * s_ref[i]).astype(jnp.bfloat16)
        return carry

    jax.lax.fori_loop(0, (a // ga) * runs_b, run, 0)


def _kernel(rows_ref,       # [tm, K] f8: this row tile's values
            row_s_ref,      # [tm, 1] f32: their scales
            routed_ref,     # [tm, tn] bf16: the routed experts' sum
            gate_ref,       # [I, K] f8
            up_ref,         # [I, K] f8
            down_ref,       # [N, I] f8
            gate_s_ref,     # flat f32 SMEM
            up_s_ref,       # flat f32 SMEM
            down_s_ref,     # flat f32 SMEM
            out_ref,        # [tm, tn] bf16
            gate_w, up_w, down_w,     # bf16 scratch: the dequantised weights
            gated_ref,      # [tm, I] bf16 scratch: silu(gate) * up of this row tile
            *, gate_runs: tuple[int, int], down_runs: tuple[int, int]):
    i, j = pl.program_id(0), pl.program_id(1)
    tn = out_ref.shape[1]

    @pl.when((i == 0) & (j == 0))
    def _():
        _dequantise(gate_ref, gate_s_ref, gate_w, ga=gate_runs[0], gb=gate_runs[1])
        _dequantise(up_ref, up_s_ref, up_w, ga=gate_runs[0], gb=gate_runs[1])
        _dequantise(down_ref, down_s_ref, down_w, ga=down_runs[0], gb=down_runs[1])

    @pl.when(j == 0)
    def _():
        x = rows_ref[...].astype(jnp.bfloat16)                        # exact: fp8 in bf16
        dims = (((1,), (1,)), ((), ()))
        g = jax.lax.dot_general(x, gate_w[...], dims, preferred_element_type=jnp.float32)
        u = jax.lax.dot_general(x, up_w[...], dims, preferred_element_type=jnp.float32)
        s = row_s_ref[...]                                            # a row's scale
        gated_ref[...] = (jax.nn.silu(g * s) * (u * s)).astype(jnp.bfloat16)

    c0 = pl.multiple_of(j * tn, tn)
    down = jax.lax.dot_general(gated_ref[...], down_w[pl.ds(c0, tn), :],
                               (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    out_ref[...] = (routed_ref[...].astype(jnp.float32) + down).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def shared_expert(values: jax.Array, row_scales: jax.Array, routed: jax.Array,
                  gate: jax.Array, gate_scales: jax.Array, up: jax.Array,
                  up_scales: jax.Array, down: jax.Array, down_scales: jax.Array, *,
                  interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.shared_expert`.

    values:  f8[T, K]      the rows (fp8_rows), each standing for values * row_scales
    row_scales: f32[T, 1]
    routed:  bf16[T, N]    the routed experts' sum of the same rows
    gate, up: f8[I, K]     with block scales f32[I / ga, K / gb] (the checkpoint's [out, in])
    down:    f8[N, I]      with block scales f32[N / ga, I / gb]
    returns: bf16[T, N]    routed + down(silu(gate(x)) * up(x))
    """
    t, k = values.shape
    n, inner = down.shape
    if (routed.shape != (t, n) or row_scales.shape != (t, 1) or gate.shape != (inner, k)
            or up.shape != gate.shape or up_scales.shape != gate_scales.shape):
        raise ValueError(f"rows {values.shape} (scales {row_scales.shape}), routed "
                         f"{routed.shape}, gate {gate.shape}, up {up.shape} and down "
                         f"{down.shape} do not fit together")
    if not supports(t, gate.shape, gate_scales.shape, down.shape, down_scales.shape):
        raise ValueError(f"no tiling of {t} rows through gate {gate.shape} (scales "
                         f"{gate_scales.shape}) and down {down.shape} (scales "
                         f"{down_scales.shape}) fits the kernel")
    tm, tn = tiles(t, n)
    figures = cost(t, gate.shape, gate_scales.shape, down.shape, down_scales.shape)
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0, 0))       # noqa: E731
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    flat = [s.astype(jnp.float32).reshape(-1) for s in (gate_scales, up_scales, down_scales)]
    return pl.pallas_call(
        functools.partial(_kernel, gate_runs=_runs(gate.shape, gate_scales.shape),
                          down_runs=_runs(down.shape, down_scales.shape)),
        grid=(t // tm, n // tn),
        in_specs=[pl.BlockSpec((tm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((tm, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
                  whole((inner, k)), whole((inner, k)), whole((n, inner)), smem, smem, smem],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((t, n), jnp.bfloat16),
        scratch_shapes=[pltpu.VMEM((inner, k), jnp.bfloat16),
                        pltpu.VMEM((inner, k), jnp.bfloat16),
                        pltpu.VMEM((n, inner), jnp.bfloat16),
                        pltpu.VMEM((tm, inner), jnp.bfloat16)],
        **call_options("shared_expert", figures, ("arbitrary", "arbitrary"), interpret),
    )(values, row_scales.astype(jnp.float32), routed, gate, up, down, *flat)

