"""MLA's per-head products for every head of a device's own rows, from the fp8 blocks of kv_b
and o_proj, in Pallas TPU kernels: queries into the latent space (W_uk, `absorb_queries`)
and outputs out of it to hidden space (W_uv then o_proj, summed over the heads,
`project_output`). Twins of `reference.absorb_queries` and `reference.project_output`.

Why. A device that attends every head of its own rows (the runtime's row_attention
"weights": q_b, kv_b and o_proj gathered whole, `WeightShards.whole_heads`) ran these in
XLA:TPU passes: kv_b dequantised whole through an f32 broadcast of its scales (0.11 ms a
GLM-5.2 layer), q_nope sliced and laid out again for W_uk, the attention's f32 output cast to
bf16 and W_uv's product laid out again for o_proj: 0.58 ms a layer of merge for a 16K-token
chunk's 1,024 rows a device, where the products alone are 0.19 ms of the MXU's time.
kernels/latent_heads.py does the same products for a decode step's few heads, holding the
whole kv_b block in VMEM; every head's is 15 MB of fp8, so here the grid walks the heads and
each step takes one head's blocks.

Numerics are those of `attention_inputs.mla_inputs` / `mla.mla_output` with o_proj through
kernels/scaled_linear.py: each fp8 value times its block's scale, rounded to bf16; bf16
inputs and f32 sums; each head's product with kv_b rounded to bf16 (XLA's bf16 matmul rounds
it so); the sum over heads kept in f32.

kv_b's rows per head are [W_uk (nope rows) | W_uv (v rows)]; its scale runs cross heads
(GLM-5.2: 448 rows a head, runs of 128), so a head's rows are dequantised in pieces of
gcd(run, nope + v) rows, each inside one run: whole fp8 sublane tiles (`supports_*`). A
head's kv_b block comes whole (nope + v rows), as its part alone is no whole number of
blocks.

absorb_queries
  Grid:   (H,) over the heads, in order.
  Blocks: q f32[R, Dq] per head (of q_b's output [R, H Dq]; q_nope its first nope lanes);
          kv_b f8[nope + v, Dv] per head; scales flat in SMEM; output bf16[1, R, Dv] per
          head of [H, R, Dv]. Scratch: W_uk bf16[nope, Dv].
  flops = 2 R H nope Dv;  bytes = R H Dq 4 + H (nope + v) Dv w + scales + H R Dv 2
absorb_queries with `rope` (each row's rotary factors, f32[R, 2 LANES], `rope_factors`): the
  attention's query rows themselves, bf16[R, H, Dv + LANES], [q_nope . W_uk | q_pe, zeros]
  each, in the layout the sparse prefill kernel reads (heads in sublanes). So no pass of
  XLA:TPU's lays the heads out again and joins the rope part, none slices, rotates and pads
  it (at 1,024 rows a device that also wrote copies), and none lays the rows out for the
  attention: written head by head, [R, H (Dv + LANES)],
  XLA:TPU relaid them on the SparseCores, in the queue of the MLP's collectives, which then
  waited on it (docs/notes/2026-12-06-32k-chunks.md, "Query rows in the attention's layout").
  Grid:   (H / G, R' / tr): groups of G = HEAD_GROUP heads (one bf16 sublane tile of the
          heads axis), outer, so a group's W_uk is dequantised once; tiles of tr rows
          (`_row_tile`; R padded to R', whole tiles).
  Blocks: q f32[tr, G Dq]; kv_b f8[G (nope + v), Dv]; factors f32[tr, 2 LANES]; output
          bf16[tr, G, Dv + LANES]. Scratch: W_uk bf16[G, nope, Dv]; each head's rows
          bf16[G, tr, Dv + LANES].
  Each head's product and its rope part go to its rows in scratch (the rope rotated in VMEM
  from the head's own q lanes: each lane of the rope's lane tile t times its cos, plus its
  partner, the other of its pair or of its halves, a lane roll of t, times its signed sin,
  rolled to the tile's first lanes, zero past the rope: the products and sums of
  `ops.rope`, in f32, rounded to bf16 once). Then, per 16 rows, the G x 16 rows (head,
  row) times a 0/1 permutation on the MXU give them (row, head), the output tile as it lies.
  flops = 2 R' H (nope Dv + 16 G (Dv + LANES))   (the product; the permutation)
  bytes = R' H Dq 4 + H (nope + v) Dv w + scales + R' 2 LANES 4 + R' H (Dv + LANES) 2
project_output
  Grid:   (H,) over the heads, in order.
  Blocks: o_lat f32[R, Dv] per head, copied by the kernel out of [R, H, Dv] (a head's rows
          are strided there, which no block can be), the next head's while this one's
          runs; kv_b as above; o_proj f8[hidden, v] per head (of [hidden, H v]); both
          weights' scales flat in SMEM; output f32[R, hidden] left in HBM and written once,
          from the VMEM sum, after the last head. Scratch: W_uv bf16[v, Dv], o_proj's
          columns bf16[hidden, v], the sum f32[R, hidden], o_lat's two slots.
  flops = 2 R H v (Dv + hidden)
  bytes = R H Dv 4 + H (nope + v) Dv w + hidden H v w + scales + R hidden 4
VMEM: each call's `*_cost`, with Mosaic's temporaries (rows cast to bf16, a head's product,
one column group's product of o_proj) counted. The dequantisation (~3 VPU operations a
weight value) is left out of the estimates, as in scaled_linear.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.vmem import LANES, VMEM_BUDGET_BYTES, tiled_bytes

__all__ = ["absorb_queries", "project_output", "supports_absorb", "supports_output",
           "absorb_cost", "output_cost", "rope_factors", "MAX_ROWS", "COLUMNS", "HEAD_GROUP"]

MAX_ROWS = 1024          # rows a call takes at most: project_output's f32 sum stays in VMEM
COLUMNS = 1024           # o_proj's product is summed this many output columns at a time
FP8_SUBLANES = 32
BF16_SUBLANES = 16       # rows of bf16 in one sublane tile
HEAD_GROUP = BF16_SUBLANES   # heads a query-rows step writes: one bf16 tile of [R, H, .]'s heads
ROW_TILE = 256           # rows a query-rows step takes at most


def _kv_b_fits(heads: int, nope: int, kv_b_shape: tuple[int, ...],
               kv_b_scales: tuple[int, ...]) -> bool:
    """kv_b [H (nope + v), Dv] with 2-D scales: whole lane runs along Dv, and pieces of
    gcd(run, nope + v) rows that are whole fp8 sublane tiles (nope too)."""
    if len(kv_b_shape) != 2 or len(kv_b_scales) != 2:
        return False
    n, dv = kv_b_shape
    if n % heads or n // heads <= nope or n % kv_b_scales[0] or dv % kv_b_scales[1]:
        return False
    piece = math.gcd(n // kv_b_scales[0], n // heads)
    return (piece % FP8_SUBLANES == 0 and nope % piece == 0
            and (dv // kv_b_scales[1]) % LANES == 0)


def absorb_cost(rows: int, heads: int, nope: int, v: int, dq: int, dv: int, kv_b_scales: int,
                w_itemsize: int = 1, rope: bool = False) -> dict:
    """HBM bytes, flops and VMEM bytes of one `absorb_queries` call (module docstring); `rope`:
    the query rows, each head's rope part rotated beside its product (LANES lanes), written
    [R, H, Dv + LANES] by groups of HEAD_GROUP heads and `_row_tile` rows."""
    if rope:
        return _query_rows_cost(rows, heads, nope, v, dq, dv, kv_b_scales, w_itemsize)
    vmem = (2 * (tiled_bytes((rows, dq), 4) + tiled_bytes((nope + v, dv), w_itemsize)
                 + tiled_bytes((rows, dv), 2))
            + tiled_bytes((nope, dv), 2) + tiled_bytes((rows, nope), 2)
            + tiled_bytes((rows, dv), 4))
    return {"flops": 2 * rows * heads * nope * dv,
            "bytes": (rows * heads * dq * 4 + heads * (nope + v) * dv * w_itemsize
                      + kv_b_scales * 4 + heads * rows * dv * 2),
            "vmem_bytes": vmem}


def _row_tile(rows: int) -> int:
    """Rows a query-rows step takes: ROW_TILE, or all of them in whole bf16 tiles if fewer."""
    return min(ROW_TILE, -(-rows // BF16_SUBLANES) * BF16_SUBLANES)


def _query_rows_cost(rows: int, heads: int, nope: int, v: int, dq: int, dv: int,
                     kv_b_scales: int, w_itemsize: int) -> dict:
    """`absorb_cost` with rope: rows padded to whole row tiles; the flops count each head's
    product and the 0/1 matmuls that move the heads into sublanes (`_query_rows_kernel`)."""
    group, tile, width = HEAD_GROUP, _row_tile(rows), dv + LANES
    padded = -(-rows // tile) * tile
    swap = group * BF16_SUBLANES                                  # rows a swap matmul moves
    vmem = (2 * (tiled_bytes((tile, group * dq), 4)
                 + tiled_bytes((group * (nope + v), dv), w_itemsize)
                 + tiled_bytes((tile, 2 * LANES), 4) + tiled_bytes((tile, group, width), 2))
            + tiled_bytes((group, nope, dv), 2) + tiled_bytes((group, tile, width), 2)
            + tiled_bytes((tile, nope), 2) + tiled_bytes((tile, dv), 4)
            + 3 * tiled_bytes((tile, LANES), 4)
            + 2 * tiled_bytes((swap, swap), 4) + tiled_bytes((swap, width), 2)
            + tiled_bytes((swap, width), 4))
    return {"flops": 2 * padded * heads * (nope * dv + swap * width),
            "bytes": (padded * heads * dq * 4 + heads * (nope + v) * dv * w_itemsize
                      + kv_b_scales * 4 + padded * 2 * LANES * 4 + padded * heads * width * 2),
            "vmem_bytes": vmem}


def output_cost(rows: int, heads: int, nope: int, v: int, dv: int, hidden: int,
                kv_b_scales: int, o_proj_scales: int, w_itemsize: int = 1) -> dict:
    """HBM bytes, flops and VMEM bytes of one `project_output` call (module docstring)."""
    vmem = (2 * (tiled_bytes((rows, dv), 4) + tiled_bytes((nope + v, dv), w_itemsize)
                 + tiled_bytes((hidden, v), w_itemsize))
            + tiled_bytes((v, dv), 2) + tiled_bytes((hidden, v), 2)
            + tiled_bytes((rows, hidden), 4) + tiled_bytes((rows, dv), 2)
            + tiled_bytes((rows, v), 4) + tiled_bytes((rows, v), 2)
            + tiled_bytes((rows, min(COLUMNS, hidden)), 4))
    return {"flops": 2 * rows * heads * v * (dv + hidden),
            "bytes": (rows * heads * dv * 4 + heads * (nope + v) * dv * w_itemsize
                      + hidden * heads * v * w_itemsize + (kv_b_scales + o_proj_scales) * 4
                      + rows * hidden * 4),
            "vmem_bytes": vmem}


def supports_absorb(rows: int, heads: int, nope: int, dq: int, kv_b_shape: tuple[int, ...],
                    kv_b_scales: tuple[int, ...], rope: bool = False) -> bool:
    """Whether a TPU compiles `absorb_queries` for `rows` rows (at most MAX_ROWS) of `heads`
    heads of Dq lanes (whole lane tiles) with this kv_b, with each head's rope part (its
    lanes past nope, all in one lane tile) rotated beside its product where `rope` (then
    whole groups of HEAD_GROUP heads), within the VMEM budget."""
    if not (0 < rows <= MAX_ROWS and dq % LANES == 0 and dq >= nope
            and _kv_b_fits(heads, nope, kv_b_shape, kv_b_scales)):
        return False
    if rope and not (dq > nope and nope % LANES + dq - nope <= LANES
                     and heads % HEAD_GROUP == 0):
        return False
    n, dv = kv_b_shape
    figures = absorb_cost(rows, heads, nope, n // heads - nope, dq, dv, math.prod(kv_b_scales),
                          rope=rope)
    return figures["vmem_bytes"] <= VMEM_BUDGET_BYTES


def rope_factors(cos: jax.Array, sin: jax.Array, *, nope: int, interleaved: bool) -> jax.Array:
    """The rotary factors `absorb_queries` takes: cos, sin f32[R, rope/2] (`forward.
    rope_cos_sin`) -> f32[R, 2 LANES], [C | S] laid on the lane tile of a head's q that holds
    its rope part (lanes nope to nope + rope): lane j's cos, and its partner's sin signed as
    `ops.rope` signs it (-sin for the first of a pair or of the halves, +sin for the
    second); zero off the rope's lanes."""
    rows, half = cos.shape
    if interleaved:                                        # pairs (2i, 2i + 1)
        c = jnp.repeat(cos, 2, axis=-1)
        s = jnp.stack([-sin, sin], axis=-1).reshape(rows, 2 * half)
    else:                                                  # halves (i, i + rope/2)
        c = jnp.concatenate([cos, cos], axis=-1)
        s = jnp.concatenate([-sin, sin], axis=-1)
    at = nope % LANES
    lanes = ((0, 0), (at, LANES - at - 2 * half))
    return jnp.concatenate([jnp.pad(c, lanes), jnp.pad(s, lanes)], axis=-1).astype(jnp.float32)


def _rotated_rope(q_ref, factors_ref, *, first: int, nope: int, rope: int,
                  interleaved: bool) -> jax.Array:
    """f32[R, LANES]: the rope part of the head whose q starts at lane `first` of q_ref (its
    lanes nope to nope + rope) rotated by the factors, moved to the first lanes, zero past
    them (the module docstring)."""
    lanes, at = LANES, nope % LANES
    t = q_ref[:, pl.ds(first + nope - at, lanes)]                          # the rope's tile
    c, s = factors_ref[:, pl.ds(0, lanes)], factors_ref[:, pl.ds(lanes, lanes)]
    lane = jax.lax.broadcasted_iota(jnp.int32, t.shape, 1)
    # pltpu.roll is jnp.roll's: roll(t, k)[j] = t[j - k], so lanes - k brings t[j + k] to j
    if interleaved:
        first_of_pair = (lane - at) % 2 == 0
        partner = jnp.where(first_of_pair, pltpu.roll(t, lanes - 1, 1), pltpu.roll(t, 1, 1))
    else:
        half = rope // 2
        first_half = lane < at + half
        partner = jnp.where(first_half, pltpu.roll(t, lanes - half, 1), pltpu.roll(t, half, 1))
    rotated = jnp.where((lane >= at) & (lane < at + rope), t * c + partner * s, 0.0)
    return pltpu.roll(rotated, (lanes - at) % lanes, 1) if at else rotated


def supports_output(rows: int, heads: int, nope: int, kv_b_shape: tuple[int, ...],
                    kv_b_scales: tuple[int, ...], o_proj_shape: tuple[int, ...],
                    o_proj_scales: tuple[int, ...]) -> bool:
    """Whether a TPU compiles `project_output` for `rows` rows (at most MAX_ROWS) of `heads`
    heads: kv_b as `absorb_queries` takes it, o_proj [hidden, H v] with 2-D block scales of
    whole fp8 sublane and lane runs, a head's columns whole runs, and the buffers within the
    VMEM budget."""
    if (not 0 < rows <= MAX_ROWS or len(o_proj_shape) != 2 or len(o_proj_scales) != 2
            or not _kv_b_fits(heads, nope, kv_b_shape, kv_b_scales)):
        return False
    (n, dv), (hidden, hv) = kv_b_shape, o_proj_shape
    v = n // heads - nope
    if hv != heads * v or hidden % o_proj_scales[0] or hv % o_proj_scales[1]:
        return False
    o_ga, o_gb = hidden // o_proj_scales[0], hv // o_proj_scales[1]
    figures = output_cost(rows, heads, nope, v, dv, hidden, math.prod(kv_b_scales),
                          math.prod(o_proj_scales))
    return (o_ga % FP8_SUBLANES == 0 and o_gb % LANES == 0 and v % o_gb == 0
            and hidden % min(COLUMNS, hidden) == 0
            and figures["vmem_bytes"] <= VMEM_BUDGET_BYTES)


def _head_rows(kv_b_ref, s_ref, dst_ref, *, head, first: int, per_head: int, run: int,
               gb: int) -> None:
    """dst bf16[n, Dv] = rows [first, first + n) of this head's kv_b block f8[per_head, Dv],
    times their scales (s_ref: kv_b's, flat), in pieces that each lie inside one scale run."""
    n, dv = dst_ref.shape
    piece, k_runs = math.gcd(run, per_head), dv // gb

    def one(i, carry):
        p, kr = i // k_runs, i % k_runs
        row = first + p * piece
        scale = s_ref[((head * per_head + row) // run) * k_runs + kr]
        lanes = pl.ds(pl.multiple_of(kr * gb, gb), gb)
        block = kv_b_ref[pl.ds(pl.multiple_of(row, piece), piece), lanes]
        dst_ref[pl.ds(pl.multiple_of(p * piece, piece), piece), lanes] = (
            block.astype(jnp.float32) * scale).astype(jnp.bfloat16)
        return carry

    jax.lax.fori_loop(0, (n // piece) * k_runs, one, 0)


def _absorb_kernel(q_ref,       # [R, Dq] f32: this head's queries, q_nope its first lanes
                   kv_b_ref,    # [nope + v, Dv] fp8: this head's kv_b rows
                   s_ref,       # f32 SMEM: kv_b's scales, flat, row-major
                   out_ref,     # [1, R, Dv] bf16
                   w_uk_ref,    # [nope, Dv] bf16 scratch
                   *, run: int, gb: int):
    nope = w_uk_ref.shape[0]
    _head_rows(kv_b_ref, s_ref, w_uk_ref, head=pl.program_id(0), first=0,
               per_head=kv_b_ref.shape[0], run=run, gb=gb)
    q_nope = q_ref[:, pl.ds(0, nope)].astype(jnp.bfloat16)                 # [R, nope]
    out_ref[0] = jnp.dot(q_nope, w_uk_ref[...],
                         preferred_element_type=jnp.float32).astype(out_ref.dtype)


def _query_rows_kernel(q_ref,        # [tr, G Dq] f32: the group's heads of tr rows
                       kv_b_ref,     # [G (nope + v), Dv] fp8: the group's kv_b rows
                       s_ref,        # f32 SMEM: kv_b's scales, flat, row-major
                       factors_ref,  # [tr, 2 LANES] f32: the rows' rotary factors
                       out_ref,      # [tr, G, Dv + LANES] bf16: the rows, heads in sublanes
                       w_uk_ref,     # [G, nope, Dv] bf16 scratch: the group's W_uk
                       heads_ref,    # [G, tr, Dv + LANES] bf16 scratch: each head's rows
                       *, run: int, gb: int, interleaved: bool):
    group, nope, dv = w_uk_ref.shape
    per_head, dq = kv_b_ref.shape[0] // group, q_ref.shape[1] // group

    @pl.when(pl.program_id(1) == 0)                 # W_uk once for all the group's row tiles
    def _():
        for j in range(group):
            _head_rows(kv_b_ref.at[pl.ds(j * per_head, per_head)], s_ref, w_uk_ref.at[j],
                       head=pl.program_id(0) * group + j, first=0, per_head=per_head,
                       run=run, gb=gb)

    for j in range(group):
        q_nope = q_ref[:, pl.ds(j * dq, nope)].astype(jnp.bfloat16)
        heads_ref[j, :, pl.ds(0, dv)] = jnp.dot(
            q_nope, w_uk_ref[j], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        heads_ref[j, :, pl.ds(dv, LANES)] = _rotated_rope(
            q_ref, factors_ref, first=j * dq, nope=nope, rope=dq - nope,
            interleaved=interleaved).astype(jnp.bfloat16)
    _heads_into_sublanes(heads_ref, out_ref)


def _heads_into_sublanes(heads_ref, out_ref) -> None:
    """out_ref[r, j] = heads_ref[j, r] ([G, tr, W] -> [tr, G, W], bf16), by 0/1 matmuls on
    the MXU: per tile of 16 rows, the G x 16 rows (head, row) as they lie, times the
    permutation that orders them (row, head). Each output is one input times 1 plus zeros,
    exact in the f32 sum (a non-finite input would spread over its tile; q rows are finite).
    Stored into its sublanes directly, each head's row would take a masked store a lane
    tile; left to XLA:TPU, the relayout is a SparseCore pass between the kernels
    (docs/notes/2026-12-06-32k-chunks.md, "Query rows in the attention's layout")."""
    group, tile_rows, width = heads_ref.shape
    n = group * BF16_SUBLANES
    out_row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)            # (row r, head j)
    in_row = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)             # (head j, row r)
    swap = (in_row == (out_row % group) * BF16_SUBLANES + out_row // group)
    swap = swap.astype(jnp.bfloat16)

    def tile(t, carry):
        r0 = pl.multiple_of(t * BF16_SUBLANES, BF16_SUBLANES)
        rows = heads_ref[:, pl.ds(r0, BF16_SUBLANES), :].reshape(n, width)
        moved = jnp.dot(swap, rows, preferred_element_type=jnp.float32)
        out_ref[pl.ds(r0, BF16_SUBLANES)] = moved.astype(out_ref.dtype).reshape(
            BF16_SUBLANES, group, width)
        return carry

    jax.lax.fori_loop(0, tile_rows // BF16_SUBLANES, tile, 0)


def _output_kernel(o_hbm_ref,   # [R, H, Dv] f32 in HBM: every head's latent output
                   kv_b_ref,    # [nope + v, Dv] fp8: this head's kv_b rows [W_uk | W_uv]
                   o_proj_ref,  # [hidden, v] fp8: this head's o_proj columns
                   kv_b_s_ref,  # f32 SMEM: kv_b's scales, flat, row-major
                   o_proj_s_ref,  # f32 SMEM: o_proj's scales, flat, row-major
                   out_ref,     # [R, hidden] f32, in HBM
                   w_uv_ref,    # [v, Dv] bf16 scratch
                   w_o_ref,     # [hidden, v] bf16 scratch
                   sum_ref,     # [R, hidden] f32 scratch: the sum over the heads so far
                   o_ref,       # [2, R, Dv] f32 scratch: this head's o_lat, and the next's
                   sems,        # DMA semaphores: o_lat's two slots, the final copy
                   *, nope: int, run: int, gb: int, o_ga: int, o_gb: int):
    head, heads = pl.program_id(0), pl.num_programs(0)
    v, hidden = w_uv_ref.shape[0], w_o_ref.shape[0]

    def o_lat_of(h, slot):           # head h's [R, Dv], a strided copy out of [R, H, Dv]
        return pltpu.make_async_copy(o_hbm_ref.at[:, h, :], o_ref.at[slot], sems.at[slot])

    @pl.when(head == 0)
    def _():
        o_lat_of(0, 0).start()

    slot = head % 2

    @pl.when(head + 1 < heads)
    def _():
        o_lat_of(head + 1, 1 - slot).start()

    _head_rows(kv_b_ref, kv_b_s_ref, w_uv_ref, head=head, first=nope, per_head=nope + v,
               run=run, gb=gb)
    per_head = v // o_gb

    def w_o_run(i, carry):           # rows run nr, columns run cr of the head's columns
        nr, cr = i // per_head, i % per_head
        scale = o_proj_s_ref[(nr * heads + head) * per_head + cr]
        r0, c0 = pl.multiple_of(nr * o_ga, o_ga), pl.multiple_of(cr * o_gb, o_gb)
        block = o_proj_ref[pl.ds(r0, o_ga), pl.ds(c0, o_gb)].astype(jnp.float32)
        w_o_ref[pl.ds(r0, o_ga), pl.ds(c0, o_gb)] = (block * scale).astype(jnp.bfloat16)
        return carry

    jax.lax.fori_loop(0, (hidden // o_ga) * per_head, w_o_run, 0)
    o_lat_of(head, slot).wait()
    o_v = jax.lax.dot_general(o_ref[slot].astype(jnp.bfloat16), w_uv_ref[...],
                              (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    @pl.when(head == 0)
    def _():
        sum_ref[...] = jnp.zeros_like(sum_ref)

    columns = min(COLUMNS, hidden)
    for c0 in range(0, hidden, columns):       # one column group's product at a time
        sum_ref[:, pl.ds(c0, columns)] += jax.lax.dot_general(
            o_v, w_o_ref[pl.ds(c0, columns), :], (((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32)

    @pl.when(head == heads - 1)
    def _():
        copy = pltpu.make_async_copy(sum_ref, out_ref, sems.at[2])
        copy.start()
        copy.wait()


def _misfit(what: str, shapes: dict, nope: int) -> ValueError:
    named = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
    return ValueError(f"{what}: {named} with nope={nope} do not fit together or the kernel")


@functools.partial(jax.jit, static_argnames=("heads", "nope", "interleaved", "interpret"))
def absorb_queries(q: jax.Array, kv_b: jax.Array, kv_b_scales: jax.Array, *, heads: int,
                   nope: int, rope: jax.Array | None = None, interleaved: bool = True,
                   interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.absorb_queries` for every head of R rows.

    q:           f32[R, H Dq]          q_b's output as it comes, each head's q_nope its first
                                       nope lanes, its rope part the rest
    kv_b:        f8[H (nope + v), Dv]  per head [W_uk (nope rows) | W_uv (v rows)]
    kv_b_scales: f32[H (nope + v) / ga, Dv / gb]
    rope:        f32[R, 2 LANES] or None  each row's rotary factors (`rope_factors`);
                 interleaved: the rope's pairs (True, MLA's) or halves rotate together
    returns:     bf16[H, R, Dv]        q_nope . W_uk per head; with rope
                 bf16[R, H, Dv + LANES]  the attention's query rows, [q_nope . W_uk | its
                                       rope part rotated, zeros to LANES] each
    """
    rows, width = q.shape
    n, dv = kv_b.shape
    if (width % heads or not supports_absorb(rows, heads, nope, width // heads, kv_b.shape,
                                             kv_b_scales.shape, rope is not None)
            or (rope is not None and rope.shape != (rows, 2 * LANES))):
        raise _misfit("absorb_queries", {"q": q.shape, "kv_b": kv_b.shape,
                                         "scales": kv_b_scales.shape,
                                         "rope": None if rope is None else rope.shape}, nope)
    dq = width // heads
    figures = absorb_cost(rows, heads, nope, n // heads - nope, dq, dv, kv_b_scales.size,
                          kv_b.dtype.itemsize, rope is not None)
    run, gb = n // kv_b_scales.shape[0], dv // kv_b_scales.shape[1]
    q, scales = q.astype(jnp.float32), kv_b_scales.astype(jnp.float32).reshape(-1)
    if rope is not None:
        return _query_rows(q, kv_b, scales, rope.astype(jnp.float32), heads=heads, nope=nope,
                           run=run, gb=gb, interleaved=interleaved, figures=figures,
                           interpret=interpret)
    return pl.pallas_call(
        functools.partial(_absorb_kernel, run=run, gb=gb),
        grid=(heads,),
        in_specs=[pl.BlockSpec((rows, dq), lambda h: (0, h)),
                  pl.BlockSpec((n // heads, dv), lambda h: (h, 0)),
                  pl.BlockSpec(memory_space=pltpu.SMEM)],
        out_specs=pl.BlockSpec((1, rows, dv), lambda h: (h, 0, 0)),
        scratch_shapes=[pltpu.VMEM((nope, dv), jnp.bfloat16)],
        out_shape=jax.ShapeDtypeStruct((heads, rows, dv), jnp.bfloat16),
        **call_options("absorb_queries", figures, ("arbitrary",), interpret),
    )(q, kv_b, scales)


def _query_rows(q, kv_b, scales, factors, *, heads: int, nope: int, run: int, gb: int,
                interleaved: bool, figures: dict, interpret: bool) -> jax.Array:
    """`absorb_queries` with rope: q f32[R, H Dq], factors f32[R, 2 LANES] -> bf16[R, H,
    Dv + LANES], by steps of HEAD_GROUP heads and `_row_tile` rows (R padded to whole
    tiles), the heads outer so a group's W_uk is dequantised once."""
    rows, n, dv = q.shape[0], *kv_b.shape
    group, tile, width = HEAD_GROUP, _row_tile(rows), dv + LANES
    padded = -(-rows // tile) * tile
    q, factors = (jnp.pad(x, ((0, padded - rows), (0, 0))) for x in (q, factors))
    dq = q.shape[1] // heads
    out = pl.pallas_call(
        functools.partial(_query_rows_kernel, run=run, gb=gb, interleaved=interleaved),
        grid=(heads // group, padded // tile),
        in_specs=[pl.BlockSpec((tile, group * dq), lambda g, t: (t, g)),
                  pl.BlockSpec((group * n // heads, dv), lambda g, t: (g, 0)),
                  pl.BlockSpec(memory_space=pltpu.SMEM),
                  pl.BlockSpec((tile, 2 * LANES), lambda g, t: (t, 0))],
        out_specs=pl.BlockSpec((tile, group, width), lambda g, t: (t, g, 0)),
        scratch_shapes=[pltpu.VMEM((group, nope, dv), jnp.bfloat16),
                        pltpu.VMEM((group, tile, width), jnp.bfloat16)],
        out_shape=jax.ShapeDtypeStruct((padded, heads, width), jnp.bfloat16),
        **call_options("absorb_queries", figures, ("arbitrary", "arbitrary"), interpret),
    )(q, kv_b, scales, factors)
    return out[:rows]


@functools.partial(jax.jit, static_argnames=("nope", "interpret"))
def project_output(o_lat: jax.Array, kv_b: jax.Array, kv_b_scales: jax.Array,
                   o_proj: jax.Array, o_proj_scales: jax.Array, *, nope: int,
                   interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.project_output`.

    o_lat:         f[R, H, Dv]           every head's latent attention output of R rows
    kv_b:          f8[H (nope + v), Dv]  per head [W_uk (nope rows) | W_uv (v rows)]
    kv_b_scales:   f32[H (nope + v) / ga, Dv / gb]
    o_proj:        f8[hidden, H v]       the checkpoint's [out, in] layout
    o_proj_scales: f32[hidden / ga', H v / gb']
    returns:       f32[R, hidden]
    """
    rows, heads, dv = o_lat.shape
    hidden, hv = o_proj.shape
    if not supports_output(rows, heads, nope, kv_b.shape, kv_b_scales.shape, o_proj.shape,
                           o_proj_scales.shape) or kv_b.shape[1] != dv:
        raise _misfit("project_output", {"o_lat": o_lat.shape, "kv_b": kv_b.shape,
                                         "kv_b scales": kv_b_scales.shape,
                                         "o_proj": o_proj.shape,
                                         "o_proj scales": o_proj_scales.shape}, nope)
    v = hv // heads
    figures = output_cost(rows, heads, nope, v, dv, hidden, kv_b_scales.size,
                          o_proj_scales.size, kv_b.dtype.itemsize)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.pallas_call(
        functools.partial(_output_kernel, nope=nope, run=kv_b.shape[0] // kv_b_scales.shape[0],
                          gb=dv // kv_b_scales.shape[1], o_ga=hidden // o_proj_scales.shape[0],
                          o_gb=hv // o_proj_scales.shape[1]),
        grid=(heads,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec((nope + v, dv), lambda h: (h, 0)),
                  pl.BlockSpec((hidden, v), lambda h: (0, h)),
                  smem, smem],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((v, dv), jnp.bfloat16), pltpu.VMEM((hidden, v), jnp.bfloat16),
                        pltpu.VMEM((rows, hidden), jnp.float32),
                        pltpu.VMEM((2, rows, dv), jnp.float32), pltpu.SemaphoreType.DMA((3,))],
        out_shape=jax.ShapeDtypeStruct((rows, hidden), jnp.float32),
        **call_options("project_output", figures, ("arbitrary",), interpret),
    )(o_lat.astype(jnp.float32), kv_b, o_proj, kv_b_scales.astype(jnp.float32).reshape(-1),
      o_proj_scales.astype(jnp.float32).reshape(-1))
