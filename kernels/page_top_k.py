"""Each query's best k candidate pages in one Pallas TPU kernel: k rounds of "the best score,
then the lowest page among its equals", the order `selection.rank_pages` sorts by.

Why. XLA:TPU lowers `lax.top_k` and the two-key `lax.sort` of the page selection to a full sort
of every query's candidates, and prices a sort at nothing (it carries no estimated cycles). On a
TPU v5e, for the shard's 1,025 pages of a 1M context and 16,384 queries (k = 32), `lax.top_k`
over [1, Q, M] ran 97 ms against 0.82 ms for this kernel; the 512 gathered candidates' sort 2.6
against 0.55 ms (docs/performance.md, "The page selection's sorts, measured on a TPU").

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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.vmem import LANES, VMEM_BUDGET_BYTES, tiled_bytes

__all__ = ["top_pages", "cost", "supports", "NO_PAGE", "VPU_OPS_PER_ROUND"]

NO_PAGE = -1
VPU_OPS_PER_ROUND = 6
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


def supports(m: int, n: int, k: int, has_pages: bool) -> bool:
    """Whether a tile's whole column of m candidates fits the VMEM budget."""
    return cost(m, n, k, has_pages)["vmem_bytes"] <= VMEM_BUDGET_BYTES


def _kernel(*refs, k: int, has_pages: bool):
    """scores [M, tq] f32 (and pages [M, tq] i32) -> best scores [k, tq], pages [k, tq]."""
    scores_ref, *rest = refs
    pages_ref, top_scores_ref, top_pages_ref = rest if has_pages else (None, *rest)
    s = scores_ref[...]
    s = jnp.where(s == 0, 0.0, s)
    pages = pages_ref[...] if has_pages else lax.broadcasted_iota(jnp.int32, s.shape, 0)
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
