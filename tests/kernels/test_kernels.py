"""Pallas kernels in TPU interpret mode (on the CPU) against their XLA references.

Every pool is one shard's share of sessions of different lengths; unused pages, the
sentinel and the unwritten tail of each session's last page hold NaN, so a kernel that reads (and
does not mask) a row it should not see fails loudly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.cache.layout import cdiv
from cp_runtime.kernels import page_words, reference
from cp_runtime.kernels.cache_write import (owned_tiles_bound, tiles_bound, write_kv,
                                            write_tile_rows)
from cp_runtime.kernels.dispatch import select_kernels
from cp_runtime.kernels.indexer import indexer_page_scores
from cp_runtime.kernels.packing import check_page_size, packing, tile_rows
from cp_runtime.kernels.sparse_decode import cost as sparse_decode_cost
from cp_runtime.kernels.sparse_decode import sparse_decode
from cp_runtime.aot.roofline import TPU7X_DEVICE
from cp_runtime.kernels.sparse_prefill import MXU_FLOPS_PER_HBM_BYTE, block_union, sparse_prefill
from cp_runtime.kernels.sparse_prefill import cost as sparse_prefill_cost
from cp_runtime.kernels.xla_sparse import sparse_attention_owned

PS, D, H, V = 16, 256, 4, 192    # page size, cached row width, heads, value width
HI, DI = 4, 128                  # indexer heads and head width
SCALE = D ** -0.5

CACHE_DTYPES = {
    "bf16": jnp.bfloat16,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}

# (max abs error, rel-L2) bounds of kernel vs reference on the same cache. With f32 queries
# (the kernels run in the query dtype) both upcast the cache exactly (bf16 and fp8 values are bf16
# values) and form the same f32 products, so all that differs is the order of f32 sums: an
# online softmax page by page vs one softmax over all keys, a 2-D dot vs an einsum, a head sum
# after vs inside the contraction. Bounds sit ~4x above the measured worst case on these shapes,
# so a reordering passes while a wrong mask or a dropped page (errors of order 1e-2 and up)
# fails. The cache dtype does not enter the error, hence equal rows. The bf16 queries of the TPU
# path add the probabilities' rounding (PV_ROUNDING below).
TOLERANCE = {
    # |o| <= 3, |lse| <= 5.2, <= 6 pages of 16 keys; measured over both kernels max 9.5e-7,
    # rel-L2 1.6e-7.
    ("attention", "bf16"): (4e-6, 1e-6),
    # Same sums over coarser (still exact) values; measured max 5.4e-7, rel-L2 1.0e-7.
    ("attention", "fp8_e4m3"): (4e-6, 1e-6),
    # Same; measured max 4.8e-7, rel-L2 1.0e-7.
    ("attention", "fp8_e5m2"): (4e-6, 1e-6),
    # |score| <= 62: sums of 4 heads of ReLU(q . k) over Di = 128, so one f32 ulp of the largest
    # score is 3.8e-6; measured max 1.9e-6, rel-L2 1.7e-8.
    ("indexer", "bf16"): (4e-5, 4e-7),
    # Same scale; measured max 3.8e-6 (one ulp at 62), rel-L2 3.3e-8.
    ("indexer", "fp8_e4m3"): (4e-5, 4e-7),
    # Same scale; measured max 0 (this draw sums in the same order), rel-L2 0.
    ("indexer", "fp8_e5m2"): (4e-5, 4e-7),
}


# With bf16 queries the kernels run PV on probabilities rounded to bf16 (the QK products stay
# exact: bf16 queries times bf16-exact pages). Rounding to nearest moves each probability by at
# most 2^-9 of itself, and o is a convex mix of value rows, so o moves by at most 2^-9 * max|v|
# (+ the f32 bound above); lse sums the f32 probabilities and keeps the f32 bounds. Measured on
# these shapes: o max 3.5e-3 against a bound of 8.8e-3 (max|v| = 4.5), rel-L2 8.7e-4 (prefill,
# e4m3; decode 1.8e-3 and 4.5e-4), bound 4e-3.
PV_ROUNDING = 2.0 ** -9
PV_REL_L2_BOUND = 4e-3

# Query dtypes the attention kernels are checked at: f32 (an f32 kernel) and bf16 (the TPU
# path's, kernels/dispatch.py).
QUERY_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def rel_l2(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def assert_matches(out, ref, kernel: str, dtype_name: str) -> None:
    """Same -inf pattern exactly; finite entries within the table's bounds; no NaN anywhere."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out).any(), "kernel produced NaN (read an unused row?)"
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    finite = np.isfinite(ref)
    max_abs, max_rel = TOLERANCE[(kernel, dtype_name)]
    err = np.abs(out[finite] - ref[finite])
    assert err.max(initial=0.0) <= max_abs, f"max abs error {err.max()} > {max_abs}"
    assert rel_l2(out[finite], ref[finite]) <= max_rel


def assert_attention_matches(out, ref, cache, cache_name: str, query_name: str) -> None:
    """Kernel (o, lse) against the reference's: f32 bounds throughout for f32 queries; for bf16
    queries lse within them and o within the probabilities' rounding of the cache's values."""
    (o, lse), (ro, rlse) = out, ref
    assert o.shape == ro.shape and lse.shape == rlse.shape
    assert_matches(lse, rlse, "attention", cache_name)
    if query_name == "f32":
        assert_matches(o, ro, "attention", cache_name)
        return
    o, ro = np.asarray(o, np.float32), np.asarray(ro, np.float32)
    values = np.asarray(cache.astype(jnp.float32))[..., :V]
    max_v = np.abs(values[np.isfinite(values)]).max()
    assert not np.isnan(o).any(), "kernel produced NaN (read an unused row?)"
    max_abs = PV_ROUNDING * max_v + TOLERANCE[("attention", cache_name)][0]
    assert np.abs(o - ro).max() <= max_abs, f"max abs error {np.abs(o - ro).max()} > {max_abs}"
    assert rel_l2(o, ro) <= PV_REL_L2_BOUND


# ---- scenario builders ------------------------------------------------------------------------

def session_pool(rng, dtype, lengths, *, num_shards=1, shard=0, width=D, spare=2, ps=PS):
    """This shard's cache of sessions with `lengths` tokens, and where each logical page sits.

    returns: cache T[P + 1, ps, width]; slot_of {(session, logical page): slot}
    """
    owned = [(b, p) for b, n in enumerate(lengths) for p in range(cdiv(n, ps))
             if p % num_shards == shard]
    num_pages = len(owned) + spare
    slots = rng.permutation(num_pages)[:len(owned)]
    cache = np.full((num_pages + 1, ps, width), np.nan, np.float32)
    for (b, p), slot in zip(owned, slots):
        rows = min(ps, lengths[b] - p * ps)
        cache[slot, :rows] = rng.standard_normal((rows, width))
    slot_of = {key: int(slot) for key, slot in zip(owned, slots)}
    return jnp.asarray(cache).astype(dtype), slot_of


def select_pages(rng, q_pos, slot_of, n, ps=PS):
    """Per query up to n distinct logical pages at or before it (its own page always among
    them), then -1 entries; entries on other shards get slot -1.

    returns: sel_slots, sel_pages i32[B, Q, n]
    """
    b, nq = q_pos.shape
    slots = np.full((b, nq, n), -1, np.int32)
    pages = np.zeros((b, nq, n), np.int32)
    for i in range(b):
        for j in range(nq):
            if q_pos[i, j] < 0:
                continue
            own = q_pos[i, j] // ps
            earlier = rng.permutation(own)[:n - 1]
            chosen = np.concatenate([[own], earlier]).astype(np.int32)
            pages[i, j, :len(chosen)] = chosen
            slots[i, j, :len(chosen)] = [slot_of.get((i, p), -1) for p in chosen]
    return slots, pages


def attention_inputs(dtype, lengths, q_pos, *, n, seed=0, ps=PS):
    rng = np.random.default_rng(seed)
    cache, slot_of = session_pool(rng, dtype, lengths, ps=ps)
    slots, pages = select_pages(rng, q_pos, slot_of, n, ps)
    q = jnp.asarray(rng.standard_normal((*q_pos.shape, H, D)), jnp.bfloat16)
    return q, cache, slots, pages, slot_of


# ---- packing ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,pk,rows", [(jnp.float8_e4m3fn, 4, 32), (jnp.bfloat16, 2, 16),
                                           (jnp.float32, 1, 8)])
def test_tile_rows_follow_packing(dtype, pk, rows):
    assert packing(dtype) == pk and tile_rows(dtype) == rows


def test_page_size_not_multiple_of_16_is_refused():
    cache = jnp.zeros((3, 24, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="page_size=24"):
        check_page_size(24)
    q = jnp.zeros((1, 1, H, D), jnp.bfloat16)
    sel = jnp.zeros((1, 1, 2), jnp.int32)
    pos = jnp.zeros((1, 1), jnp.int32)
    for kernel in (sparse_prefill, sparse_decode):
        with pytest.raises(ValueError, match="page_size=24"):
            kernel(q, cache, sel, sel, pos, value_dim=V, scale=SCALE, interpret=True)
    qi = jnp.zeros((1, 1, HI, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="page_size=24"):
        indexer_page_scores(qi, jnp.zeros((1, 1, HI)), cache, sel[0], pos, jnp.int32(0),
                            num_shards=1, key_block_pages=1, interpret=True)


# ---- cache write ------------------------------------------------------------------------------

def _assert_same_bits(x, y):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("name", CACHE_DTYPES)
@pytest.mark.parametrize("new_dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_is_bit_exact(name, new_dtype):
    """Scattered rows (decode-like): each lands in a tile of its own or shares one; rows aimed
    at the sentinel are dropped by the kernel, written by the reference; every other page is
    bit-identical."""
    rng = np.random.default_rng(1)
    pages = 5
    cache = jnp.asarray(rng.standard_normal((pages + 1, PS, D)), jnp.float32)
    cache = cache.astype(CACHE_DTYPES[name])
    rows = 11
    flat = rng.permutation(pages * PS)[:rows]
    slots, offsets = flat // PS, flat % PS
    slots[[3, 7]] = pages  # discarded rows go to the sentinel (distinct offsets)
    new = jnp.asarray(rng.standard_normal((rows, D)) * 4, new_dtype)
    out = write_kv(cache, new, jnp.asarray(slots), jnp.asarray(offsets), interpret=True)
    ref = reference.write_kv(cache, new, jnp.asarray(slots), jnp.asarray(offsets))
    assert out.dtype == cache.dtype
    _assert_same_bits(out[:pages], ref[:pages])
    _assert_same_bits(out[pages], cache[pages])             # the sentinel is never written
    assert (np.asarray(out).view(np.uint8) != np.asarray(cache).view(np.uint8)).any()


@pytest.mark.parametrize("name", CACHE_DTYPES)
@pytest.mark.parametrize("start", [0, 5, PS - 1])
def test_write_kv_chunk_of_consecutive_rows(name, start):
    """A prefill chunk: consecutive positions over several pages, whole tiles and partial ones
    at both ends, with the tile bound a step passes (`tiles_bound`)."""
    rng = np.random.default_rng(start)
    pages = 6
    dtype = CACHE_DTYPES[name]
    cache = jnp.asarray(rng.standard_normal((pages + 1, PS, D)), jnp.float32).astype(dtype)
    rows = 3 * PS + 3
    table = rng.permutation(pages)[:5]                       # logical page -> slot
    pos = start + np.arange(rows)
    slots, offsets = table[pos // PS].astype(np.int32), (pos % PS).astype(np.int32)
    new = jnp.asarray(rng.standard_normal((rows, D)), jnp.float32)
    bound = tiles_bound(1, rows, write_tile_rows(cache.shape, cache.dtype))
    out = write_kv(cache, new, jnp.asarray(slots), jnp.asarray(offsets), max_tiles=bound,
                   interpret=True)
    ref = reference.write_kv(cache, new, jnp.asarray(slots), jnp.asarray(offsets))
    _assert_same_bits(out, ref)


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("shard,rotation,start", [(0, 0, 0), (1, 3, 37), (3, 1, 100)])
def test_write_kv_of_a_shards_own_pages(name, shard, rotation, start):
    """A shard's own write of a prefill chunk: pages go round-robin over 4 shards, the shard's
    rows land in its slots and the rest at the sentinel, with `owned_tiles_bound` (pages of
    64 rows: two fp8 tiles or four bf16 tiles a page) as the kernel's bound."""
    rng = np.random.default_rng(shard)
    ps, d, shards, rows = 64, 128, 4, 9 * 64 + 5
    dtype = CACHE_DTYPES[name]
    pos = start + np.arange(rows)
    page = pos // ps
    owned = (page + rotation) % shards == shard
    local = (page + rotation) // shards
    slots_of_local = rng.permutation(local.max() + 1)                  # local page -> slot
    sentinel = len(slots_of_local)
    cache = jnp.asarray(rng.standard_normal((sentinel + 1, ps, d)), jnp.float32).astype(dtype)
    slots = np.where(owned, slots_of_local[local], sentinel).astype(np.int32)
    offsets = (pos % ps).astype(np.int32)
    new = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    bound = owned_tiles_bound(1, rows, ps, shards, write_tile_rows(cache.shape, dtype))
    assert bound < tiles_bound(1, rows, write_tile_rows(cache.shape, dtype))
    out = write_kv(cache, new, jnp.asarray(slots), jnp.asarray(offsets), max_tiles=bound,
                   interpret=True)
    ref = reference.write_kv(cache, new, jnp.asarray(slots), jnp.asarray(offsets))
    _assert_same_bits(out[:sentinel], ref[:sentinel])


@pytest.mark.parametrize("tile", [8, 16, 32, 64])
def test_owned_tiles_bound_holds_for_every_start(tile):
    """The distinct tiles a shard's pages take from Q consecutive positions never exceed
    `owned_tiles_bound`, for every start, shard and rotation, and come within a page's tiles
    of it (it counts both partial end pages whole)."""
    ps, shards = 64, 4
    for q in (1, 5, 64, 65, 300, 1024):
        bound = owned_tiles_bound(1, q, ps, shards, tile)
        most = 0
        for start in range(2 * shards * ps):
            pos = start + np.arange(q)
            page = pos // ps
            for shard in range(shards):
                mine = (page % shards) == shard         # a rotation is a shift of `start`
                most = max(most, len(set(pos[mine] // tile)))
        assert most <= bound, (q, tile, most, bound)
        assert most > bound - max(1, ps // tile), (q, tile, most, bound)


def test_write_kv_rejects_wrong_width():
    with pytest.raises(ValueError, match="do not match"):
        write_kv(jnp.zeros((2, PS, D)), jnp.zeros((1, D + 1)), jnp.zeros(1, jnp.int32),
                 jnp.zeros(1, jnp.int32), interpret=True)


# ---- indexer ----------------------------------------------------------------------------------

def indexer_inputs(dtype, *, shard, num_shards, nq, seed=2):
    """Sessions of 70, 9 and 40 tokens; queries at the end of each (9 fills only part)."""
    rng = np.random.default_rng(seed)
    lengths = [70, 9, 40]
    cache, slot_of = session_pool(rng, dtype, lengths, num_shards=num_shards, shard=shard,
                                  width=DI)
    sentinel = cache.shape[0] - 1
    m = cdiv(cdiv(max(lengths), PS), num_shards)
    local = np.full((len(lengths), m), sentinel, np.int32)
    for (b, p), slot in slot_of.items():
        local[b, p // num_shards] = slot
    local[1, -1] = -1  # a missing page given as -1 rather than the sentinel
    q_pos = np.full((len(lengths), nq), -1, np.int32)
    for b, n in enumerate(lengths):
        take = min(nq - 1, n)  # keep one padding query per session
        q_pos[b, :take] = np.arange(n - take, n)
    q_pos[0, 0] = 0  # a query with no earlier page
    q = jnp.asarray(rng.standard_normal((len(lengths), nq, HI, DI)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(lengths), nq, HI)), jnp.float32)
    return q, w, cache, jnp.asarray(local), jnp.asarray(q_pos)


@pytest.mark.parametrize("name", CACHE_DTYPES)
@pytest.mark.parametrize("shard", [0, 1])
def test_indexer_matches_reference(name, shard):
    args = indexer_inputs(CACHE_DTYPES[name], shard=shard, num_shards=2, nq=6)
    statics = dict(num_shards=2, key_block_pages=2)  # M = 3 local pages: a partial key block
    out = indexer_page_scores(*args, jnp.int32(shard), **statics, interpret=True)
    ref = reference.indexer_page_scores(*args, jnp.int32(shard), **statics)
    assert_matches(out, ref, "indexer", name)
    assert np.isfinite(np.asarray(out)).any() and np.isneginf(np.asarray(out)).any()


def test_indexer_rotation_matches_reference_and_shifts_logical_pages():
    """Rotated rows: local page j of shard s holds logical page j * S + s - r. The kernel agrees
    with the reference, and (S = 2) shard 1 at rotation 1 scores what shard 0 does at 0."""
    args = indexer_inputs(jnp.bfloat16, shard=0, num_shards=2, nq=6)
    statics = dict(num_shards=2, key_block_pages=2)
    rotation = jnp.asarray([1, 0, 1], jnp.int32)
    out = indexer_page_scores(*args, jnp.int32(1), rotation, **statics, interpret=True)
    ref = reference.indexer_page_scores(*args, jnp.int32(1), rotation, **statics)
    assert_matches(out, ref, "indexer", "bf16")
    unrotated = reference.indexer_page_scores(*args, jnp.int32(0), **statics)
    for row in (0, 2):
        np.testing.assert_array_equal(np.asarray(ref[row]), np.asarray(unrotated[row]))


def test_indexer_spans_query_blocks():
    # 40 queries: two query blocks of 32, the second mostly padding.
    args = indexer_inputs(jnp.bfloat16, shard=0, num_shards=1, nq=40)
    out = indexer_page_scores(*args, jnp.int32(0), num_shards=1, key_block_pages=3,
                              interpret=True)
    ref = reference.indexer_page_scores(*args, jnp.int32(0), num_shards=1, key_block_pages=3)
    assert_matches(out, ref, "indexer", "bf16")



def test_tpu_path_scores_the_indexer_queries_in_bf16():
    """The Pallas kernel set hands the indexer its f32 queries as bf16 (kernels/dispatch.py):
    its scores are the kernel's at the rounded queries, to the bit, and not the f32 ones'."""
    q, *rest = indexer_inputs(jnp.bfloat16, shard=0, num_shards=1, nq=6)
    q = q.astype(jnp.float32) * jnp.float32(1 + 2 ** -12)   # off the bf16 grid
    statics = dict(num_shards=1, key_block_pages=2)
    got = select_kernels("pallas_interpret").indexer_page_scores(q, *rest, jnp.int32(0),
                                                                   **statics)
    rounded = indexer_page_scores(q.astype(jnp.bfloat16), *rest, jnp.int32(0), **statics,
                                  interpret=True)
    unrounded = indexer_page_scores(q, *rest, jnp.int32(0), **statics, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rounded))
    assert not np.array_equal(np.asarray(got), np.asarray(unrounded))


@pytest.mark.parametrize("nq", [1, 10])
def test_tpu_path_runs_attention_on_bf16_queries(nq):
    """The Pallas kernel set hands the attention kernels (decode at one query, prefill at more)
    their f32 queries as bf16 (kernels/dispatch.py): the result is the kernel's at the rounded
    queries, to the bit, and not the f32 ones'."""
    q, cache, slots, pages, q_pos = prefill_case(jnp.bfloat16)
    q = q.astype(jnp.float32)[:, :nq] * jnp.float32(1 + 2 ** -12)   # off the bf16 grid
    args = (cache, slots[:, :nq], pages[:, :nq], q_pos[:, :nq])
    statics = dict(value_dim=V, scale=SCALE, query_block=4)
    kernel = sparse_decode if nq == 1 else sparse_prefill
    got = select_kernels("pallas_interpret").sparse_attention(q, *args, **statics)
    rounded = kernel(q.astype(jnp.bfloat16), *args, **statics, interpret=True)
    unrounded = kernel(q, *args, **statics, interpret=True)
    for g, r in zip(got, rounded):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(unrounded[0]))


# ---- sparse prefill ---------------------------------------------------------------------------

def test_block_union_matches_sets():
    rng = np.random.default_rng(3)
    qb, n = 4, 3
    slots = rng.integers(-1, 6, (2, 8, n)).astype(np.int32)
    pages = (slots + 1).astype(np.int32)          # slot s holds logical page s + 1
    q_pos = rng.integers(-1, 6 * PS, (2, 8)).astype(np.int32)
    us, up, count = block_union(jnp.asarray(slots), jnp.asarray(pages), jnp.asarray(q_pos),
                                page_size=PS, query_block=qb)
    for b in range(2):
        for i in range(2):
            block = slice(i * qb, (i + 1) * qb)
            want = {(s, p) for s, p, t in zip(slots[b, block].ravel(), pages[b, block].ravel(),
                                               np.repeat(q_pos[b, block], n))
                    if s >= 0 and p * PS <= t}
            c = int(count[b, i])
            got = set(zip(np.asarray(us[b, i, :c]).tolist(), np.asarray(up[b, i, :c]).tolist()))
            assert c == len(want) and got == want


def test_prefill_cost_bounds_the_union_by_the_cache():
    """The estimate's pages a block: qb * N where the cache holds more, the cache's pages
    where it holds fewer (a block's union is distinct slots of it), and never below a union
    the kernel really visits."""
    q, cache, slots, pages, q_pos = prefill_case(jnp.bfloat16)
    b, nq, h, d = q.shape
    n, per_page = slots.shape[-1], cache.shape[1] * (d + V)

    def unions(pool_pages: int) -> int:
        pool = jax.ShapeDtypeStruct((pool_pages, *cache.shape[1:]), cache.dtype)
        figures = sparse_prefill_cost(q, pool, slots, pages, q_pos, value_dim=V, query_block=4)
        return figures["flops"] // (2 * b * cdiv(nq, 4) * 4 * h * per_page)

    assert (unions(40), unions(cache.shape[0]), unions(3)) == (4 * n, cache.shape[0], 3)
    *_, count = block_union(slots[:, :8], pages[:, :8], q_pos[:, :8],
                            page_size=cache.shape[1], query_block=4)
    assert 0 < int(np.max(count)) <= unions(cache.shape[0])


def _bound_seconds(figures: dict) -> float:
    return max(figures["flops"] / TPU7X_DEVICE.bf16_flops,
               figures["bytes"] / TPU7X_DEVICE.hbm_bytes_per_s)


@pytest.mark.parametrize("heads, pool_pages, block", [
    (4, 18_000, 16),     # GLM-5.2's gather_kv heads, a late chunk: the page-fetch break-even
    (4, 145, 64),        # the same, a prompt's first chunk: its cache caps every block's union
    (8, 18_000, 8),      # DeepSeek-V3.2's gather_kv heads
    (64, 18_000, 4),     # GLM-5.2's every head, the rows split: 4 queries fill the MXU's rows
    (128, 18_000, 2),    # DeepSeek-V3.2's every head
])
def test_prefill_query_block_has_the_least_bound(heads, pool_pages, block):
    """The kernel's query block is the one whose bound the compiler prices lowest, below 8
    queries only while its rows fill the MXU's 256; a smaller largest block (query_block) can
    only price the same or more."""
    q = jax.ShapeDtypeStruct((1, 8192, heads, 640), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((pool_pages, 64, 640), jnp.float8_e4m3fn)
    sel, pos = jax.ShapeDtypeStruct((1, 8192, 33), jnp.int32), jax.ShapeDtypeStruct((1, 8192),
                                                                                  jnp.int32)
    figures = {qb: sparse_prefill_cost(q, pool, sel, sel, pos, value_dim=512, query_block=qb)
               for qb in (8, 16, 32, 64)}
    assert figures[64]["blocks"]["q"][0] == block
    assert all(_bound_seconds(figures[64]) <= _bound_seconds(f) for f in figures.values())


def test_prefill_rates_are_the_rooflines():
    assert MXU_FLOPS_PER_HBM_BYTE == round(TPU7X_DEVICE.bf16_flops
                                           / TPU7X_DEVICE.hbm_bytes_per_s)


def prefill_case(dtype):
    """Sessions of 70, 9 and 40 tokens; 10 queries each, blocks of 4 (the last one padded).

    Session 1 holds one page, so its queries start with no earlier page and N = 6 exceeds its
    page count; its last query slot is padding.
    """
    lengths = [70, 9, 40]
    q_pos = np.stack([np.arange(60, 70), np.r_[np.arange(9), -1], np.arange(25, 35)])
    q, cache, slots, pages, slot_of = attention_inputs(dtype, lengths, q_pos.astype(np.int32),
                                                       n=6)
    slots[0, 1, -1], pages[0, 1, -1] = slots[0, 1, 0], pages[0, 1, 0]  # a page listed twice
    # A page after the query: hidden for this query, visible to others in its block.
    slots[2, 4, -1], pages[2, 4, -1] = slot_of[(2, 2)], 2
    return q, cache, jnp.asarray(slots), jnp.asarray(pages), jnp.asarray(q_pos, jnp.int32)


@pytest.mark.parametrize("query", QUERY_DTYPES)
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_sparse_prefill_matches_reference(name, query):
    q, *args = prefill_case(CACHE_DTYPES[name])
    statics = dict(value_dim=V, scale=SCALE, query_block=4)
    o, lse = sparse_prefill(q.astype(QUERY_DTYPES[query]), *args, **statics, interpret=True)
    ref = reference.sparse_attention(q, *args, **statics)
    assert_attention_matches((o, lse), ref, args[0], name, query)
    assert np.isneginf(np.asarray(lse[1, -1])).all()  # the padding query


# ---- sparse decode ----------------------------------------------------------------------------

def decode_case(dtype):
    """Sessions of 70, 1, 40 and 17 tokens: a query on a partial last page, one at position 0, a
    padding query, and one on the first row of a page; N = 6 exceeds every page count."""
    lengths = [70, 1, 40, 17]
    q_pos = np.array([[69], [0], [-1], [16]], np.int32)
    q, cache, slots, pages, _ = attention_inputs(dtype, lengths, q_pos, n=6, seed=4)
    slots[3, 0, -1], pages[3, 0, -1] = slots[3, 0, 0], pages[3, 0, 0]  # a page listed twice
    return q, cache, jnp.asarray(slots), jnp.asarray(pages), jnp.asarray(q_pos)


@pytest.mark.parametrize("query", QUERY_DTYPES)
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_sparse_decode_matches_reference(name, query):
    q, *args = decode_case(CACHE_DTYPES[name])
    statics = dict(value_dim=V, scale=SCALE)
    out = sparse_decode(q.astype(QUERY_DTYPES[query]), *args, **statics, interpret=True)
    ref = reference.sparse_attention(q, *args, **statics)
    assert_attention_matches(out, ref, args[0], name, query)


def test_bounds_catch_a_dropped_page():
    # Both query dtypes' attention bounds must see one page missing from one query's list.
    q, cache, slots, pages, q_pos = decode_case(jnp.bfloat16)
    o, _ = sparse_decode(q, cache, slots, pages, q_pos, value_dim=V, scale=SCALE, interpret=True)
    dropped = slots.at[0, 0, 1].set(-1)
    ro, _ = reference.sparse_attention(q, cache, dropped, pages, q_pos, value_dim=V, scale=SCALE)
    values = np.asarray(cache.astype(jnp.float32))[..., :V]
    bf16_bound = PV_ROUNDING * np.abs(values[np.isfinite(values)]).max()
    max_abs, _ = TOLERANCE[("attention", "bf16")]
    assert np.abs(np.asarray(o) - np.asarray(ro)).max() > 10 * (bf16_bound + max_abs)


def test_sparse_decode_rejects_query_blocks():
    q, cache, slots, pages, q_pos = prefill_case(jnp.bfloat16)
    with pytest.raises(ValueError, match="Q=10"):
        sparse_decode(q, cache, slots, pages, q_pos, value_dim=V, scale=SCALE, interpret=True)


@pytest.mark.parametrize("kernel", [sparse_prefill, sparse_decode])
def test_shard_owning_no_selected_page_gives_empty_result(kernel):
    q, cache, slots, pages, q_pos = decode_case(jnp.float8_e4m3fn)
    none = jnp.full_like(slots, -1)  # every selected page lives on another shard
    o, lse = kernel(q, cache, none, pages, q_pos, value_dim=V, scale=SCALE, interpret=True)
    np.testing.assert_array_equal(np.asarray(o), 0.0)
    assert np.isneginf(np.asarray(lse)).all()


# ---- token masks ------------------------------------------------------------------------------
# Token-level selection (reference.py's module docstring): each entry carries a mask of its
# page's tokens. Pages of 64 tokens take two words, so token 31 and token 63 are each a word's
# sign bit, which a kernel shifting arithmetically would smear over the tokens after it.

MASK_PS = 64


def token_masks(rng, slots, *, empty_query=None):
    """i32[B, Q, N, 2] masks of about a quarter of the tokens; a fifth of the entries all
    zero, every third entry with tokens 31 and 63 (the sign bits) set, and every entry of
    `empty_query` (b, q) zero."""
    shape = (*slots.shape, 2)
    words = (rng.integers(0, 2 ** 32, shape, dtype=np.uint32)
             & rng.integers(0, 2 ** 32, shape, dtype=np.uint32))
    words[rng.random(slots.shape) < 0.2] = 0
    words[..., ::3, :] |= np.uint32(1 << 31)
    if empty_query is not None:
        words[empty_query] = 0
    return jnp.asarray(words.view(np.int32))


def masked_prefill_case(dtype, nq=10, seed=5):
    """Sessions of 300, 9 and 170 tokens on pages of 64, up to nq queries each (blocks of 4),
    N = 6 entries. Query (0, 1) lists its first page twice under another mask (keys in both
    count twice); query (2, 0), at 126, lists page 2 (from 128), hidden from it and seen by
    its block's queries 2 and 3; query (1, 2) has no token at all."""
    lengths = [300, 9, 170]
    q_pos = np.stack([np.arange(290, 300), np.r_[np.arange(9), -1], np.arange(126, 136)])
    q_pos = q_pos[:, :nq].astype(np.int32)
    q, cache, slots, pages, slot_of = attention_inputs(dtype, lengths, q_pos, n=6, seed=seed,
                                                       ps=MASK_PS)
    slots[0, 1, -1], pages[0, 1, -1] = slots[0, 1, 0], pages[0, 1, 0]
    slots[2, 0, -1], pages[2, 0, -1] = slot_of[(2, 2)], 2
    masks = token_masks(np.random.default_rng(seed), slots,
                        empty_query=(1, 2) if nq > 2 else None)
    return q, cache, jnp.asarray(slots), jnp.asarray(pages), jnp.asarray(q_pos), masks


def masked_decode_case(dtype, seed=6):
    """Sessions of 300, 1, 170 and 65 tokens on pages of 64: a query on a partial page, one at
    0, a padding query, one on the first row of a page; session 3 lists a page twice."""
    lengths = [300, 1, 170, 65]
    q_pos = np.array([[299], [0], [-1], [64]], np.int32)
    q, cache, slots, pages, _ = attention_inputs(dtype, lengths, q_pos, n=6, seed=seed,
                                                 ps=MASK_PS)
    slots[3, 0, -1], pages[3, 0, -1] = slots[3, 0, 1], pages[3, 0, 1]
    masks = token_masks(np.random.default_rng(seed), slots)
    return q, cache, jnp.asarray(slots), jnp.asarray(pages), jnp.asarray(q_pos), masks


def dense_attention(q, cache, slots, pages, q_pos, masks, *, value_dim, scale):
    """The masked attention by its definition, in f64: per query, the key of every (entry,
    token) it may see, a key reached twice listed twice, in one softmax."""
    q = np.asarray(q, np.float64)
    kv = np.asarray(cache.astype(jnp.float32), np.float64)
    slots, pages, q_pos = np.asarray(slots), np.asarray(pages), np.asarray(q_pos)
    words = np.asarray(masks).view(np.uint32)
    b, nq, h, _ = q.shape
    ps = kv.shape[1]
    o, lse = np.zeros((b, nq, h, value_dim)), np.full((b, nq, h), -np.inf)
    for i in range(b):
        for j in range(nq):
            keys = [kv[slots[i, j, e], t] for e in range(slots.shape[-1]) for t in range(ps)
                    if slots[i, j, e] >= 0 and pages[i, j, e] * ps + t <= q_pos[i, j]
                    and words[i, j, e, t // 32] >> np.uint32(t % 32) & 1]
            if not keys:
                continue
            k = np.stack(keys)
            s = q[i, j] @ k.T * scale                                   # [H, keys]
            top = s.max(-1, keepdims=True)
            p = np.exp(s - top)
            o[i, j] = p @ k[:, :value_dim] / p.sum(-1, keepdims=True)
            lse[i, j] = np.log(p.sum(-1)) + top[:, 0]
    return o, lse


MASK_DTYPES = ("bf16", "fp8_e4m3")


def test_reference_with_masks_is_the_dense_definition():
    """The reference's masked attention equals the definition computed key by key in f64; and
    the masks matter (page mode differs), including the empty query's -inf."""
    q, *args, masks = masked_prefill_case(jnp.bfloat16)
    q = q.astype(jnp.float32)
    statics = dict(value_dim=V, scale=SCALE)
    o, lse = reference.sparse_attention(q, *args, **statics, sel_masks=masks)
    want_o, want_lse = dense_attention(q, *args, masks, **statics)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(lse[1, 2])).all() and not np.asarray(o[1, 2]).any()
    page_o, _ = reference.sparse_attention(q, *args, **statics)
    assert np.abs(np.asarray(page_o) - want_o).max() > 0.1


@pytest.mark.parametrize("query", QUERY_DTYPES)
@pytest.mark.parametrize("name", MASK_DTYPES)
@pytest.mark.parametrize("nq", [3, 10])
def test_sparse_prefill_with_masks_matches_reference(nq, name, query):
    """3 queries: one partial block; 10: two blocks and a partial third."""
    q, *args, masks = masked_prefill_case(CACHE_DTYPES[name], nq)
    statics = dict(value_dim=V, scale=SCALE, query_block=4)
    out = sparse_prefill(q.astype(QUERY_DTYPES[query]), *args, **statics, interpret=True,
                         sel_masks=masks)
    ref = reference.sparse_attention(q, *args, **statics, sel_masks=masks)
    assert_attention_matches(out, ref, args[0], name, query)


@pytest.mark.parametrize("query", QUERY_DTYPES)
@pytest.mark.parametrize("name", MASK_DTYPES)
def test_sparse_decode_with_masks_matches_reference(name, query):
    q, *args, masks = masked_decode_case(CACHE_DTYPES[name])
    statics = dict(value_dim=V, scale=SCALE)
    out = sparse_decode(q.astype(QUERY_DTYPES[query]), *args, **statics, interpret=True,
                        sel_masks=masks)
    ref = reference.sparse_attention(q, *args, **statics, sel_masks=masks)
    assert_attention_matches(out, ref, args[0], name, query)


@pytest.mark.parametrize("name", MASK_DTYPES)
def test_sparse_decode_with_masks_reads_words_as_pages(name):
    """The decode kernel over a cache's words (kernels/page_words.py) gives what it gives over
    the pages, to the bit, with masks as without."""
    q, cache, *args, masks = masked_decode_case(CACHE_DTYPES[name])
    statics = dict(value_dim=V, scale=SCALE, interpret=True, sel_masks=masks)
    pages = sparse_decode(q, cache, *args, **statics)
    words = sparse_decode(q, page_words.to_words(cache), *args, **statics,
                          page_dtype=np.dtype(CACHE_DTYPES[name]))
    for a, b in zip(pages, words):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _every_implementation(nq: int):
    """(name, attention fn) of each implementation of the op for nq queries a row."""
    kernel = sparse_decode if nq == 1 else sparse_prefill
    return [("reference", reference.sparse_attention),
            ("xla", functools.partial(sparse_attention_owned, num_shards=2)),
            (kernel.__name__, functools.partial(kernel, interpret=True))]


@pytest.mark.parametrize("nq", [1, 10])
def test_masks_with_every_bit_set_are_page_mode(nq):
    """Every token of every entry selected: each implementation gives its no-mask result
    exactly."""
    q, cache, slots, pages, q_pos, _ = masked_prefill_case(jnp.float8_e4m3fn)
    args = (q[:, :nq], cache, slots[:, :nq], pages[:, :nq], q_pos[:, :nq])
    every = jnp.full((*args[2].shape, 2), -1, jnp.int32)
    statics = dict(value_dim=V, scale=SCALE, query_block=4)
    for name, fn in _every_implementation(nq):
        pages_out = fn(*args, **statics)
        masked_out = fn(*args, **statics, sel_masks=every)
        for a, b in zip(pages_out, masked_out):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("backend, nq", [("pallas_interpret", 1), ("pallas_interpret", 10),
                                         ("xla", 10), ("reference", 10)])
def test_kernel_sets_pass_masks_through(backend, nq):
    """The kernel sets hand `sel_masks` to their implementation: the masked result is the
    reference's within the bf16 path's bounds, never the page mode's."""
    q, cache, slots, pages, q_pos, masks = masked_prefill_case(jnp.bfloat16)
    args = (cache, slots[:, :nq], pages[:, :nq], q_pos[:, :nq])
    statics = dict(value_dim=V, scale=SCALE, query_block=4)
    got = select_kernels(backend, 2).sparse_attention(q[:, :nq], *args, **statics,
                                                     sel_masks=masks[:, :nq])
    ref = reference.sparse_attention(q[:, :nq], *args, **statics, sel_masks=masks[:, :nq])
    assert_attention_matches(got, ref, cache, "bf16", "bf16")
    page_o, _ = reference.sparse_attention(q[:, :nq], *args, **statics)
    assert np.abs(np.asarray(got[0]) - np.asarray(page_o)).max() > 0.1


def test_block_union_drops_entries_without_tokens():
    """An entry whose mask is all zero is not visible: its page joins a block's union only
    through another entry."""
    slots = jnp.asarray([[[3, 5], [5, 7]]], jnp.int32)              # [B=1, Q=2, N=2]
    pages = jnp.asarray([[[0, 1], [1, 2]]], jnp.int32)
    q_pos = jnp.asarray([[1000, 1000]], jnp.int32)
    masks = jnp.asarray([[[[1, 0], [0, 0]], [[0, 0], [0, -2 ** 31]]]], jnp.int32)
    us, up, count = block_union(slots, pages, q_pos, page_size=MASK_PS, query_block=2,
                                sel_masks=masks)
    assert int(count[0, 0]) == 2
    assert np.asarray(us[0, 0, :2]).tolist() == [3, 7]
    assert np.asarray(up[0, 0, :2]).tolist() == [0, 2]


def test_masks_are_checked():
    q, cache, slots, pages, q_pos, masks = masked_decode_case(jnp.bfloat16)
    statics = dict(value_dim=V, scale=SCALE)
    with pytest.raises(ValueError, match=r"int32\[4, 1, 6, 2\]"):
        reference.sparse_attention(q, cache, slots, pages, q_pos, **statics,
                                   sel_masks=masks[..., :1])
    with pytest.raises(ValueError, match="sel_masks uint32"):
        sparse_decode(q, cache, slots, pages, q_pos, **statics, interpret=True,
                      sel_masks=masks.astype(jnp.uint32))


def test_costs_count_the_mask_bytes():
    """4 W bytes an entry in each kernel's HBM bytes (the same query block either way)."""
    q, cache, slots, pages, q_pos, masks = masked_prefill_case(jnp.bfloat16)
    for cost, nq in ((sparse_decode_cost, 1), (sparse_prefill_cost, 10)):
        args = (q[:, :nq], cache, slots[:, :nq], pages[:, :nq], q_pos[:, :nq])
        plain = cost(*args, value_dim=V, query_block=4)
        masked = cost(*args, value_dim=V, query_block=4, sel_masks=masks[:, :nq])
        assert masked["grid"] == plain["grid"]
        assert masked["bytes"] - plain["bytes"] == 4 * 2 * slots[:, :nq].size
