"""The tiled XLA indexer equals the reference: every tiling, rotation, padding, storage form."""

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.kernels import reference
from cp_runtime.kernels.storage import to_storage
from cp_runtime.kernels.xla_indexer import indexer_page_scores, tile_shape

PS, S = 16, 4


def _problem(seed, *, b, nq, heads, dim, m):
    """b sequences of m local pages each on shard 1 of S; queries spread over the context, one
    padding query (when there are two or more), one missing page given as -1."""
    rng = np.random.default_rng(seed)
    pool_pages = b * m + 2
    cache = jnp.asarray(rng.standard_normal((pool_pages + 1, PS, dim)), jnp.bfloat16)
    local = rng.permutation(pool_pages)[: b * m].reshape(b, m).astype(np.int32)
    local[0, -1] = -1
    q_pos = rng.integers(0, m * S * PS, (b, nq)).astype(np.int32)
    if b * nq > 1:
        q_pos[-1, 0] = -1
    q = jnp.asarray(rng.standard_normal((b, nq, heads, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((b, nq, heads)), jnp.float32)
    rotation = jnp.asarray(rng.integers(0, S, b), jnp.int32)
    return q, w, cache, jnp.asarray(local), jnp.asarray(q_pos), jnp.int32(1), rotation


def _assert_close(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    assert np.isfinite(ref).any() and np.isneginf(ref).any()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b, nq, heads, dim, m, tile_bytes, query_rows", [
    (1, 1, 1, 16, 9, 4 << 20, 1024),      # decode, one tile
    (3, 1, 2, 16, 9, 4 * PS * 16 * 2, 1024),   # decode, 2 pages a tile: a partial last
    (2, 37, 1, 16, 7, 4 * PS * 16, 8),   # 8 queries x 1 page a tile: both axes padded
    (2, 20, 4, 32, 5, 4 << 20, 16),       # 4 heads: the head product, 4 queries a tile
])
def test_matches_reference(b, nq, heads, dim, m, tile_bytes, query_rows):
    args = _problem(0, b=b, nq=nq, heads=heads, dim=dim, m=m)
    ref = reference.indexer_page_scores(*args, num_shards=S, key_block_pages=3)
    out = indexer_page_scores(*args, num_shards=S, tile_bytes=tile_bytes, query_rows=query_rows)
    assert out.shape == ref.shape == (b, nq, m)
    _assert_close(out, ref)


def test_storage_form_cache():
    """A cache held as same-width integers (the pool's storage form) reads as its values."""
    q, w, cache, *rest = _problem(1, b=2, nq=5, heads=2, dim=16, m=6)
    ref = reference.indexer_page_scores(q, w, cache, *rest, num_shards=S, key_block_pages=2)
    stored = to_storage(cache, jnp.bfloat16)
    assert stored.dtype != cache.dtype
    out = indexer_page_scores(q, w, stored, *rest, num_shards=S, cache_dtype=jnp.bfloat16)
    _assert_close(out, ref)


def test_tile_shape_follows_the_byte_budget():
    """4 MiB of f32 logits (prefill) or keys (decode) a tile, split evenly."""
    assert tile_shape(1024, 1, 1024, 64, 16) == (1024, 16)
    assert tile_shape(1024, 32, 1024, 64, 128) == (32, 16)   # 1024 rows = 32 queries x 32 heads
    assert tile_shape(1000, 1, 1024, 64, 16) == (1000, 16)
    assert tile_shape(1500, 1, 1024, 64, 16) == (750, 21)    # two even query tiles
    assert tile_shape(1, 1, 100, 64, 16) == (1, 100)          # decode: every page in one tile
    assert tile_shape(1, 1, 10_000, 64, 16) == (1, 1000)      # ... up to 4 MiB of keys, evenly
    assert tile_shape(4096, 1, 8, 64, 16, tile_bytes=1) == (1024, 1)   # never below one page
