"""Grouped matmul straight from block-scaled fp8 expert weights: the Pallas TPU kernel of
`reference.grouped_matmul`. Rows sorted by expert run through their own expert's weights, and
only experts that have rows are read from HBM, as fp8.

Why. The XLA path of a MoE layer (`jax.lax.ragged_dot`) needs its weights in bf16, so each step
writes and reads a dequantised copy of every local expert; a decode step of a few tokens, whose
rows touch a few experts, pays for all of them. Here the weights stay fp8 in HBM and each
expert's blocks are dequantised in VMEM, block by block, as they are used.

Visits. rows [N, K] come sorted by group (expert), `group_sizes` [E] rows each, cut into m-tiles
of tm rows. A visit is one (group, m-tile) pair where the group has rows in the tile; visits go
by group, then tile, so consecutive visits share either the group (its weights stay in VMEM) or
the tile (its rows stay): each weight block and each row tile crosses HBM once per column tile.
There are at most m_tiles + min(E, N) - 1 visits (`visits_bound`); the grid runs that many, and
the visits past the call's count repeat the last real one's block indices, so they move nothing
and compute nothing. A visit writes only its group's rows of the output tile, and a tile's first
visit clears the rest; tiles past every group get one zeroing visit each, so rows past the
groups come out zero.

Gated. With `up` the call takes an expert's gate and up weights together and returns
silu(rows . gate) * (rows . up): each row tile is read once for both, and the two [tm, tn]
products are combined in VMEM (a MoE layer's first half in one call; its [T k, hidden] rows
are its largest operand).

Scales. A weight [K, M] has one f32 scale per run of ga x gb values (`scale_runs` in
cp_runtime.weights.format): the kernel multiplies x[:, run] . w[run, cols] (a bf16 matmul with f32
accumulation; fp8 values are exact in bf16) by its scale, summed over the K runs in f32.
fp8 rows (`row_scales`, one f32 scale a row: cp_runtime.kernels.fp8_rows) are read at half the
bytes of bf16 ones. `row_weights` (one f32 a row: a MoE's routing weights) multiply each row's
result as it is written, so the gated call hands the down projection its weighted inputs in
bf16 and no pass of XLA's scales and casts them in between. A row's scale and weight travel
together, a row a lane: as rows 0 and 1 of one f32[8, N] array, read [8, tm] a tile and
turned to columns in VMEM (`factor_lanes`, where tm is whole lane tiles). XLA:TPU lays an
[N, F] array out a lane tile a row (512 bytes), and it made the [N, 2] of the two by a copy
from the lane-dense one it built (20 us a GLM-5.2 half-chunk); a decode step's few rows
(tm under a lane tile) still take them as one [tm, F] block. With fp8 weights the MXU
multiplies them as they are (`fp8_mxu`; the call's name then ends in kernels/costs.py's
FP8_MXU_SUFFIX), else they are widened to bf16 in VMEM; a row's scale multiplies each of its
sums once.

Grid:   (M / tn column tiles, V visits); column tiles parallel, visits in order.
Blocks: the visit plan scalar prefetch (SMEM), made by a second, scalar-core kernel
        (`plan_visits`; `visit_plan` is its XLA twin);
        rows bf16[tm, K] (or fp8) by the visit's tile, with each row's factors f32[8, tm]
        (rows 0 to F - 1 of [8, N]; F = 0-2: the fp8 rows' scales, the row weights; [tm, F]
        where tm is under a lane tile), weight
        f8[K, tn] by its group (VMEM), scales f32[K / ga, tn / gb, E] of every group by the
        column tile (SMEM: fetched once a column tile), output [tm, tn] by its tile (f32,
        or bf16 with `out_dtype`: each row's f32 sum rounded once, as the MoE's down
        projection writes its [T k, hidden] products). The
        scales go in with the experts last: stored [E, K / ga, M / gb], a device's
        [256, 48, 1] (GLM-5.2's gate and up on 16 devices) is laid out by XLA:TPU with the
        experts innermost, and XLA copied it into the kernel's row-major layout before every
        call (10 us a MoE layer in the compiler's figures); the transposed view is that
        layout as it lies.
VMEM:   2 * (tm * K * r + W * K * tn * w + tm * tn * o)    (double-buffered blocks; r, o the
                                                           rows' and output's bytes a value)
        + W * tm * tn * 4                                  (the accumulators)
Per call (upper bound: every visit a whole tile; min(E, N) experts read; W weights, 2 gated):
        flops = 2 * V * tm * K * M * W
        bytes = (M / tn) * N' * (K * r + 4 F')          (F' = 8 factor rows where F > 0,
                                                        or F a row: scale, weight)
                + W * (min(E, N) * K * M * w + E * (K/ga) * (M/gb) * 4)
                + N' * M * o                            (N' = N padded to tm)
A grid step costs a fixed overhead the estimate leaves out (a few hundred ns on TPUs); the
grid has (M / tn) * V steps, about 500 for an 8K-token chunk of GLM-5.2, 8 for a decode step.
The plan kernel's estimate is its bytes (E + 3 V + E + 3 words); its scalar loop (E + V
iterations) is not estimated either.
On a TPU the scale runs must be whole lane tiles (ga, gb multiples of 128: `supports`); the
public fp8 checkpoints' 128 x 128 blocks are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.storage import cdiv
from cp_runtime.kernels.vmem import LANES, tiled_bytes

__all__ = ["grouped_matmul", "visit_plan", "plan_visits", "visits_bound", "row_tile",
           "column_tile", "supports", "cost", "factor_lanes", "FACTOR_ROWS"]

ROW_TILE = 256                  # rows per m-tile at most (`row_tile`)
ROW_ALIGN = 16                  # bf16 rows per sublane tile (fp8: 32, `row_tile`)
WEIGHT_BLOCK_BYTES = 2 << 20    # a weight block [K, tn] of at most this many bytes


def row_tile(num_rows: int, num_groups: int, row_itemsize: int = 2) -> int:
    """tm: about the rows a group has when the rows spread over every group they can reach (a
    power of two, ROW_ALIGN to ROW_TILE). Each visit computes a whole tile, so a tile much
    taller than a group wastes the MXU on masked rows: a decode step's 256 rows over 256
    experts would compute 256 x 256 rows in tiles of 256, 16 x 271 in tiles of 16. Fewer
    rows than a sublane tile are one tile of the next power of two (a block as tall as the
    array needs no padding: a B = 1 decode step's 8 rows go in as they are). A sublane tile
    holds ROW_ALIGN bf16 rows, twice as many fp8 ones (row_itemsize 1)."""
    align = ROW_ALIGN * 2 // row_itemsize
    if num_rows < align:
        return 1 << (max(num_rows, 1) - 1).bit_length()
    per_group = cdiv(max(num_rows, 1), max(min(num_groups, num_rows), 1))
    return min(ROW_TILE, max(align, 1 << (per_group - 1).bit_length()))


def column_tile(k: int, m: int, gb: int, itemsize: int) -> int:
    """tn: the widest run-aligned divisor of M whose weight block [K, tn] stays within
    WEIGHT_BLOCK_BYTES (the narrowest allowed when none does), of whole sublane tiles of scale
    runs: the scales' SMEM block [K / ga, tn / gb, E] takes tn / gb runs, which Mosaic
    accepts as a multiple of 8 or as all M / gb of them. (Taking any divisor, 256 of an
    expert's 512 columns held 2 of its 4 runs, which Mosaic refused: GLM-5.2's experts in 4
    groups on 16 devices, benchmarks/moe_layouts.py.)"""
    runs = m // gb
    allowed = [d for d in range(1, runs + 1) if runs % d == 0 and (d % 8 == 0 or d == runs)]
    fits = [d for d in allowed if k * d * gb * itemsize <= WEIGHT_BLOCK_BYTES]
    return (max(fits) if fits else min(allowed)) * gb


def visits_bound(num_rows: int, num_groups: int, tm: int) -> int:
    """Visits a call of `num_rows` rows over `num_groups` groups can make, at most."""
    return cdiv(num_rows, tm) + min(num_groups, num_rows) - 1


def supports(w_shape: tuple[int, ...], s_shape: tuple[int, ...]) -> bool:
    """Whether a TPU compiles the kernel for weights [E, K, M] with scales [E, K/ga, M/gb]: the
    scale runs must be whole 128-lane tiles."""
    ga, gb = w_shape[-2] // s_shape[-2], w_shape[-1] // s_shape[-1]
    return ga % LANES == 0 and gb % LANES == 0


def visit_plan(group_sizes: jax.Array, tm: int, m_tiles: int, num_visits: int):
    """The visits (module docstring) as scalar-prefetch arrays, in XLA (the reference of
    `plan_visits`, which the kernel uses): group, tile, fresh i32[V],
    bounds i32[E + 1] (group g's rows are [bounds[g], bounds[g + 1])), counts i32[2].

    Visits [0, counts[0]) compute; visits [counts[0], counts[1]) only zero the tiles no group
    reaches (rows past the groups come out zero, never stale VMEM); later ones repeat the last
    visit and do nothing. fresh: the visit is its tile's first, so it clears the rows its group
    does not write."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // tm
    spans = jnp.where(group_sizes > 0, (ends - 1) // tm - first + 1, 0)     # tiles per group
    done = jnp.cumsum(spans)                                                # visits through g
    real = done[-1]
    covered = cdiv(ends[-1], tm)                     # tiles holding some group's rows
    zeroing = real + (m_tiles - covered)
    v = jnp.arange(num_visits)
    rv = jnp.clip(v, 0, jnp.maximum(real - 1, 0))
    num_groups = group_sizes.shape[0]
    group = jnp.minimum(jnp.searchsorted(done, rv, side="right"), num_groups - 1)
    tile = jnp.clip(first[group] + rv - (done[group] - spans[group]), 0, m_tiles - 1)
    last_group = group[jnp.maximum(real - 1, 0)]
    extra = jnp.clip(v - real, 0, jnp.maximum(m_tiles - covered - 1, 0))
    past = v >= real
    group = jnp.where(past, last_group, group)
    tile = jnp.where(past, jnp.minimum(covered + extra, m_tiles - 1), tile)
    fresh = jnp.concatenate([jnp.ones((1,), bool), tile[1:] != tile[:-1]])
    bounds = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends])
    counts = jnp.stack([real, zeroing])
    return tuple(a.astype(jnp.int32) for a in (group, tile, fresh, bounds, counts))


def _plan_kernel(sizes_ref,                                              # [E] SMEM
                 group_ref, tile_ref, fresh_ref, bounds_ref, counts_ref,  # SMEM outputs
                 *, tile_shift: int, m_tiles: int):
    """`visit_plan` on the scalar core: one pass over the groups writes their visits in order,
    then the zeroing visits and the idle ones (which repeat the last visit's group)."""
    num_groups, num_visits = sizes_ref.shape[0], group_ref.shape[0]
    tm = 1 << tile_shift

    def emit(v, group, tile, prev_tile):
        group_ref[v] = group
        tile_ref[v] = tile
        fresh_ref[v] = (tile != prev_tile).astype(jnp.int32)

    def by_group(g, carry):
        end, v, prev_tile, last_group = carry
        size = sizes_ref[g]
        bounds_ref[g] = end
        first = jax.lax.shift_right_logical(end, tile_shift)
        last = jax.lax.shift_right_logical(end + size - 1, tile_shift)
        span = jnp.where(size > 0, last - first + 1, 0)

        def visit(i, c):
            emit(c[0] + i, g, first + i, c[1])
            return c[0], first + i

        _, prev_tile = jax.lax.fori_loop(0, span, visit, (v, prev_tile))
        return end + size, v + span, prev_tile, jnp.where(size > 0, g, last_group)

    zero = jnp.int32(0)
    total, real, prev_tile, last_group = jax.lax.fori_loop(
        0, num_groups, by_group, (zero, zero, jnp.int32(-1), jnp.int32(num_groups - 1)))
    bounds_ref[num_groups] = total
    covered = jax.lax.shift_right_logical(total + tm - 1, tile_shift)

    def after(v, prev_tile):
        extra = jnp.clip(v - real, 0, jnp.maximum(m_tiles - covered - 1, 0))
        tile = jnp.minimum(covered + extra, m_tiles - 1)
        emit(v, last_group, tile, prev_tile)
        return tile

    jax.lax.fori_loop(real, num_visits, after, prev_tile)
    counts_ref[0] = real
    counts_ref[1] = real + (m_tiles - covered)


def plan_visits(group_sizes: jax.Array, tm: int, m_tiles: int, num_visits: int, *,
                interpret: bool = False):
    """`visit_plan`'s arrays from a Pallas kernel on the scalar core: one small call instead
    of the ~15 small XLA ops (cumulative sums, a search, gathers) `visit_plan` takes, each
    ~1 us in XLA:TPU's estimate. tm a power of two (`row_tile`)."""
    if tm & (tm - 1):
        raise ValueError(f"row tile {tm} is not a power of two")
    e = group_sizes.shape[0]
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    figures = {"flops": 0, "bytes": 4 * (e + 3 * num_visits + e + 1 + 2), "vmem_bytes": 0}
    return tuple(pl.pallas_call(
        functools.partial(_plan_kernel, tile_shift=tm.bit_length() - 1, m_tiles=m_tiles),
        in_specs=[smem],
        out_specs=[smem] * 5,
        out_shape=[jax.ShapeDtypeStruct((n,), jnp.int32)
                   for n in (num_visits, num_visits, num_visits, e + 1, 2)],
        **call_options("expert_visit_plan", figures, (), interpret),
    )(group_sizes.astype(jnp.int32)))


def cost(num_rows: int, w_shape: tuple[int, ...], s_shape: tuple[int, ...],
         w_itemsize: int = 1, weights: int = 1, out_itemsize: int = 4,
         row_itemsize: int = 2, row_weights: bool = False) -> dict:
    """HBM bytes, flops and VMEM bytes of one call (upper bounds; module docstring), with
    `weights` weights of w_shape (2: gated), outputs of `out_itemsize` bytes, rows of
    `row_itemsize` (1: fp8 rows, each with its f32 scale) and, with `row_weights`, an f32
    weight a row."""
    e, k, m = w_shape
    ga, gb = k // s_shape[-2], m // s_shape[-1]
    tm = row_tile(num_rows, e, row_itemsize)
    rows = cdiv(num_rows, tm) * tm
    tn = column_tile(k, m, gb, w_itemsize)
    visits = visits_bound(rows, e, tm)
    read = min(e, num_rows) * k * m * w_itemsize + e * (k // ga) * (m // gb) * 4
    factors = (row_itemsize == 1) + row_weights
    # f32 words a row's factors take: FACTOR_ROWS sublanes where they come a row a lane
    factor_words = (FACTOR_ROWS if factor_lanes(tm) else factors) if factors else 0
    factor_block = (FACTOR_ROWS, tm) if factor_lanes(tm) else (tm, factors)
    row_bytes = k * row_itemsize + 4 * factor_words
    vmem = (2 * (tiled_bytes((tm, k), row_itemsize) + weights * tiled_bytes((k, tn), w_itemsize)
                 + tiled_bytes((tm, tn), out_itemsize)) + weights * tiled_bytes((tm, tn), 4)
            + (2 * tiled_bytes(factor_block, 4) if factors else 0))
    return {"flops": 2 * visits * tm * k * m * weights,
            "bytes": (m // tn) * rows * row_bytes + weights * read + rows * m * out_itemsize,
            "vmem_bytes": vmem,
            "transcendentals": visits * tm * m if weights > 1 else 0}


# The rows' factors go in as the first F of FACTOR_ROWS sublanes of an f32[FACTOR_ROWS, N]
# array, a row a lane, where a row tile is whole lane tiles (`factor_lanes`).
FACTOR_ROWS = 8


def factor_lanes(tm: int) -> bool:
    """Whether row tiles of tm rows take their factors a row a lane ([8, tm] blocks)."""
    return tm % LANES == 0


def fp8_mxu(rows_dtype, w_dtype) -> bool:
    """Whether the MXU multiplies rows and weights of these dtypes as they are, in fp8 (both
    e4m3: rows scaled by row, `row_scales`), rather than widened to bf16."""
    return jnp.dtype(rows_dtype) == jnp.dtype(w_dtype) == jnp.dtype(jnp.float8_e4m3fn)


def _kernel(group_ref, tile_ref, fresh_ref, bounds_ref, counts_ref,   # SMEM scalar prefetch
            rows_ref,                                        # [tm, K] bf16 or fp8
            *refs, scaled_rows: bool, weighted_rows: bool, lanes: bool):
    """refs: with scaled_rows or weighted_rows, the rows' factors f32 first, [8, tm] a row a
    lane (`lanes`) or [tm, F] (the scale first with scaled_rows, then the weight); per weight
    (one; two when gated) its block w [K, tn] fp8 (or any float) and scales
    [K / ga, tn / gb, E] f32 SMEM; then out [tm, tn] (f32 or bf16) and an accumulator
    [tm, tn] f32 scratch per weight."""
    factors_ref, refs = (refs[0], refs[1:]) if scaled_rows or weighted_rows else (None, refs)
    n_w = (len(refs) - 1) // 3
    weights, out_ref, accs = refs[:2 * n_w], refs[2 * n_w], refs[2 * n_w + 1:]
    v = pl.program_id(1)
    tm, tn = out_ref.shape
    k_runs, n_runs, _ = weights[1].shape
    ga, gb = weights[0].shape[0] // k_runs, tn // n_runs
    g = group_ref[v]

    @pl.when(v < counts_ref[0])
    def _():
        for acc_ref in accs:
            acc_ref[...] = jnp.zeros_like(acc_ref)

        def run(i, carry):
            kr, nr = i // n_runs, i % n_runs
            k0 = pl.multiple_of(kr * ga, ga)
            n0 = pl.multiple_of(nr * gb, gb)
            x = rows_ref[:, pl.ds(k0, ga)]
            for w_ref, s_ref, acc_ref in zip(weights[::2], weights[1::2], accs):
                w = w_ref[pl.ds(k0, ga), pl.ds(n0, gb)]
                if not fp8_mxu(x.dtype, w.dtype):      # else fp8 x fp8 products, exact in f32
                    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
                part = jnp.dot(x, w, preferred_element_type=jnp.float32)
                acc_ref[:, pl.ds(n0, gb)] += part * s_ref[kr, nr, g]
            return carry

        jax.lax.fori_loop(0, k_runs * n_runs, run, 0)
        if factors_ref is not None:                              # as columns [tm, F']
            factors = factors_ref[...].T if lanes else factors_ref[...]
        # A row's scale multiplies every product of its row, so it is applied once, to the
        # sums, before the gate's nonlinearity.
        sums = [acc[...] * factors[:, 0:1] if scaled_rows else acc[...] for acc in accs]
        result = sums[0] if n_w == 1 else jax.nn.silu(sums[0]) * sums[1]
        if weighted_rows:
            result = result * factors[:, scaled_rows:scaled_rows + 1]
        row = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        mine = (row >= bounds_ref[g]) & (row < bounds_ref[g + 1])
        before = jnp.where(fresh_ref[v] > 0, 0.0, out_ref[...])
        out_ref[...] = jnp.where(mine, result.astype(out_ref.dtype), before)

    @pl.when((v >= counts_ref[0]) & (v < counts_ref[1]))
    def _():
        out_ref[...] = jnp.zeros_like(out_ref)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def grouped_matmul(rows: jax.Array, w: jax.Array, scales: jax.Array, group_sizes: jax.Array,
                   *, up: tuple[jax.Array, jax.Array] | None = None,
                   out_dtype=jnp.float32, row_scales: jax.Array | None = None,
                   row_weights: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """Pallas twin of `reference.grouped_matmul`.

    rows:        f[N, K]          sorted by group; cast to bf16 (the MXU's input), or f8[N, K]
                                  with row_scales, read as fp8 (half the bytes of bf16) and
                                  widened in VMEM
    w:           f8[E, K, M]      (or any float dtype) one weight per group
    scales:      f32[E, K/ga, M/gb] block scales of w
    group_sizes: i32[E]           rows of each group, in order; rows past their sum are not
                                  any group's and come out zero
    up:          (w_up, scales_up) shaped as (w, scales), or None: with it the result is
                 silu(rows . w) * (rows . w_up), an expert's gated product, from one pass over
                 the rows (each row tile crosses HBM once for both weights, and the two
                 products never leave VMEM)
    out_dtype:   f32, or bf16 to halve the output's HBM writes (each row's f32 sum rounded
                 once, as it leaves VMEM)
    row_scales:  f32[N, 1] or None: fp8 rows' scales, row r standing for rows[r] * row_scales[r]
                 (each row's sums are scaled once, before the gate's nonlinearity)
    row_weights: f32[N, 1] or None: each row's result multiplied by its weight (in f32, before
                 it is rounded to out_dtype): a MoE's routing weights, which scale the down
                 projection's inputs
    returns:     out_dtype[N, M]
    """
    n, k = rows.shape
    if row_scales is not None and (rows.dtype.itemsize != 1 or row_scales.shape != (n, 1)):
        raise ValueError(f"scaled rows must be fp8 [N, K] with scales [N, 1]: got rows "
                         f"{rows.dtype}{list(rows.shape)}, scales {list(row_scales.shape)}")
    if row_weights is not None and row_weights.shape != (n, 1):
        raise ValueError(f"row weights must be [N, 1] = [{n}, 1]: got "
                         f"{list(row_weights.shape)}")
    e, kw, m = w.shape
    if kw != k or scales.shape[0] != e or m % scales.shape[-1] or k % scales.shape[-2]:
        raise ValueError(f"rows {rows.shape}, weights {w.shape} and scales {scales.shape} do "
                         "not fit together")
    pairs = [(w, scales)] if up is None else [(w, scales), up]
    if any(uw.shape != w.shape or us.shape != scales.shape for uw, us in pairs[1:]):
        raise ValueError(f"up {up[0].shape} / {up[1].shape} is not shaped as the gate "
                         f"{w.shape} / {scales.shape}")
    gb = m // scales.shape[-1]
    row_itemsize = 2 if row_scales is None else 1
    tm = row_tile(n, e, row_itemsize)
    m_tiles = cdiv(n, tm)
    tn = column_tile(k, m, gb, w.dtype.itemsize)
    num_visits = visits_bound(m_tiles * tm, e, tm)
    pad = ((0, m_tiles * tm - n), (0, 0))
    row_operands = [jnp.pad(rows if row_scales is not None else rows.astype(jnp.bfloat16), pad)]
    padded_rows_dtype = row_operands[0].dtype
    row_specs = [pl.BlockSpec((tm, k), lambda j, v, g, t, *_: (t[v], 0))]
    factors = [f.astype(jnp.float32) for f in (row_scales, row_weights) if f is not None]
    if factors and factor_lanes(tm):
        lanes = jnp.concatenate(factors, axis=1).T                          # [F, N]
        row_operands.append(jnp.pad(lanes, ((0, FACTOR_ROWS - len(factors)), pad[0])))
        row_specs.append(pl.BlockSpec((FACTOR_ROWS, tm), lambda j, v, g, t, *_: (0, t[v])))
    elif factors:
        row_operands.append(jnp.pad(jnp.concatenate(factors, axis=1), pad))
        row_specs.append(pl.BlockSpec((tm, len(factors)), lambda j, v, g, t, *_: (t[v], 0)))
    plan = plan_visits(group_sizes, tm, m_tiles, num_visits, interpret=interpret)
    figures = cost(n, w.shape, scales.shape, w.dtype.itemsize, weights=len(pairs),
                   out_itemsize=jnp.dtype(out_dtype).itemsize, row_itemsize=row_itemsize,
                   row_weights=row_weights is not None)
    weight_specs = [
        pl.BlockSpec((None, k, tn), lambda j, v, g, t, *_: (g[v], 0, j)),
        pl.BlockSpec((scales.shape[1], tn // gb, e), lambda j, v, g, t, *_: (0, j, 0),
                     memory_space=pltpu.SMEM),
    ]
    operands = [a for pw, ps in pairs
                for a in (pw, jnp.transpose(ps.astype(jnp.float32), (1, 2, 0)))]
    out = pl.pallas_call(
        functools.partial(_kernel, scaled_rows=row_scales is not None,
                          weighted_rows=row_weights is not None, lanes=factor_lanes(tm)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(m // tn, num_visits),
            in_specs=[*row_specs, *weight_specs * len(pairs)],
            out_specs=pl.BlockSpec((tm, tn), lambda j, v, g, t, *_: (t[v], j)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)] * len(pairs)),
        out_shape=jax.ShapeDtypeStruct((m_tiles * tm, m), out_dtype),
        **call_options("expert_grouped_matmul", figures, ("parallel", "arbitrary"), interpret,
                       fp8_mxu=fp8_mxu(padded_rows_dtype, w.dtype)),
    )(*plan, *row_operands, *operands)
    return out[:n]
