"""DSA indexer page scores: the Pallas TPU kernel of `reference.indexer_page_scores`.

    I(t, s) = sum_h w_h(t) * ReLU(q_h(t) . k(s))
    P(t, p) = max_{s in page p, s <= t} I(t, s)          (-inf when no such s)

One grid step per (sequence, block of QUERY_BLOCK queries). The shard's page table arrives by
scalar prefetch; the kernel walks its pages `key_block_pages` at a time through a VMEM ring of
async DMAs (`packing.page_ring`), scores all qb * Hi query rows against a key block with one MXU
dot, reduces over heads, masks keys after each query and max-pools each page. Key blocks wholly
after the block's last query are neither read nor scored: the wrapper counts the visible blocks
(a prefix, since positions grow with the local page index) and the kernel fills the rest with
-inf. The dot runs in bf16 when queries and keys are exactly representable in bf16 (bf16 and fp8
are), else in f32; products are exact either way, so only the f32 summation order differs from the
reference.

In fp8 (`k_scale`): queries and keys both e4m3, each key standing for its values times its own
f32 scale, the MXU multiplies them at its fp8 rate (exact products, f32 sums) and each key's
scale multiplies its pooled column: ReLU and the head sum are positively homogeneous in the key,
so s(k) * sum_h w_h ReLU(q_h . k) is the score of the scaled key. A query head's own scale is
folded into its weight by the caller (`quantized_scores_inputs`).

Grid:   (B, nqb = ceil(Q / qb)), both parallel.
Blocks: q [qb, Hi, Di] VMEM; w f32[qb, Hi] VMEM; q_pos i32[qb, 1] VMEM; page table i32[B * Mp]
        (Mp = nkb * nb, sentinel-padded), visible key blocks i32[B * nqb] and each row's first
        logical page i32[B] (shard - rotation) scalar prefetch (SMEM); key cache
        T[P + 1, ps, Di] stays in HBM (pl.ANY), key blocks DMA'd page by page;
        key scales f32[Mp, ps] VMEM (fp8 only: the sequence's, fetched once per sequence);
        out f32[nkb, qb, nb] VMEM (transposed to [B, Q, M] outside).
VMEM:   R = qb * Hi rows, K = nb * ps keys per block, c = cache itemsize, q = query itemsize
          ring      NB * K * Di * c                          (NB = NUM_BUFFERS)
          inputs    2 * (R * Di * q + R * 4 + qb * 4)
          output    2 * Mp * qb * 4
          scales    2 * Mp * ps * 4                           (fp8 only)
          temps     2 * R * K * 4 + K * Di * 4 + 2 * qb * K * 4  (logits, ReLU, keys, scores)
        each array counted as Mosaic pads it (vmem.tiled_bytes); the wrapper halves nb while
        the sum exceeds the VMEM budget (`_key_block`).
Per call (upper bound: every key block visible to every query block):
        bytes = B*Q*Hi*(Di*q + 4) + B*Q*4 + B*nqb*Mp*(ps*Di*c + 4) + B*Q*Mp*4
                (+ B*Mp*ps*4 key scales in fp8)
        flops = B*nqb*Mp*ps * qb*Hi * (2*Di + 3)       (dot, ReLU, weight, head sum)
                (+ B*nqb*Mp*ps*qb key scales in fp8; the dot's flops run at the fp8 rate)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels import fp8_rows
from cp_runtime.kernels.storage import cdiv
from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.packing import check_page_size, page_ring
from cp_runtime.kernels.reference import NEG_INF
from cp_runtime.kernels.vmem import fit_block, tiled_bytes

__all__ = ["QUERY_BLOCK", "NUM_BUFFERS", "indexer_page_scores", "check_indexer_args", "cost",
           "QuantizedScoresInputs", "quantized_scores_inputs"]

# Queries per grid step. The logits temp [qb * Hi, nb * ps] f32 dominates VMEM; 32 queries of 64
# heads against 8 pages of 64 keys is 4 MiB, leaving room for double-buffered inputs.
QUERY_BLOCK = 32
# One key block in flight ahead of compute: a block is nb pages, already a long DMA.
NUM_BUFFERS = 2

# Dtypes whose every value is a bf16 value, so a bf16 MXU dot of them has exact products.
_BF16_EXACT = {np.dtype(jnp.bfloat16), np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)}
_E4M3 = np.dtype(jnp.float8_e4m3fn)


def check_indexer_args(q: jax.Array, w: jax.Array, k_cache: jax.Array, local_pages: jax.Array,
                       q_pos: jax.Array, k_scale: jax.Array | None = None) -> None:
    """Trace-time shape and dtype checks of the indexer arguments."""
    b, nq, hi, di = q.shape
    if w.shape != (b, nq, hi):
        raise ValueError(f"w {w.shape} must be [{b}, {nq}, {hi}]")
    if k_cache.ndim != 3 or k_cache.shape[-1] != di:
        raise ValueError(f"k cache {k_cache.shape} must be [P + 1, ps, {di}]")
    if local_pages.ndim != 2 or local_pages.shape[0] != b:
        raise ValueError(f"local_pages {local_pages.shape} must be [{b}, M]")
    if q_pos.shape != (b, nq):
        raise ValueError(f"q_pos {q_pos.shape} must be [{b}, {nq}]")
    if k_scale is None:
        return
    if k_scale.shape != (b, local_pages.shape[1], k_cache.shape[1]):
        raise ValueError(f"k_scale {k_scale.shape} must be [{b}, {local_pages.shape[1]}, "
                         f"{k_cache.shape[1]}]")
    if not np.dtype(q.dtype) == np.dtype(k_cache.dtype) == _E4M3:
        raise ValueError(f"with k_scale, q and the key cache must be float8_e4m3fn, not "
                         f"{np.dtype(q.dtype)} and {np.dtype(k_cache.dtype)}")


def _dot_dtype(q_dtype, k_dtype):
    both = {np.dtype(q_dtype), np.dtype(k_dtype)}
    if both == {_E4M3}:
        return jnp.float8_e4m3fn
    return jnp.bfloat16 if both <= _BF16_EXACT else jnp.float32


def _indexer_kernel(pages_ref,          # [B * Mp] SMEM (scalar prefetch)
                    visible_ref,        # [B * nqb] SMEM (scalar prefetch)
                    first_ref,          # [B] SMEM (scalar prefetch): logical page of local 0
                    q_ref,              # [qb, Hi, Di] VMEM
                    w_ref,              # [qb, Hi] VMEM
                    pos_ref,            # [qb, 1] VMEM
                    k_hbm,              # [P + 1, ps, Di] HBM
                    *refs,              # (scale_ref [Mp, ps] VMEM, fp8 only), out_ref
                                        # [nkb, qb, nb] VMEM, ring [NB, nb, ps, Di] VMEM,
                                        # sems DMA[NB]
                    num_shards: int, num_buffers: int, dot_dtype, scaled: bool):
    scale_ref, (out_ref, ring, sems) = (refs[0], refs[1:]) if scaled else (None, refs)
    nkb, qb, nb = out_ref.shape
    _, hi, di = q_ref.shape
    ps = ring.shape[2]
    keys_per_block = nb * ps
    b = pl.program_id(0)
    count = visible_ref[b * pl.num_programs(1) + pl.program_id(1)]
    out_ref[...] = jnp.full(out_ref.shape, NEG_INF, jnp.float32)

    def copies(kb, buffer):
        first = b * (nkb * nb) + kb * nb
        return [pltpu.make_async_copy(k_hbm.at[pages_ref[first + i]], ring.at[buffer, i],
                                      sems.at[buffer]) for i in range(nb)]

    def step(kb, buffer):
        keys = ring[buffer].astype(dot_dtype).reshape(keys_per_block, di)
        q = q_ref[...].astype(dot_dtype).reshape(qb * hi, di)                # [R, Di]
        logits = lax.dot_general(q, keys, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)         # [R, K]
        scores = (jnp.maximum(logits, 0.0).reshape(qb, hi, keys_per_block)
                  * w_ref[...][:, :, None]).sum(axis=1)                      # [qb, K]
        column = lax.broadcasted_iota(jnp.int32, (1, keys_per_block), 1)
        local = kb * nb + column // ps
        key_pos = (local * num_shards + first_ref[b]) * ps + column % ps     # [1, K]
        visible = (key_pos <= pos_ref[...]) & (key_pos >= 0)                 # [qb, K]
        pooled = jnp.where(visible, scores, NEG_INF).reshape(qb, nb, ps)
        if scale_ref is not None:     # each key's scale (> 0: masked keys stay -inf)
            pooled = pooled * scale_ref[pl.ds(pl.multiple_of(kb * nb, nb), nb), :][None]
        out_ref[kb] = pooled.max(axis=-1)                                    # [qb, nb]

    page_ring(count, num_buffers, copies, step)


def _visible_blocks(q_pos: jax.Array, first_page: jax.Array, *, num_blocks: int,
                    block_pages: int, num_shards: int, page_size: int) -> jax.Array:
    """i32[B, nqb]: how many leading key blocks hold a key at or before the block's last query.

    q_pos: i32[B, nqb, qb]
    """
    first_local = jnp.arange(num_blocks, dtype=jnp.int32) * block_pages
    first_key = (first_local * num_shards + first_page[:, None]) * page_size   # [B, nkb]
    last_query = q_pos.max(axis=-1)                                            # [B, nqb]
    return (first_key[:, None] <= last_query[..., None]).sum(axis=-1, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_shards", "key_block_pages", "interpret"))
def indexer_page_scores(q: jax.Array, w: jax.Array, k_cache: jax.Array, local_pages: jax.Array,
                        q_pos: jax.Array, shard: jax.Array, rotation: jax.Array | None = None,
                        tie=None, k_scale: jax.Array | None = None, *, num_shards: int,
                        key_block_pages: int, interpret: bool = False):
    """Pallas twin of `reference.indexer_page_scores`; same arguments and result.

    tie: None, or arrays whose producers are to finish beside the kernel: they are tied
    (`lax.optimization_barrier`) to its output before anything else reads it (XLA:TPU runs
    the transpose below on the SparseCores and kept no offloaded collective in flight across
    it), and the call returns (scores, tie). cp_runtime.model.halves ties the pages it
    gathers ahead.
    k_scale: None, or f32[B, M, ps], the scale of each key of each local page: q and k_cache
    are then e4m3 (`quantized_scores_inputs` makes them) and the dot runs at the fp8 rate.

    q:           f[B, Q, Hi, Di]   indexer queries (Hi a multiple of 8 on TPU)
    w:           f[B, Q, Hi]       per-head weights
    k_cache:     T[P + 1, ps, Di]  pool layout, read a page at a time
    local_pages: i32[B, M]         slot of the j-th local page (-1 reads the sentinel, as the
                                   reference's wrapping index does)
    q_pos:       i32[B, Q]         positions, -1 = padding
    shard:       i32[]             this shard's index on the cp axis
    rotation:    i32[B]            each sequence's rotation (None = zeros), as in the reference
    returns:     f32[B, Q, M]
    """
    check_indexer_args(q, w, k_cache, local_pages, q_pos, k_scale)
    b, nq, hi, di = q.shape
    m = local_pages.shape[1]
    sentinel, ps = k_cache.shape[0] - 1, k_cache.shape[1]
    check_page_size(ps)
    nb = _key_block(q, k_cache, m, key_block_pages, k_scale is not None)
    nkb = cdiv(m, nb)
    qb = min(QUERY_BLOCK, nq)
    nqb = cdiv(nq, qb)
    qpad = nqb * qb - nq
    pages = jnp.where(local_pages < 0, sentinel, local_pages).astype(jnp.int32)
    # Padded pages sit past any query: read (from the sentinel) but always masked.
    pages = jnp.pad(pages, ((0, 0), (0, nkb * nb - m)), constant_values=sentinel)
    q = jnp.pad(q, ((0, 0), (0, qpad), (0, 0), (0, 0)))
    # The weights go in as they lie, [B, Qp, Hi], a head a lane: with a trailing unit axis
    # XLA:TPU wrote them out padded to a lane tile an element (134 MB for a 16K chunk's 8K
    # rows of GLM-5.2's 32 heads; 0.08 ms a call), which the kernel then read.
    w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, qpad), (0, 0)))          # [B, Qp, Hi]
    q_pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, qpad)), constant_values=-1)
    rotation = jnp.zeros((b,), jnp.int32) if rotation is None else rotation.astype(jnp.int32)
    first_page = jnp.asarray(shard, jnp.int32) - rotation                    # [B]
    visible = _visible_blocks(q_pos.reshape(b, nqb, qb), first_page, num_blocks=nkb,
                              block_pages=nb, num_shards=num_shards, page_size=ps)
    figures = cost(q, w, k_cache, local_pages, q_pos, k_scale=k_scale, num_shards=num_shards,
                   key_block_pages=key_block_pages)
    dot_dtype = _dot_dtype(q.dtype, k_cache.dtype)
    kernel = functools.partial(_indexer_kernel, num_shards=num_shards, num_buffers=NUM_BUFFERS,
                               dot_dtype=dot_dtype, scaled=k_scale is not None)
    scale_specs, scale_args = [], []
    if k_scale is not None:       # padded pages' keys are masked: any positive scale will do
        scale_args = [jnp.pad(k_scale.astype(jnp.float32), ((0, 0), (0, nkb * nb - m), (0, 0)),
                              constant_values=1.0)]
        scale_specs = [pl.BlockSpec((None, nkb * nb, ps), lambda bi, qi, *_: (bi, 0, 0))]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, nqb),
            in_specs=[
                pl.BlockSpec((None, qb, hi, di), lambda bi, qi, *_: (bi, qi, 0, 0)),
                pl.BlockSpec((None, qb, hi), lambda bi, qi, *_: (bi, qi, 0)),
                pl.BlockSpec((None, qb, 1), lambda bi, qi, *_: (bi, qi, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
                *scale_specs,
            ],
            out_specs=pl.BlockSpec((None, nkb, qb, nb), lambda bi, qi, *_: (bi, 0, qi, 0)),
            scratch_shapes=[
                pltpu.VMEM((NUM_BUFFERS, nb, *k_cache.shape[1:]), k_cache.dtype),
                pltpu.SemaphoreType.DMA((NUM_BUFFERS,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, nkb, nqb * qb, nb), jnp.float32),
        **call_options("indexer_page_scores", figures, ("parallel", "parallel"), interpret,
                       fp8_mxu=dot_dtype == jnp.float8_e4m3fn),
    )(pages.reshape(-1), visible.reshape(-1), first_page, q, w, q_pos[..., None], k_cache,
      *scale_args)
    if tie is not None:
        out, tie = lax.optimization_barrier((out, tie))
    # [B, nkb, Qp, nb] -> [B, Qp, nkb * nb] -> [B, Q, M]
    out = out.transpose(0, 2, 1, 3).reshape(b, nqb * qb, nkb * nb)[:, :nq, :m]
    return out if tie is None else (out, tie)


class QuantizedScoresInputs(NamedTuple):
    """The indexer's arguments rounded to e4m3 for the kernel's fp8 dot
    (`quantized_scores_inputs`)."""

    q: jax.Array             # f8e4m3[B, Q, Hi, Di]  each query head over its own scale
    w: jax.Array             # f32[B, Q, Hi]         head weights times those scales
    k_cache: jax.Array       # f8e4m3[B * M + 1, ps, Di]  the rows' local pages, then a sentinel
    local_pages: jax.Array   # i32[B, M]             j-th local page of row b at b * M + j
    k_scale: jax.Array       # f32[B, M, ps]         each key's scale


def quantized_scores_inputs(q: jax.Array, w: jax.Array, k_cache: jax.Array,
                            local_pages: jax.Array) -> QuantizedScoresInputs:
    """The arguments of an fp8 scoring: every query head and every key rounded to e4m3 with
    one f32 scale each (kernels/fp8_rows.py), as DeepSeek-V3.2's reference indexer rounds its
    queries and keys (there in blocks of 128 values: one block a head's query or a key at
    Di = 128). Only the step's rows' pages are rounded, gathered out of the pool (which keeps
    its keys in their own dtype): the pool is a whole device's, a step's rows see a fraction
    of it. A per-key, per-head rounding does not depend on how the cache is sharded, so the
    selection stays the same at every shard count.

    q f[B, Q, Hi, Di] (or e4m3 values already, their heads' scales folded into w: taken as
    they are), w f[B, Q, Hi], k_cache T[P + 1, ps, Di] (values, not storage form),
    local_pages i32[B, M] (-1: the sentinel page, as the kernel reads it)."""
    b, m = local_pages.shape
    sentinel = k_cache.shape[0] - 1
    w = w.astype(jnp.float32)
    if np.dtype(q.dtype) != _E4M3:
        heads = fp8_rows.quantize(q)
        q, w = heads.values, w * heads.scales[..., 0]
    keys = fp8_rows.quantize(k_cache[jnp.where(local_pages < 0, sentinel, local_pages)])
    values = jnp.concatenate([keys.values.reshape(b * m, *k_cache.shape[1:]),
                              jnp.zeros((1, *k_cache.shape[1:]), keys.values.dtype)])
    return QuantizedScoresInputs(
        q=q, w=w, k_cache=values,
        local_pages=jnp.arange(b * m, dtype=jnp.int32).reshape(b, m),
        k_scale=keys.scales[..., 0])


def _vmem_bytes(qb: int, hi: int, di: int, nb: int, mp: int, ps: int, c: int, qi: int,
                scaled: bool = False) -> int:
    """VMEM of one grid step (the module doc's terms, each as Mosaic pads it)."""
    rows, keys = qb * hi, nb * ps
    return (NUM_BUFFERS * nb * tiled_bytes((ps, di), c)
            + (2 * tiled_bytes((mp, ps), 4) if scaled else 0)
            + 2 * (tiled_bytes((qb, hi, di), qi) + tiled_bytes((qb, hi), 4)
                   + tiled_bytes((qb, 1), 4))
            + 2 * tiled_bytes((mp // nb, qb, nb), 4)
            + 2 * tiled_bytes((rows, keys), 4) + tiled_bytes((keys, di), 4)
            + 2 * tiled_bytes((qb, keys), 4))


def _key_block(q, k_cache, m: int, key_block_pages: int, scaled: bool = False) -> int:
    """min(key_block_pages, M) pages per key block, halved by `vmem.fit_block` while a step's
    VMEM exceeds the budget: DeepSeek-V3.2's 64 indexer heads over 32 queries take 64 pages
    (4096 keys) to 32; GLM-5.2's 32 heads keep 64."""
    _, nq, hi, di = q.shape
    qb = min(QUERY_BLOCK, nq)
    c, qi = np.dtype(k_cache.dtype).itemsize, np.dtype(q.dtype).itemsize

    def vmem(nb):
        return _vmem_bytes(qb, hi, di, nb, cdiv(m, nb) * nb, k_cache.shape[1], c, qi, scaled)

    return fit_block(vmem, min(key_block_pages, m))


def cost(q, w, k_cache, local_pages, q_pos, shard=None, rotation=None, tie=None, k_scale=None,
         *, num_shards: int, key_block_pages: int) -> dict:
    """Grid, blocks, VMEM bytes, and the upper bounds of HBM bytes and flops of one call.

    Takes the kernel's arguments or anything with `.shape`/`.dtype` (jax.ShapeDtypeStruct).
    """
    del w, q_pos, shard, rotation, tie, num_shards
    b, nq, hi, di = q.shape
    m = local_pages.shape[1]
    ps = k_cache.shape[1]
    c, qi = np.dtype(k_cache.dtype).itemsize, np.dtype(q.dtype).itemsize
    scaled = k_scale is not None
    nb = _key_block(q, k_cache, m, key_block_pages, scaled)
    mp = cdiv(m, nb) * nb
    qb = min(QUERY_BLOCK, nq)
    nqb = cdiv(nq, qb)
    rows, keys = qb * hi, nb * ps
    vmem = _vmem_bytes(qb, hi, di, nb, mp, ps, c, qi, scaled)
    return {
        "grid": (b, nqb),
        "blocks": {"q": (qb, hi, di), "keys": (keys, di), "out": (mp // nb, qb, nb)},
        "vmem_bytes": vmem,
        "bytes": (b * nq * hi * (di * qi + 4) + b * nq * 4 + b * nqb * mp * (ps * di * c + 4)
                  + b * nq * mp * 4 + (b * mp * ps * 4 if scaled else 0)),
        "flops": b * nqb * mp * ps * (rows * (2 * di + 3) + (qb if scaled else 0)),
    }
