"""The owned-pairs XLA attention equals the reference, on the compact path and the fallback."""

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.kernels.reference import sparse_attention
from cp_runtime.kernels.xla_sparse import pair_capacity, sparse_attention_owned

P, PS, D, H, DV = 12, 16, 256, 4, 32


def _problem(seed, *, b=3, q=8, n=5, owner_share=0.3):
    rng = np.random.default_rng(seed)
    cache = rng.normal(size=(P + 1, PS, D)).astype(np.float32)
    cache[P] = np.nan                                   # the sentinel must never be read
    pos = rng.integers(0, P * PS, size=(b, q)).astype(np.int32)
    pos[0, 0] = -1                                      # a padding query
    pages = rng.integers(0, P, size=(b, q, n)).astype(np.int32)
    pages = np.minimum(pages, np.maximum(pos[..., None], 0) // PS)
    slots = np.where(rng.random((b, q, n)) < owner_share, pages, -1).astype(np.int32)
    queries = rng.normal(size=(b, q, H, D)).astype(np.float32)
    return tuple(map(jnp.asarray, (queries, cache, slots, pages, pos)))


@pytest.mark.parametrize("owner_share, shards", [(0.1, 16), (0.3, 4), (1.0, 16), (1.0, 1)])
def test_matches_reference(owner_share, shards):
    args = _problem(0, owner_share=owner_share)
    o_ref, lse_ref = sparse_attention(*args, value_dim=DV, scale=0.1)
    o, lse = sparse_attention_owned(*args, value_dim=DV, scale=0.1, num_shards=shards,
                                    query_block=8)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], rtol=1e-6, atol=1e-6)


def test_fallback_is_taken_when_one_shard_owns_everything():
    """owner_share 1.0 at S = 16 overflows the capacity: the exact path must run."""
    b, q, n = 3, 8, 5
    assert pair_capacity(b * q, n, 16) < b * q * n
    test_matches_reference(1.0, 16)
