"""MLA's per-head products with kv_b in the absorbed form, from its fp8 blocks, in Pallas TPU
kernels: queries into the latent space (W_uk, `absorb_queries`) and, fused with the attention
merge, outputs out of it (W_uv, `merge_values`). Twins of `reference.absorb_queries` and
`reference.merge_values`.

Why. A decode step's kv_b block on a device is small (GLM-5.2: 4 heads x 448 rows x 512, 0.9
MB of fp8), but XLA:TPU dequantised it in passes of its own (the scales broadcast to the
block's shape, a bf16 copy written to HBM) and ran each product and the merge around it as
separate ops, each with a fixed cost of about a microsecond in the compiler's figures: ~8 us
for W_uk and ~20 us for the merge and W_uv in every GLM-5.2 layer, against well under one of
work. Here each is one call that dequantises kv_b in VMEM.

kv_b's rows per head are [W_uk (nope rows) | W_uv (v rows)], each [., Dv] (Dv = kv_lora_rank);
its block scales' runs cross heads (448 rows a head against 128-row runs), so a call
dequantises the whole block once, on its first grid step, and takes each head's rows from the
bf16 scratch.

Numerics are `ops.weight`'s (cp_runtime.model.ops): each fp8 value times its block's scale, rounded
to bf16; bf16 inputs, f32 sums; results rounded to bf16, as XLA's bf16 matmul rounds them. The
merge is `merge.merge_stacked`'s in f32 (weights exp(lse_r - max) / sum; zero for a head no shard
saw).

Grid:   (H',) over this device's heads, in order (the first step fills the scratch).
absorb_queries
  Blocks: q f32[1, R, Dq] per head (its first nope lanes are q_nope); kv_b f8[H'(nope + v), Dv]
          whole; scales flat in SMEM; output bf16[1, R, Dv] per head.
  flops = 2 R H' nope Dv;  bytes = H' R Dq 4 + kv_b + scales + H' R Dv 2
merge_values
  Blocks: received f32[S, 1, R, Dv + 1] per head (every shard's partials [o | lse]); kv_b and
          scales as above; output bf16[R, v] per head, side by side in [R, H' v].
  flops = 2 R H' v Dv + 3 S R H' Dv;  transcendentals = S R H' (an exp a partial)
  bytes = S H' R (Dv + 1) 4 + kv_b + scales + R H' v 2
VMEM: twice each block, plus the bf16 scratch [H'(nope + v), Dv] (`cost`, lane-padded).
The dequantisation (~3 VPU operations a weight value) is left out of the estimates, as in
scaled_linear. On a TPU the scale runs must be whole lane tiles (`supports`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.vmem import LANES, tiled_bytes

__all__ = ["absorb_queries", "merge_values", "supports", "cost", "absorb_cost"]


def supports(w_shape: tuple[int, ...], s_shape: tuple[int, ...]) -> bool:
    """Whether a TPU compiles the kernel for kv_b [H'(nope + v), Dv] with its block scales:
    whole 128-lane scale runs."""
    if len(w_shape) != 2 or len(s_shape) != 2:
        return False
    ga, gb = w_shape[0] // s_shape[0], w_shape[1] // s_shape[1]
    return ga % LANES == 0 and gb % LANES == 0


def cost(received_shape: tuple[int, ...], w_shape: tuple[int, int],
         s_shape: tuple[int, int], value_dim: int, w_itemsize: int = 1) -> dict:
    """HBM bytes, flops, transcendentals and VMEM bytes of one call (module docstring)."""
    s, heads, rows, packed = received_shape
    dv = packed - 1
    vmem = (2 * (tiled_bytes((s, rows, packed), 4) + tiled_bytes(w_shape, w_itemsize)
                 + tiled_bytes((rows, value_dim), 2)) + tiled_bytes(w_shape, 2))
    return {"flops": 2 * rows * heads * value_dim * dv + 3 * s * rows * heads * dv,
            "transcendentals": s * rows * heads,
            "bytes": (s * heads * rows * packed * 4 + w_shape[0] * w_shape[1] * w_itemsize
                      + s_shape[0] * s_shape[1] * 4 + rows * heads * value_dim * 2),
            "vmem_bytes": vmem}


def absorb_cost(q_shape: tuple[int, ...], w_shape: tuple[int, int], s_shape: tuple[int, int],
                nope: int, w_itemsize: int = 1) -> dict:
    """HBM bytes, flops and VMEM bytes of one `absorb_queries` call (module docstring)."""
    heads, rows, dq = q_shape
    dv = w_shape[1]
    vmem = (2 * (tiled_bytes((rows, dq), 4) + tiled_bytes(w_shape, w_itemsize)
                 + tiled_bytes((rows, dv), 2)) + tiled_bytes(w_shape, 2))
    return {"flops": 2 * rows * heads * nope * dv,
            "bytes": (heads * rows * dq * 4 + w_shape[0] * w_shape[1] * w_itemsize
                      + s_shape[0] * s_shape[1] * 4 + heads * rows * dv * 2),
            "vmem_bytes": vmem}


def _dequantise(w_ref, s_ref, w_bf16_ref, *, ga: int, gb: int) -> None:
    """w_bf16 = w times its blocks' scales, in bf16, one ga x gb run at a time."""
    n, k = w_ref.shape
    k_runs = k // gb

    def run(i, carry):
        n0 = pl.multiple_of((i // k_runs) * ga, ga)
        k0 = pl.multiple_of((i % k_runs) * gb, gb)
        block = w_ref[pl.ds(n0, ga), pl.ds(k0, gb)].astype(jnp.float32)
        w_bf16_ref[pl.ds(n0, ga), pl.ds(k0, gb)] = (block * s_ref[i]).astype(jnp.bfloat16)
        return carry

    jax.lax.fori_loop(0, (n // ga) * k_runs, run, 0)


def _absorb_kernel(q_ref,      # [1, R, Dq] f32: this head's queries, q_nope first
                   w_ref,      # [H'(nope + v), Dv] fp8
                   s_ref,      # flat scales, SMEM
                   out_ref,    # [1, R, Dv] bf16
                   w_bf16_ref, # [H'(nope + v), Dv] bf16 scratch
                   *, nope: int, v: int, ga: int, gb: int):
    head = pl.program_id(0)

    @pl.when(head == 0)
    def _():
        _dequantise(w_ref, s_ref, w_bf16_ref, ga=ga, gb=gb)

    q_nope = q_ref[0, :, pl.ds(0, nope)].astype(jnp.bfloat16)          # [R, nope]
    w_uk = w_bf16_ref[pl.ds(pl.multiple_of(head * (nope + v), 8), nope), :]   # [nope, Dv]
    out_ref[0] = jnp.dot(q_nope, w_uk,
                         preferred_element_type=jnp.float32).astype(out_ref.dtype)


def _kernel(received_ref,     # [S, 1, R, Dv + 1] f32: this head's partials from every shard
            w_ref,            # [H'(nope + v), Dv] fp8: kv_b, per head [W_uk (nope) | W_uv (v)]
            s_ref,            # [H'(nope + v) / ga * Dv / gb] f32 SMEM, row-major
            out_ref,          # [R, v] bf16
            w_bf16_ref,       # [H'(nope + v), Dv] bf16 scratch
            *, nope: int, ga: int, gb: int):
    head = pl.program_id(0)
    dv = received_ref.shape[-1] - 1
    v = out_ref.shape[-1]

    @pl.when(head == 0)
    def _():
        _dequantise(w_ref, s_ref, w_bf16_ref, ga=ga, gb=gb)

    o = received_ref[:, 0, :, pl.ds(0, dv)]                         # [S, R, Dv]
    lse = received_ref[:, 0, :, pl.ds(dv, 1)]                       # [S, R, 1]
    top = jnp.max(lse, axis=0)                                      # [R, 1]
    top = jnp.where(top > -jnp.inf, top, 0.0)
    e = jnp.exp(lse - top)
    total = jnp.sum(e, axis=0)
    weights = e / jnp.where(total > 0, total, 1.0)
    merged = jnp.sum(weights * o, axis=0)                           # [R, Dv]
    first = pl.multiple_of(head * (nope + v) + nope, 8)
    w_uv = w_bf16_ref[pl.ds(first, v), :]                           # [v, Dv]
    out_ref[...] = jax.lax.dot_general(
        merged.astype(jnp.bfloat16), w_uv, (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32).astype(out_ref.dtype)


def _runs(w: jax.Array, scales: jax.Array, heads: int, nope: int) -> tuple[int, int, int]:
    """(v, ga, gb) of kv_b w f8[H'(nope + v), Dv] with scales f32[H'(nope + v)/ga, Dv/gb],
    over `heads` heads; ValueError where they do not fit together."""
    n, dv = w.shape
    if n % heads or n // heads <= nope or scales.ndim != 2 or n % scales.shape[0] \
            or dv % scales.shape[1]:
        raise ValueError(f"kv_b {w.shape} with scales {scales.shape} is no {heads} heads of "
                         f"nope={nope} rows and more: they do not fit together")
    return n // heads - nope, n // scales.shape[0], dv // scales.shape[1]


def _call_over_heads(kernel, name: str, figures: dict, interpret: bool, *, heads: int,
                     first: jax.Array, first_block: tuple[int, ...], first_at,
                     out_block: tuple[int, ...], out_at, out_shape: tuple[int, ...],
                     w: jax.Array, scales: jax.Array) -> jax.Array:
    """pallas_call of `kernel` over a grid of the heads (first_at(h), out_at(h): block indices)
    with `first` in blocks, kv_b whole in VMEM, its scales flat in SMEM and a bf16 scratch of
    kv_b's shape."""
    return pl.pallas_call(
        kernel, grid=(heads,),
        in_specs=[pl.BlockSpec(first_block, first_at),
                  pl.BlockSpec(w.shape, lambda h: (0, 0)),
                  pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec(out_block, out_at),
        scratch_shapes=[pltpu.VMEM(w.shape, jnp.bfloat16)],
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
        **call_options(name, figures, ("arbitrary",), interpret),
    )(first.astype(jnp.float32), w, scales.astype(jnp.float32).reshape(-1))


@functools.partial(jax.jit, static_argnames=("nope", "interpret"))
def merge_values(received: jax.Array, w: jax.Array, scales: jax.Array, *, nope: int,
                 interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.merge_values`.

    received: f32[S, H', R, Dv + 1]   every shard's partials [o | lse] of this device's heads
    w:        f8[H'(nope + v), Dv]    kv_b of those heads (or any float dtype)
    scales:   f32[H'(nope + v)/ga, Dv/gb]
    returns:  bf16[R, H' v]           each head's merged o through its W_uv, heads side by side
    """
    s, heads, rows, packed = received.shape
    if packed != w.shape[1] + 1:
        raise ValueError(f"received {received.shape} and kv_b {w.shape} do not fit together")
    v, ga, gb = _runs(w, scales, heads, nope)
    return _call_over_heads(
        functools.partial(_kernel, nope=nope, ga=ga, gb=gb), "merge_values",
        cost(received.shape, w.shape, scales.shape, v, w.dtype.itemsize), interpret, heads=heads,
        first=received, first_block=(s, 1, rows, packed), first_at=lambda h: (0, h, 0, 0),
        out_block=(rows, v), out_at=lambda h: (0, h), out_shape=(rows, heads * v),
        w=w, scales=scales)


@functools.partial(jax.jit, static_argnames=("nope", "interpret"))
def absorb_queries(q: jax.Array, w: jax.Array, scales: jax.Array, *, nope: int,
                   interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.absorb_queries`.

    q:       f32[H', R, Dq]          this device's heads' queries, q_nope in the first nope lanes
    w:       f8[H'(nope + v), Dv]    kv_b of those heads (or any float dtype)
    scales:  f32[H'(nope + v)/ga, Dv/gb]
    returns: bf16[H', R, Dv]         q_nope . W_uk per head
    """
    heads, rows, dq = q.shape
    if dq < nope:
        raise ValueError(f"queries {q.shape} are narrower than nope={nope}: they do not fit "
                         "together")
    v, ga, gb = _runs(w, scales, heads, nope)
    dv = w.shape[1]
    return _call_over_heads(
        functools.partial(_absorb_kernel, nope=nope, v=v, ga=ga, gb=gb), "absorb_queries",
        absorb_cost(q.shape, w.shape, scales.shape, nope, w.dtype.itemsize), interpret,
        heads=heads, first=q, first_block=(1, rows, dq), first_at=lambda h: (h, 0, 0),
        out_block=(1, rows, dv), out_at=lambda h: (h, 0, 0), out_shape=(heads, rows, dv),
        w=w, scales=scales)
