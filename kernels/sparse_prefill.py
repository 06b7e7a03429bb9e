"""Sparse MLA prefill: the Pallas TPU kernel of `reference.sparse_attention` for blocks of queries.

Per (sequence b, query block i) the wrapper builds, in XLA, the union of the pages the block's
queries selected: an entry counts where its slot is >= 0 and its page starts at or before its
query's position; duplicates collapse. The kernel streams the union's pages from HBM into a VMEM
ring by async DMA (`packing.page_ring`), upcasts each page to the query dtype, and runs one online
softmax over it for all qb * H query rows at once. Each query weighs a page's keys by how many
times its own list names the page (0: not selected, 2: listed twice, as the reference counts it)
and hides keys after its position. Keys past the block's last position are zeroed before the dot,
so stray rows (a partial last page, a NaN-poisoned tail) never reach the accumulators.
Both products run in the query dtype with f32 accumulation: QK of the query and the upcast page,
PV of the probabilities rounded to the query dtype and the page's values. With bf16 queries (the
TPU path, kernels/dispatch.py) both are bf16 MXU matmuls; fp8 and bf16 pages upcast to bf16
exactly, so the rounding is the query's and the probabilities' alone. With f32 queries the
kernel is an f32 one, equal to the reference up to the order of f32 sums.
Assumes one logical page per slot within a sequence (true of any page table).

Neighbouring queries select mostly the same pages, so the union is close to N pages and each page
is read once per block instead of once per query; the price is that every query row scores every
union page (masked), so flops grow with the union size U <= qb * N.

Token masks (`sel_masks` i32[B, Q, N, W], W = cdiv(ps, 32); reference.py's module docstring).
The union stays a union of pages (an entry whose mask is all zero is not visible), fetched
whole. The masks reach the kernel as a VMEM block [W, qb, N] per (sequence, query block); per
union page the kernel builds each query's weight of each token: the query's entries naming
the page whose mask has the token's bit, f32[qb, ps] in place of page mode's [qb, 1]
multiplicity. It takes them in rounds, each query's first entry still naming the page per round
(`_token_weights`), so as many rounds as one query has entries on the page: one, unless a query
lists a page twice. A round is (5 + 2 W) VPU passes over [qb, N] i32 besides page mode's 2; at
N = 2,048 entries and qb = 16 that is ~290 vreg operations a union page (32 vregs a pass), of
the order of the page's two MXU products at H = 64 (an estimate, not a TPU measurement).
What the masks cost:
        HBM     4 * W bytes an entry (B * Q * N * W * 4 a call: 16 KiB a query at N = 2,048,
                ps = 64), read once
        VMEM    2 * W * qb * N * 4 (double-buffered) + 4 * qb * N * 4 (the rounds' [qb, N]
                temporaries) + R * ps * 4 (the weights broadcast over heads): 1.25 MiB at
                qb = 16, N = 2,048, H = 64
        SMEM    none of their own; but N = 2,048 entries make the union lists qb * N long:
                4 * qb * N * 4 bytes, 512 KiB at qb = 16. qb = 32 needs 1 MiB, which the TPU7x
                compiler refused ("Used 1.00M of 1.00M smem", its 1 MiB), so `_query_block`
                keeps them within vmem.SMEM_BUDGET_BYTES: GLM-5.2 compiles at qb = 16.
Masked keys are hidden from the softmax, not zeroed in the page: every row at or before the
block's last position is written, so only the rows past it, zeroed as in page mode, can hold
garbage. Worst case: every query's 2,048 tokens on distinct pages no other query of its block
selects, U = qb * N pages a block, each fetched whole and scored for all qb * H rows: the
decode kernel's 80 MiB of GLM-5.2 pages a query row a layer (sparse_decode.py) for 1.25 MiB of
selected rows, and qb times the flops of scoring them for their own query alone.

Grid:   (B, nqb = ceil(Q / qb)), both parallel; qb by `_query_block` (the block whose bound
        costs least, at most `query_block`).
Blocks: q [qb, H, D] VMEM; sel_slots i32[qb, N] VMEM; q_pos i32[qb, 1] VMEM (both from
        [B, nqb, qb, .] arrays, so qb need not be a multiple of 8); with masks, sel_masks
        i32[W, qb, N] VMEM (from [B, nqb, W, qb, N]);
        union slots and pages i32[1, U] SMEM per block (U = qb * N; a row of a
        [B * nqb, 1, U] array, so a block's last two dims are the array's, as Pallas requires);
        union count i32[B * nqb] scalar prefetch;
        kv cache T[P + 1, ps, D] stays in HBM (pl.ANY), pages DMA'd one at a time;
        out o f32[qb, H, V] and lse f32[qb, H, 1] VMEM.
VMEM:   R = qb * H rows, c = cache itemsize, q = query itemsize
          ring      NB * ps * D * c                      (NB = NUM_BUFFERS)
          inputs    2 * (R * D * q + qb * N * 4 + qb * 4)  (pipeline double buffers;
                    + 2 * W * qb * N * 4 with masks)
          outputs   2 * R * (V + 1) * 4
          scratch   R * (V + 2) * 4                      (acc, m, l)
          temps     3 * R * ps * 4 + R * ps * q + ps * D * q + R * V * 4
                    (scores, probs, probs for PV and the page in the query dtype, acc;
                    + 4 * qb * N * 4 + R * ps * 4 with masks)
        each array counted as Mosaic pads it (vmem.tiled_bytes: an [R, 1] column takes 128
        lanes); blocks over the budget are not taken (`_query_block`): GLM-5.2 with every
        head (H = 64, D = 640, V = 512, ps = 64, N = 33, fp8, bf16 q) fits qb = 32 in ~29 MiB,
        DeepSeek-V3.2's 128 heads qb = 16. (qb = 64 at H = 64 asked the TPU7x compiler for
        51 MiB and was refused.)
        SMEM: 4 * U * 4 bytes (two union lists, double-buffered) + 4 * B * nqb (counts); with
        N = 2,048 token entries it bounds qb (above).
Per call (upper bound: every selected page distinct and visible, U = min(qb * N, P + 1): a
        block's union holds no more pages than the cache it indexes, so a chunk early in a
        prompt, whose gathered tables (attention gather_kv) hold a few pages, is priced at them):
        bytes = B*Q*H*D*q + B*Q*N*4 (+ B*Q*N*W*4 masks) + B*nqb*U*(ps*D*c + 8)
                + B*Q*H*(V + 1)*4
        flops = 2 * B*nqb*U * qb*H * ps * (D + V)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels.storage import cdiv
from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.packing import check_page_size, page_ring
from cp_runtime.kernels.reference import (MASK_BITS, NEG_INF, check_attention_args,
                                         live_slots)
from cp_runtime.kernels.vmem import fit_block, tiled_bytes

__all__ = ["NUM_BUFFERS", "sparse_prefill", "block_union", "init_softmax", "online_softmax_step",
           "finalize_softmax", "mask_bits", "cost", "priced_bound"]

# Ring depth. Two buffers hide one page's DMA behind the previous page's compute. By the v5e
# roofline (0.8 TB/s HBM, 197 TFLOP/s bf16) a 64 x 576 fp8 page takes as long to fetch as to
# score against ~65 query rows, and a prefill block has qb * H >= 64 rows, so compute covers the
# fetch. An estimate, not yet a TPU measurement.
NUM_BUFFERS = 2

_NO_SLOT = np.iinfo(np.int32).max  # sorts after every real slot


def block_union(sel_slots: jax.Array, sel_pages: jax.Array, q_pos: jax.Array, *, page_size: int,
                query_block: int, sel_masks: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Distinct visible pages selected by each block of queries (XLA, outside the kernel).

    sel_slots, sel_pages: i32[B, Q, N] with Q a multiple of query_block
    q_pos:                i32[B, Q]
    sel_masks:            i32[B, Q, N, W] or None; an entry whose mask is all zero is not visible
    returns: slots i32[B, nqb, U], pages i32[B, nqb, U] (U = query_block * N; the first `count`
             entries are the union, in slot order, the rest are filler), count i32[B, nqb]
    """
    b, nq, n = sel_slots.shape
    nqb = nq // query_block
    sel_slots = live_slots(sel_slots, sel_masks)
    visible = (sel_slots >= 0) & (sel_pages * page_size <= q_pos[..., None])
    key = jnp.where(visible, sel_slots, _NO_SLOT)
    # [B, Q, N] -> [B, nqb, qb * N]
    key = key.reshape(b, nqb, query_block * n)
    pages = sel_pages.reshape(b, nqb, query_block * n)
    key, pages = lax.sort((key, pages), dimension=-1, num_keys=1)
    first = (key != _NO_SLOT) & (key != jnp.roll(key, 1, axis=-1))
    first = first.at[..., 0].set(key[..., 0] != _NO_SLOT)
    # Stable sort on "not first" moves the distinct entries to the front, still in slot order.
    _, slots, pages = lax.sort((jnp.where(first, 0, 1), key, pages), dimension=-1, num_keys=1,
                              is_stable=True)
    return slots, pages, first.sum(axis=-1, dtype=jnp.int32)


def online_softmax_step(s: jax.Array, weight: jax.Array | float, v: jax.Array, m_ref, l_ref,
                        acc_ref) -> None:
    """Fold one page into the running softmax of R query rows.

    s:      f32[R, ps]  scaled scores, -inf where hidden
    weight: f32[R, 1]   multiplicity of the page in each row's list (or the scalar 1.0); with
                        token masks f32[R, ps], each key's
    v:      f[ps, V]    values in the query dtype, zero where no row sees the key
    m_ref, l_ref: f32[R, 1] VMEM, running max and denominator; acc_ref: f32[R, V] VMEM
    """
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    # A row that has seen nothing yet keeps m = -inf; subtract 0 there so exp gives 0, not NaN.
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe) * weight
    l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
    # p meets v in v's dtype: bf16 on the TPU path, so PV is a bf16 MXU product with f32
    # accumulation (an f32 dot is issued as f32-format matmuls, twice the instructions); the
    # denominator above keeps p in f32.
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
    m_ref[...] = m_new


def init_softmax(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def finalize_softmax(m_ref, l_ref, acc_ref) -> tuple[jax.Array, jax.Array]:
    """-> o f32[R, V], lse f32[R, 1]; o = 0 and lse = -inf for rows that saw no key."""
    m, l = m_ref[...], l_ref[...]
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    lse = jnp.where(seen, jnp.log(safe_l) + jnp.where(jnp.isfinite(m), m, 0.0), NEG_INF)
    return acc_ref[...] / safe_l, lse


# log2(MASK_BITS): a token's word and bit by shifts, which Mosaic has for vectors.
_WORD_SHIFT = MASK_BITS.bit_length() - 1


def mask_bits(words, page_size: int) -> jax.Array:
    """The tokens' bits of a page's mask, inside a kernel.

    words:   W i32 scalars or [rows, 1] columns, word w holding tokens 32 w .. 32 w + 31
    returns: i32[rows (or 1), ps], 1 where the token's bit is set; shifted logically, so bit 31
             (the sign) is a token like the others
    """
    token = lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
    word = jnp.zeros((1, page_size), jnp.int32)
    for w, value in enumerate(words):
        word = jnp.where(lax.shift_right_logical(token, _WORD_SHIFT) == w, value, word)
    return lax.shift_right_logical(word, token & (MASK_BITS - 1)) & 1


def _token_weights(sel_ref, masks_ref, uslot, page_size: int) -> jax.Array:
    """Per query and token of the union page in slot `uslot`: how many of the query's entries
    name the page with the token's bit set.

    sel_ref: i32[qb, N] VMEM; masks_ref: i32[W, qb, N] VMEM -> f32[qb, ps]

    A query's entries on one page are taken a round each, first entry first: a round sums one
    entry's words per query, exact where a sum over all of them would mix their bits. Rounds:
    the most entries one query has on the page (a vector max read as the loop's bound).
    """
    named = (sel_ref[...] == uslot).astype(jnp.int32)     # i32: Mosaic loops carry no i1 vectors
    n = named.shape[1]
    entry = lax.broadcasted_iota(jnp.int32, named.shape, 1)
    rounds = jnp.max(jnp.sum(named, axis=1))

    def take_first(_, carry):
        left, weight = carry                                          # [qb, N], [qb, ps]
        first = entry == jnp.min(jnp.where(left != 0, entry, n), axis=1, keepdims=True)
        words = [jnp.sum(jnp.where(first, masks_ref[w], 0), axis=1, keepdims=True)
                 for w in range(masks_ref.shape[0])]                  # W x [qb, 1]
        return jnp.where(first, 0, left), weight + mask_bits(words, page_size)

    weight = jnp.zeros((named.shape[0], page_size), jnp.int32)
    _, weight = lax.fori_loop(0, rounds, take_first, (named, weight))
    return weight.astype(jnp.float32)


def _prefill_kernel(count_ref,                # [B * nqb] SMEM (scalar prefetch)
                    uslots_ref, upages_ref,   # [1, U] SMEM
                    q_ref,                    # [qb, H, D] VMEM
                    sel_ref,                  # [qb, N] VMEM
                    pos_ref,                  # [qb, 1] VMEM
                    *refs,                    # with masks: [W, qb, N] VMEM; then as below
                    scale: float, value_dim: int, num_buffers: int, masked: bool):
    masks_ref, refs = (refs[0], refs[1:]) if masked else (None, refs)
    (cache_hbm,                               # [P + 1, ps, D] HBM
     o_ref,                                   # [qb, H, V] VMEM
     lse_ref,                                 # [qb, H, 1] VMEM
     ring, sems,                              # [NB, ps, D] VMEM, DMA[NB]
     m_ref, l_ref, acc_ref) = refs            # [R, 1], [R, 1], [R, V] VMEM
    qb, h, d = q_ref.shape
    ps = ring.shape[1]
    count = count_ref[pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)]
    pos = pos_ref[...]                                            # [qb, 1]
    max_pos = jnp.max(pos)
    init_softmax(m_ref, l_ref, acc_ref)

    def copies(j, buffer):
        return [pltpu.make_async_copy(cache_hbm.at[uslots_ref[0, j]], ring.at[buffer],
                                      sems.at[buffer])]

    def step(j, buffer):
        start = upages_ref[0, j] * ps
        kv = ring[buffer].astype(q_ref.dtype)        # [ps, D]
        row_pos = start + lax.broadcasted_iota(jnp.int32, (ps, 1), 0)
        kv = jnp.where(row_pos <= max_pos, kv, 0)                  # no query sees these rows
        q = q_ref[...].reshape(qb * h, d)                          # [R, D]
        s = lax.dot_general(q, kv, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale  # [R, ps]
        if masked:
            weight = _token_weights(sel_ref, masks_ref, uslots_ref[0, j], ps)  # [qb, ps]
        else:
            weight = jnp.sum((sel_ref[...] == uslots_ref[0, j]).astype(jnp.float32), axis=1,
                             keepdims=True)                        # [qb, 1]
        key_pos = start + lax.broadcasted_iota(jnp.int32, (1, ps), 1)
        visible = (weight > 0) & (key_pos <= pos)                  # [qb, ps]
        s = jnp.where(visible[:, None, :], s.reshape(qb, h, ps), NEG_INF).reshape(qb * h, ps)
        k = weight.shape[1]
        weight = jnp.broadcast_to(weight[:, None, :], (qb, h, k)).reshape(qb * h, k)
        online_softmax_step(s, weight, kv[:, :value_dim], m_ref, l_ref, acc_ref)

    page_ring(count, num_buffers, copies, step)
    o, lse = finalize_softmax(m_ref, l_ref, acc_ref)
    o_ref[...] = o.reshape(qb, h, value_dim)
    lse_ref[...] = lse.reshape(qb, h, 1)


def _pad_queries(x: jax.Array, pad: int, fill) -> jax.Array:
    """Pad axis 1 (queries) of x by `pad` entries of `fill`."""
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


@functools.partial(jax.jit, static_argnames=("value_dim", "scale", "query_block", "interpret"))
def sparse_prefill(q: jax.Array, kv_cache: jax.Array, sel_slots: jax.Array,
                   sel_pages: jax.Array, q_pos: jax.Array, *, value_dim: int, scale: float,
                   query_block: int = 64, interpret: bool = False,
                   sel_masks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pallas twin of `reference.sparse_attention`; same arguments and results.

    q:         f[B, Q, H, D]     queries in the cached layout (H a multiple of 8 on TPU)
    kv_cache:  T[P + 1, ps, D]   pool layout, read a page at a time
    sel_slots: i32[B, Q, N]      local slot per selected page, -1 = not on this shard / unused
    sel_pages: i32[B, Q, N]      logical page of each entry
    q_pos:     i32[B, Q]         positions, -1 = padding query
    sel_masks: i32[B, Q, N, W]   token mask of each entry, or None (page mode)
    returns:   o f32[B, Q, H, value_dim], lse f32[B, Q, H]
    """
    check_attention_args(q, kv_cache, sel_slots, sel_pages, q_pos, value_dim, sel_masks)
    b, nq, h, d = q.shape
    n = sel_slots.shape[-1]
    ps = kv_cache.shape[1]
    check_page_size(ps)
    words = 0 if sel_masks is None else sel_masks.shape[-1]
    qb = _query_block(q, kv_cache, n, value_dim, query_block, words)
    nqb = cdiv(nq, qb)
    pad = nqb * qb - nq
    q = _pad_queries(q, pad, 0)
    sel_slots = _pad_queries(sel_slots.astype(jnp.int32), pad, -1)
    sel_pages = _pad_queries(sel_pages.astype(jnp.int32), pad, 0)
    q_pos = _pad_queries(q_pos.astype(jnp.int32), pad, -1)
    if words:
        sel_masks = _pad_queries(sel_masks, pad, 0)
    uslots, upages, count = block_union(sel_slots, sel_pages, q_pos, page_size=ps,
                                        query_block=qb, sel_masks=sel_masks)
    # One [1, U] row of SMEM per (sequence, block): a block's last two dims then equal the
    # array's, as Pallas requires of every block, however many query blocks there are.
    uslots, upages = (x.reshape(b * nqb, 1, qb * n) for x in (uslots, upages))
    union_spec = pl.BlockSpec((None, 1, qb * n), lambda bi, qi, *_: (bi * nqb + qi, 0, 0),
                              memory_space=pltpu.SMEM)
    figures = cost(q, kv_cache, sel_slots, sel_pages, q_pos, value_dim=value_dim,
                   query_block=qb, sel_masks=sel_masks)
    kernel = functools.partial(_prefill_kernel, scale=scale, value_dim=value_dim,
                               num_buffers=NUM_BUFFERS, masked=bool(words))
    # With masks: [B, Q, N, W] -> [B, nqb, W, qb, N], so a word's [qb, N] is a whole slab.
    masks = [] if not words else [
        sel_masks.reshape(b, nqb, qb, n, words).transpose(0, 1, 4, 2, 3)]
    mask_specs = [pl.BlockSpec((None, None, words, qb, n),
                               lambda bi, qi, *_: (bi, qi, 0, 0, 0))] if words else []
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b, nqb),
            in_specs=[
                union_spec,
                union_spec,
                pl.BlockSpec((None, qb, h, d), lambda bi, qi, *_: (bi, qi, 0, 0)),
                pl.BlockSpec((None, None, qb, n), lambda bi, qi, *_: (bi, qi, 0, 0)),
                pl.BlockSpec((None, None, qb, 1), lambda bi, qi, *_: (bi, qi, 0, 0)),
                *mask_specs,
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=[
                pl.BlockSpec((None, qb, h, value_dim), lambda bi, qi, *_: (bi, qi, 0, 0)),
                pl.BlockSpec((None, qb, h, 1), lambda bi, qi, *_: (bi, qi, 0, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((NUM_BUFFERS, *kv_cache.shape[1:]), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((NUM_BUFFERS,)),
                pltpu.VMEM((qb * h, 1), jnp.float32),
                pltpu.VMEM((qb * h, 1), jnp.float32),
                pltpu.VMEM((qb * h, value_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, nqb * qb, h, value_dim), jnp.float32),
            jax.ShapeDtypeStruct((b, nqb * qb, h, 1), jnp.float32),
        ],
        **call_options("sparse_prefill", figures, ("parallel", "parallel"), interpret),
    )(count.reshape(-1), uslots, upages, q, sel_slots.reshape(b, nqb, qb, n),
      q_pos.reshape(b, nqb, qb, 1), *masks, kv_cache)
    return o[:, :nq], lse[:, :nq, :, 0]


def _vmem_bytes(qb: int, h: int, d: int, n: int, ps: int, value_dim: int, c: int,
                qi: int, words: int = 0) -> int:
    """VMEM of one grid step (the module doc's terms, each as Mosaic pads it) for query blocks
    of qb queries; `words`: W with masks, 0 without."""
    rows = qb * h
    ring = NUM_BUFFERS * tiled_bytes((ps, d), c)
    inputs = 2 * (tiled_bytes((qb, h, d), qi) + (1 + words) * tiled_bytes((qb, n), 4)
                  + tiled_bytes((qb, 1), 4))
    outputs = 2 * (tiled_bytes((qb, h, value_dim), 4) + tiled_bytes((qb, h, 1), 4))
    scratch = tiled_bytes((rows, value_dim), 4) + 2 * tiled_bytes((rows, 1), 4)
    temps = (3 * tiled_bytes((rows, ps), 4) + tiled_bytes((rows, ps), qi)
             + tiled_bytes((ps, d), qi) + tiled_bytes((rows, value_dim), 4))
    if words:            # the rounds' [qb, N] temporaries and the weights over every head
        temps += 4 * tiled_bytes((qb, n), 4) + tiled_bytes((rows, ps), 4)
    return ring + inputs + outputs + scratch + temps


def _smem_bytes(qb: int, n: int) -> int:
    """SMEM of one grid step: the two union lists of qb * N entries, double-buffered."""
    return 4 * qb * n * 4


# Rows of v7x's MXU (256 x 256): a query block of fewer rows leaves it partly idle, which a
# flops bound would not show, so `_query_block` goes below 8 queries only down to this many rows.
MXU_ROWS = 256

# v7x's bf16 MXU flops per byte of HBM: 2,307 TFLOP/s against 7.37 TB/s a chip (the rates
# cp_runtime/aot/roofline.py prices with; tests/kernels/test_kernels.py holds the two equal).
MXU_FLOPS_PER_HBM_BYTE = 313


def _bound(qb: int, b: int, nq: int, h: int, d: int, n: int, pool_pages: int, ps: int,
           value_dim: int, c: int, qi: int, words: int = 0) -> tuple[int, int]:
    """(HBM bytes, flops) of one call at the union's upper bound, for query blocks of qb
    (the module doc's formulas; `words`: W with masks)."""
    nqb = cdiv(nq, qb)
    union = min(qb * n, pool_pages)        # distinct pages a block can reach
    nbytes = (b * nq * h * d * qi + b * nq * n * (1 + words) * 4
              + b * nqb * union * (ps * d * c + 8) + b * nq * h * (value_dim + 1) * 4)
    return nbytes, 2 * b * nqb * union * qb * h * ps * (d + value_dim)


def _query_block(q, kv_cache, n: int, value_dim: int, query_block: int, words: int = 0) -> int:
    """The query block whose bound costs least: of min(query_block, Q), its halves down to 8
    (or fewer queries while their qb * H rows still fill the MXU's MXU_ROWS: 4 with 64
    heads), those within the v7x VMEM and SMEM budgets, the one with the smallest
    max(flops / MXU rate, bytes / HBM rate) at the union's bound (the larger on a tie:
    neighbouring queries share pages, so real unions favour larger blocks). `words`: W with
    masks, 0 without.

    Why not simply the largest: a block's union may be qb * N distinct pages, each scored for
    all qb * H rows, so once scoring a page takes the MXU longer than fetching it, the bound's
    flops grow with qb while its bytes do not. GLM-5.2's gather_kv prefill (4 heads a device,
    64 x 640 fp8 pages) breaks even at ~87 rows: 16 queries, not 64 (4x the flops, 2.9x the
    time of a late chunk's bound); a chunk early in a prompt, whose cache holds fewer pages
    than 16 blocks reach, keeps larger blocks.
    """
    b, nq, h, d = q.shape
    ps, pool_pages = kv_cache.shape[1], kv_cache.shape[0]
    c, qi = np.dtype(kv_cache.dtype).itemsize, np.dtype(q.dtype).itemsize
    largest = fit_block(lambda qb: _vmem_bytes(qb, h, d, n, ps, value_dim, c, qi, words),
                        min(query_block, nq), lambda qb: _smem_bytes(qb, n))
    smallest = min(8, max(1, MXU_ROWS // h))
    blocks = [largest]
    while blocks[-1] > smallest:
        blocks.append(max(smallest, blocks[-1] // 2))

    def priced(qb: int) -> float:
        return _priced(*_bound(qb, b, nq, h, d, n, pool_pages, ps, value_dim, c, qi, words))

    return min(blocks, key=lambda qb: (priced(qb), -qb))


def _priced(nbytes: int, flops: int) -> float:
    """A bound's time as HBM bytes: its bytes, or its flops at the MXU's pace if slower."""
    return max(flops / MXU_FLOPS_PER_HBM_BYTE, nbytes)


def priced_bound(q, kv_cache, n: int, value_dim: int, query_block: int = 64,
                 mask_words: int = 0) -> float:
    """The time of one call at its bound (`cost`'s), as the HBM bytes that would take as long
    on v7x: max(bytes, flops / MXU_FLOPS_PER_HBM_BYTE). q, kv_cache: anything with `.shape`
    and `.dtype`; n: entries a query; mask_words: W with token masks, 0 without."""
    sel = jax.ShapeDtypeStruct((*q.shape[:2], n), jnp.int32)
    masks = jax.ShapeDtypeStruct((*sel.shape, mask_words), jnp.int32) if mask_words else None
    figures = cost(q, kv_cache, sel, sel, None, value_dim=value_dim, query_block=query_block,
                   sel_masks=masks)
    return _priced(figures["bytes"], figures["flops"])


def cost(q, kv_cache, sel_slots, sel_pages, q_pos, *, value_dim: int, scale: float = 1.0,
         query_block: int = 64, sel_masks=None) -> dict:
    """Grid, blocks, VMEM and SMEM bytes, and the upper bounds of HBM bytes and flops of one
    call.

    Takes the kernel's arguments or anything with `.shape`/`.dtype` (jax.ShapeDtypeStruct).
    """
    del sel_pages, q_pos, scale
    b, nq, h, d = q.shape
    n = sel_slots.shape[-1]
    ps = kv_cache.shape[1]
    c, qi = np.dtype(kv_cache.dtype).itemsize, np.dtype(q.dtype).itemsize
    words = 0 if sel_masks is None else sel_masks.shape[-1]
    qb = _query_block(q, kv_cache, n, value_dim, query_block, words)
    nbytes, flops = _bound(qb, b, nq, h, d, n, kv_cache.shape[0], ps, value_dim, c, qi, words)
    blocks = {"q": (qb, h, d), "sel_slots": (qb, n), "union": (qb * n,), "page": (ps, d),
              "o": (qb, h, value_dim)}
    if words:
        blocks["sel_masks"] = (words, qb, n)
    return {
        "grid": (b, cdiv(nq, qb)),
        "blocks": blocks,
        "vmem_bytes": _vmem_bytes(qb, h, d, n, ps, value_dim, c, qi, words),
        "smem_bytes": _smem_bytes(qb, n),
        "bytes": nbytes,
        "flops": flops,
        "transcendentals": flops // (2 * (d + value_dim)),
    }
