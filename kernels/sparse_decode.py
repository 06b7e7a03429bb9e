"""Sparse MLA decode: the Pallas TPU kernel of `reference.sparse_attention` for Q == 1.

One grid step per sequence. The step's row of the page lists arrives as SMEM blocks; the kernel
first compacts, in SMEM, the entries that have a visible key (slot >= 0 and page start <=
position), so the DMA ring (`packing.page_ring`) only ever waits on pages it uses. Each page is
upcast to the query dtype in VMEM and folded into an online softmax over the H query rows
(shared with `sparse_prefill`). Entries are processed one by one, so a page listed twice counts
twice, as in the reference. Keys past the query's position are zeroed before the dot. The
products' dtypes are those of `sparse_prefill`: the query dtype, f32 accumulation.

Token masks (`sel_masks` i32[B, 1, N, W], W = cdiv(ps, 32); reference.py's module docstring).
Each entry's W words ride beside its slot and page, in the row's SMEM block; its page is still
fetched whole, and the words' bits hide the page's unselected keys from the softmax (as keys
past the position are hidden; no row at or before the position holds garbage, so none is
zeroed for a mask). An entry whose words are all zero gets slot -1 before the kernel
(`reference.live_slots`), so the compaction drops it and its page is never fetched. Entries
still count one by one, so a key two entries reach counts twice.
What the masks cost: 4 W bytes an entry of HBM (16 KiB a row at N = 2,048, ps = 64), and 2 N W
* 4 bytes of SMEM (the row's block, double-buffered); no VMEM beyond a [1, ps] bit row.
The page tables are per-row blocks, not whole-array scalar prefetch, because token selection
makes them long: N = index_topk = 2,048 entries a row, and at B = 64 the two prefetched
tables alone (2 B N * 4 = 1 MiB) overflowed TPU7x's 1 MiB of SMEM ("Used 1.01M of 1.00M
smem"), the masks twice more again.

Worst case, token mode: 2,048 selected tokens on 2,048 distinct pages, each page fetched whole
for one token. GLM-5.2 (D = 640 fp8, ps = 64): a page is ps * D = 40,960 bytes, so a query row
reads 2,048 * 40,960 = 83,886,080 bytes (80 MiB) of pages per layer, over the S shards
together, where the selected rows alone are 2,048 * 640 = 1,310,720 bytes (1.25 MiB): ps =
64 times the rows it needs (page mode's 33 pages read 1,351,680 bytes). At v7x's 7.37 TB/s
that is 11.4 us of one chip's HBM a row a layer against 0.18 us. The masks themselves (16 KiB)
and the tables (16 KiB) are noise beside it.

Grid:   (B,), parallel.
Blocks: q [H, D] VMEM; sel_slots, sel_pages i32[1, N] SMEM per row (from [B, 1, N]); with
        masks, sel_masks i32[1, N * W] SMEM per row (from [B, 1, N * W], entry-major); q_pos
        i32[B] scalar prefetch (SMEM);
        kv cache T[P + 1, ps, D] stays in HBM (pl.ANY), pages DMA'd one at a time; or, given
        `page_dtype`, its pages' words u32[P + 1, ps / pk, D] (kernels/page_words.py: the staged
        pages of a cache held in host memory), each page read as values after its DMA by a
        bitcast, which on a TPU moves nothing;
        out o f32[H, V] and lse f32[H, 1] VMEM; live-entry list i32[N] SMEM scratch.
VMEM:   c = cache itemsize, q = query itemsize
          ring      NB * ps * D * c                 (NB = NUM_BUFFERS)
          inputs    2 * H * D * q
          outputs   2 * H * (V + 1) * 4
          scratch   H * (V + 2) * 4                 (acc, m, l)
          temps     3 * H * ps * 4 + H * ps * q + ps * D * q + H * V * 4
        each counted as Mosaic pads it (vmem.tiled_bytes); e.g. H = 128, D = 640, V = 512,
        ps = 64, fp8, bf16 q: ~1.9 MiB.
SMEM:   (2 * (2 + W) * N + N + B) * 4 bytes (W = 0 without masks): the row's tables
        double-buffered, the live list, the positions. N = 2,048, W = 2, B = 64: 72 KiB.
Per call (upper bound: all B * N entries visible):
        bytes = B*H*D*q + B*N*(ps*D*c + 8 + 4*W) + B*H*(V + 1)*4
        flops = 2 * B*N * H * ps * (D + V)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.packing import check_page_size, page_ring
from cp_runtime.kernels.page_words import from_words, packing
from cp_runtime.kernels.reference import NEG_INF, check_attention_args, live_slots
from cp_runtime.kernels.sparse_prefill import (finalize_softmax, init_softmax, mask_bits,
                                               online_softmax_step)
from cp_runtime.kernels.vmem import tiled_bytes

__all__ = ["NUM_BUFFERS", "sparse_decode", "cost"]

# Ring depth. Decode scores only H rows per page, so by the roofline (see sparse_prefill) a page
# fetch outlasts its compute and the kernel is bound by HBM; a third buffer keeps two fetches in
# flight so DMA latency, not only bandwidth, is covered. Not yet tuned on a TPU.
NUM_BUFFERS = 3


def _decode_kernel(pos_ref,                        # [B] SMEM (scalar prefetch)
                   slots_ref, pages_ref,           # [1, N] SMEM: this row's entries
                   *refs,                          # with masks: [1, N * W] SMEM; then as below
                   scale: float, value_dim: int, num_buffers: int, page_dtype, masked: bool):
    masks_ref, refs = (refs[0], refs[1:]) if masked else (None, refs)
    (q_ref,                                        # [H, D] VMEM
     cache_hbm,                                    # [P + 1, ps, D] HBM
     o_ref,                                        # [H, V] VMEM
     lse_ref,                                      # [H, 1] VMEM
     ring, sems,                                   # [NB, ps, D] VMEM, DMA[NB]
     live_ref,                                     # [N] SMEM
     m_ref, l_ref, acc_ref) = refs                 # [H, 1], [H, 1], [H, V] VMEM
    n = live_ref.shape[0]
    ps = ring.shape[1] * (1 if page_dtype is None else packing(np.dtype(page_dtype).itemsize))
    pos = pos_ref[pl.program_id(0)]
    init_softmax(m_ref, l_ref, acc_ref)

    def keep(j, count):
        # Branch-free compaction: always write, advance only past a visible entry.
        live_ref[count] = j
        visible = (slots_ref[0, j] >= 0) & (pages_ref[0, j] * ps <= pos)
        return count + visible.astype(jnp.int32)

    count = lax.fori_loop(0, n, keep, jnp.int32(0))

    def copies(j, buffer):
        return [pltpu.make_async_copy(cache_hbm.at[slots_ref[0, live_ref[j]]], ring.at[buffer],
                                      sems.at[buffer])]

    def step(j, buffer):
        entry = live_ref[j]
        start = pages_ref[0, entry] * ps
        kv = ring[buffer]
        if page_dtype is not None:                   # [ps / pk, D] words -> [ps, D]
            kv = pltpu.bitcast(kv, page_dtype)
        kv = kv.astype(q_ref.dtype)                  # [ps, D]
        row_pos = start + lax.broadcasted_iota(jnp.int32, (ps, 1), 0)
        kv = jnp.where(row_pos <= pos, kv, 0)                      # keys after the query
        s = lax.dot_general(q_ref[...], kv, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale  # [H, ps]
        key_pos = start + lax.broadcasted_iota(jnp.int32, (1, ps), 1)
        visible = key_pos <= pos                                   # [1, ps]
        if masked:
            words = masks_ref.shape[1] // n
            visible &= mask_bits([masks_ref[0, entry * words + w] for w in range(words)],
                                 ps) != 0
        s = jnp.where(visible, s, NEG_INF)
        online_softmax_step(s, 1.0, kv[:, :value_dim], m_ref, l_ref, acc_ref)

    page_ring(count, num_buffers, copies, step)
    o, lse = finalize_softmax(m_ref, l_ref, acc_ref)
    o_ref[...] = o
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("value_dim", "scale", "query_block", "interpret",
                                             "page_dtype"))
def sparse_decode(q: jax.Array, kv_cache: jax.Array, sel_slots: jax.Array, sel_pages: jax.Array,
                  q_pos: jax.Array, *, value_dim: int, scale: float, query_block: int = 64,
                  interpret: bool = False, page_dtype=None,
                  sel_masks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Pallas twin of `reference.sparse_attention` for one query per sequence.

    q:         f[B, 1, H, D]     the decode query of each sequence
    kv_cache:  T[P + 1, ps, D]   pool layout, read a page at a time; with `page_dtype`, the
                                 pages' words u32[P + 1, ps / pk, D] of values of that dtype
    sel_slots: i32[B, 1, N]      local slot per selected page, -1 = not on this shard / unused
    sel_pages: i32[B, 1, N]      logical page of each entry
    q_pos:     i32[B, 1]         positions, -1 = padding
    sel_masks: i32[B, 1, N, W]   token mask of each entry, or None (page mode)
    query_block: accepted for signature parity with the reference; one query needs no blocking
    returns:   o f32[B, 1, H, value_dim], lse f32[B, 1, H]
    """
    del query_block
    check_attention_args(q, _as_pages(kv_cache, page_dtype), sel_slots, sel_pages, q_pos,
                         value_dim, sel_masks)
    b, nq, h, d = q.shape
    if nq != 1:
        raise ValueError(f"sparse_decode takes one query per sequence, got Q={nq}; "
                         "use sparse_prefill")
    n = sel_slots.shape[-1]
    check_page_size(_as_pages(kv_cache, page_dtype).shape[1])
    figures = cost(q, _as_pages(kv_cache, page_dtype), sel_slots, sel_pages, q_pos,
                   value_dim=value_dim, sel_masks=sel_masks)
    kernel = functools.partial(_decode_kernel, scale=scale, value_dim=value_dim,
                               num_buffers=NUM_BUFFERS, page_dtype=page_dtype,
                               masked=sel_masks is not None)
    # Each row's tables as [B, 1, .] arrays, so a row's block keeps the array's last two dims.
    tables = [live_slots(sel_slots, sel_masks).astype(jnp.int32).reshape(b, 1, n),
              sel_pages.astype(jnp.int32).reshape(b, 1, n)]
    if sel_masks is not None:
        tables.append(sel_masks.reshape(b, 1, -1))
    o, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(b,),
            in_specs=[
                *(pl.BlockSpec((None, 1, t.shape[-1]), lambda bi, *_: (bi, 0, 0),
                               memory_space=pltpu.SMEM) for t in tables),
                pl.BlockSpec((None, None, h, d), lambda bi, *_: (bi, 0, 0, 0)),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=[
                pl.BlockSpec((None, None, h, value_dim), lambda bi, *_: (bi, 0, 0, 0)),
                pl.BlockSpec((None, None, h, 1), lambda bi, *_: (bi, 0, 0, 0)),
            ],
            scratch_shapes=[
                pltpu.VMEM((NUM_BUFFERS, *kv_cache.shape[1:]), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((NUM_BUFFERS,)),
                pltpu.SMEM((n,), jnp.int32),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, 1), jnp.float32),
                pltpu.VMEM((h, value_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, 1, h, value_dim), jnp.float32),
            jax.ShapeDtypeStruct((b, 1, h, 1), jnp.float32),
        ],
        **call_options("sparse_decode", figures, ("parallel",), interpret),
    )(q_pos.astype(jnp.int32).reshape(-1), *tables, q, kv_cache)
    return o, lse[..., 0]


def _as_pages(kv_cache, page_dtype):
    """The shape and dtype of the pages `kv_cache` holds, words or values."""
    if page_dtype is None:
        return kv_cache
    return jax.eval_shape(lambda w: from_words(w, page_dtype), kv_cache)


def cost(q, kv_cache, sel_slots, sel_pages, q_pos, *, value_dim: int, scale: float = 1.0,
         query_block: int = 64, sel_masks=None) -> dict:
    """Grid, blocks, VMEM and SMEM bytes, and the upper bounds of HBM bytes and flops of one
    call.

    Takes the kernel's arguments or anything with `.shape`/`.dtype` (jax.ShapeDtypeStruct).
    """
    del sel_pages, q_pos, scale, query_block
    b, _, h, d = q.shape
    n = sel_slots.shape[-1]
    words = 0 if sel_masks is None else sel_masks.shape[-1]
    ps = kv_cache.shape[1]
    c, qi = np.dtype(kv_cache.dtype).itemsize, np.dtype(q.dtype).itemsize
    vmem = (NUM_BUFFERS * tiled_bytes((ps, d), c) + 2 * tiled_bytes((h, d), qi)
            + 2 * (tiled_bytes((h, value_dim), 4) + tiled_bytes((h, 1), 4))
            + tiled_bytes((h, value_dim), 4) + 2 * tiled_bytes((h, 1), 4)
            + 3 * tiled_bytes((h, ps), 4) + tiled_bytes((h, ps), qi) + tiled_bytes((ps, d), qi)
            + tiled_bytes((h, value_dim), 4))
    return {
        "grid": (b,),
        "blocks": {"q": (h, d), "page": (ps, d), "o": (h, value_dim)},
        "vmem_bytes": vmem,
        "smem_bytes": (2 * (2 + words) * n + n + b) * 4,
        "bytes": (b * h * d * qi + b * n * (ps * d * c + 8 + 4 * words)
                  + b * h * (value_dim + 1) * 4),
        "flops": 2 * b * n * h * ps * (d + value_dim),
        "transcendentals": b * n * h * ps,
    }
