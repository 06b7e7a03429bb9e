"""Each query's best k candidate pages in one Pallas TPU kernel: k rounds of "the best score,
then the lowest page among its equals", the order `selection.rank_pages` sorts by.

Why. XLA:TPU lowers `lax.top_k` and the two-key `lax.sort` of the page selection to a full sort
of every query's candidates, and prices a sort at nothing (it carries no estimated cycles). On a
TPU v5e both, `lax.top_k` over a shard's pages and the sort of the gathered candidates, ran
slower than this kernel, the first about a hundred times
(docs/notes/2026-12-06-selection-on-tpu.md, "The page selection's sorts, measured on a TPU").

Layout. Candidates lie on the first axis and queries on the second ([M, N]): a vreg holds 8
candidates of 128 queries, so a round's max and min over the candidates are elementwise maxima
across vregs plus one 8-sublane fold, no lane shuffles. (With queries on sublanes and candidates
on lanes the same rounds ran about 2x slower on the v5e.) Grid: query tiles of `tq` lanes; a
tile's whole column of candidates sits in VMEM.

Per round, per candidate: max, compare, select, min, compare, select (VPU_OPS_PER_ROUND).
Per call (Mp = M rounded up to 8 sublanes, Np = N rounded up to a tile of whole 128 lanes):
    vpu ops = k * 6 * Mp * Np          (the kernel is VPU-bound: it reads each candidate once)
    bytes   = Mp * Np * 4 * (1 + has_pages) + 2 * k * Np * 4
Scores are not NaN; -0.0 counts as 0.0 (as the sort's order has them equal).

The gathered lists (`top_pages_of_pairs`): S shards' ranked lists of k arrive as one array
[G, 2, k, N] (scores, and pages bit-cast to f32). Each pair of lists is first cut to its k best
in VMEM (the better of a[i] and b[k - 1 - i], `selection.halve_sorted_lists`' bitonic split; the
odd lists arrive worst first, since Mosaic lowers no reversal), then the rounds run over the
G / 2 * k left. Per call (kp = k rounded up to 8 sublanes):
    vpu ops = (k * 6 + VPU_OPS_PER_HALVING) * G / 2 * kp * Np
    bytes   = G * 2 * kp * Np * 4 + 2 * k * Np * 4
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.vmem import LANES, VMEM_BUDGET_BYTES, tiled_bytes

__all__ = ["top_pages", "top_pages_of_pairs", "cost", "pairs_cost", "supports",
           "supports_pairs", "NO_PAGE", "VPU_OPS_PER_ROUND", "VPU_OPS_PER_HALVING"]

NO_PAGE = -1
VPU_OPS_PER_ROUND = 6
VPU_OPS_PER_HALVING = 6     # per entry of a pair: 2 compares, equal, less, or, and the select
QUERY_TILE = 256     # lanes; v5e, M = 1025 with pages: 1.66 ms at 128, 1.30 at 256, 1.28 at 512
_LAST = jnp.iinfo(jnp.int32).max     # above every page: what a round's min starts from
_SUBLANES = 8


def _padded(m: int, n: int, tq: int) -> tuple[int, int]:
    """(M, N) as the vregs hold them: whole sublane tiles of candidates, whole query tiles of
    whole 128-lane vregs (a decode step's one query still fills a vreg's lanes)."""
    tiles = -(-n // tq) * tq
    return -(-m // _SUBLANES) * _SUBLANES, -(-tiles // LANES) * LANES


def _query_tile(n: int) -> int:
    """The lanes of a grid step: QUERY_TILE, or the whole axis where it is shorter (a block's
    last dim is a multiple of 128 or the array's own)."""
    return QUERY_TILE if n > QUERY_TILE else max(n, 1)


def cost(m: int, n: int, k: int, has_pages: bool) -> dict:
    """VPU ops (as the estimate's flops, `vpu`), HBM bytes and VMEM bytes of one call (module
    docstring); VMEM: two buffers of each block plus three working copies of a tile."""
    tq = _query_tile(n)
    mp, np_ = _padded(m, n, tq)
    inputs = 1 + has_pages
    tile = tiled_bytes((mp, tq), 4)
    vmem = 2 * inputs * tile + 4 * tiled_bytes((k, tq), 4) + 3 * tile
    return {"flops": k * VPU_OPS_PER_ROUND * mp * np_,
            "bytes": mp * np_ * 4 * inputs + 2 * k * np_ * 4, "vmem_bytes": vmem, "vpu": True}


# The rounds are unrolled, one a selected candidate: past this many the kernel's program grows
# with k and its O(k M) work exceeds a sort's O(M log M) (token selection's k = index_topk,
# 2,048 for GLM-5.2, is ranked by XLA's sort; page selection's 32 pages take the kernel).
MAX_ROUNDS = 64


def supports(m: int, n: int, k: int, has_pages: bool) -> bool:
    """Whether a tile's whole column of m candidates fits the VMEM budget, in at most
    MAX_ROUNDS rounds."""
    return k <= MAX_ROUNDS and cost(m, n, k, has_pages)["vmem_bytes"] <= VMEM_BUDGET_BYTES


def supports_pairs(g: int, n: int, k: int) -> bool:
    """Whether `top_pages_of_pairs`' block of G lists of a query tile fits the VMEM budget, in
    at most MAX_ROUNDS rounds."""
    return k <= MAX_ROUNDS and pairs_cost(g, n, k)["vmem_bytes"] <= VMEM_BUDGET_BYTES


def _kernel(*refs, k: int, has_pages: bool):
    """scores [M, tq] f32 (and pages [M, tq] i32) -> best scores [k, tq], pages [k, tq]."""
    scores_ref, *rest = refs
    pages_ref, top_scores_ref, top_pages_ref = rest if has_pages else (None, *rest)
    s = scores_ref[...]
    pages = pages_ref[...] if has_pages else lax.broadcasted_iota(jnp.int32, s.shape, 0)
    _rounds(s, pages, top_scores_ref, top_pages_ref, k)


def _pairs_kernel(lists_ref, top_scores_ref, top_pages_ref, *, k: int):
    """lists [G, 2, k, tq] f32 (scores; pages bit-cast), the odd lists worst first -> best
    scores [k, tq], pages [k, tq]: each pair halved to its k best, then the rounds."""
    halves = []
    for g in range(lists_ref.shape[0] // 2):
        a_s, b_s = lists_ref[2 * g, 0], lists_ref[2 * g + 1, 0]                    # [k, tq]
        a_p, b_p = (lax.bitcast_convert_type(lists_ref[i, 1], jnp.int32)
                    for i in (2 * g, 2 * g + 1))
        a_first = (a_s > b_s) | ((a_s == b_s) & (a_p < b_p))
        halves.append((jnp.where(a_first, a_s, b_s), jnp.where(a_first, a_p, b_p)))
    _rounds(jnp.concatenate([h[0] for h in halves]), jnp.concatenate([h[1] for h in halves]),
            top_scores_ref, top_pages_ref, k)


def _rounds(s, pages, top_scores_ref, top_pages_ref, k: int) -> None:
    """k rounds over candidates s f32[M, tq], pages i32[M, tq] into the [k, tq] outputs."""
    s = jnp.where(s == 0, 0.0, s)
    for r in range(k):
        best = jnp.max(s, axis=0, keepdims=True)                                    # [1, tq]
        page = jnp.min(jnp.where(s == best, pages, _LAST), axis=0, keepdims=True)
        top_scores_ref[pl.ds(r, 1), :] = best
        top_pages_ref[pl.ds(r, 1), :] = jnp.where(best > -jnp.inf, page, NO_PAGE)
        s = jnp.where(pages == page, -jnp.inf, s)


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def top_pages(scores: jax.Array, pages: jax.Array | None = None, *, k: int,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The k best candidates of each query, in order (score desc, page asc).

    scores:  f32[M, N]  a column per query; -inf = not a candidate
    pages:   i32[M, N]  distinct among a column's candidates; None: the candidate's row 0..M-1
    returns: (f32[k, N], i32[k, N]) with -inf and NO_PAGE where a query has fewer than k
    """
    m, n = scores.shape
    has_pages = pages is not None
    if k < 1 or (has_pages and pages.shape != scores.shape):
        raise ValueError(f"scores {scores.shape}, pages {None if pages is None else pages.shape}"
                         f" and k={k} do not fit together")
    tq = _query_tile(n)
    # Blocks hold the whole candidate axis (Mosaic pads it to whole sublane tiles in VMEM, no
    # XLA pad of the array); a last, partial query tile computes columns that are never
    # written back, each column being its own query.
    operands = [scores.astype(jnp.float32)] + ([pages.astype(jnp.int32)] if has_pages else [])
    column = pl.BlockSpec((m, tq), lambda i: (0, i))
    out = pl.BlockSpec((k, tq), lambda i: (0, i))
    top_scores, top = pl.pallas_call(
        functools.partial(_kernel, k=k, has_pages=has_pages),
        grid=(pl.cdiv(n, tq),),
        in_specs=[column] * len(operands),
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct((k, n), jnp.float32),
                   jax.ShapeDtypeStruct((k, n), jnp.int32)],
        **call_options("page_top_k", cost(m, n, k, has_pages), ("parallel",), interpret),
    )(*operands)
    return top_scores, top


def pairs_cost(g: int, n: int, k: int) -> dict:
    """VPU ops (as flops, `vpu`), HBM bytes and VMEM bytes of one `top_pages_of_pairs` call:
    the halving's pass over G / 2 pairs of k entries, then the rounds over G / 2 * k."""
    tq = _query_tile(n)
    kp, np_ = _padded(k, n, tq)
    halved = g // 2 * kp
    # Two buffers of the block, the outputs', and five working copies of the halved column
    # (its scores and pages, and the rounds' three).
    vmem = (2 * tiled_bytes((g * 2 * k, tq), 4) + 4 * tiled_bytes((k, tq), 4)
            + 5 * tiled_bytes((halved, tq), 4))
    return {"flops": (k * VPU_OPS_PER_ROUND + VPU_OPS_PER_HALVING) * halved * np_,
            "bytes": g * 2 * kp * np_ * 4 + 2 * k * np_ * 4, "vmem_bytes": vmem, "vpu": True}


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def top_pages_of_pairs(lists: jax.Array, *, k: int, interpret: bool = False
                       ) -> tuple[jax.Array, jax.Array]:
    """The k best of G ranked lists of k, in order (score desc, page asc), halving each pair
    of lists (2i, 2i + 1) in VMEM first, as `selection.halve_sorted_lists` does in XLA.

    lists:   f32[G, 2, k, N]  G even; [g, 0] a list's scores, [g, 1] its pages bit-cast to f32;
             the even lists best first, the odd lists worst first (so that the halving, the
             better of a[i] and b[k - 1 - i], reads both at i: Mosaic has no reversal); pages
             distinct among a column's candidates, NO_PAGE and -inf for none
    returns: (f32[k, N], i32[k, N]) with -inf and NO_PAGE where a query has fewer than k
    """
    g, two, kk, n = lists.shape
    if g % 2 or two != 2 or kk != k:
        raise ValueError(f"lists {lists.shape} are not an even number of (scores, pages) "
                         f"lists of k={k}")
    tq = _query_tile(n)
    out = pl.BlockSpec((k, tq), lambda i: (0, i))
    return pl.pallas_call(
        functools.partial(_pairs_kernel, k=k),
        grid=(pl.cdiv(n, tq),),
        in_specs=[pl.BlockSpec((g, 2, k, tq), lambda i: (0, 0, 0, i))],
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct((k, n), jnp.float32),
                   jax.ShapeDtypeStruct((k, n), jnp.int32)],
        **call_options("page_top_k_pairs", pairs_cost(g, n, k), ("parallel",), interpret),
    )(lists.astype(jnp.float32))
