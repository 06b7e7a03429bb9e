"""The union-of-pages XLA attention equals the reference, over the union and on the fallback."""

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.kernels.reference import sparse_attention
from cp_runtime.kernels.xla_sparse import sparse_attention_owned, union_capacity

P, PS, D, H, DV = 12, 16, 256, 4, 32


def _problem(seed, *, b=3, q=8, n=5, owner_share=0.3, ps=PS):
    rng = np.random.default_rng(seed)
    cache = rng.normal(size=(P + 1, ps, D)).astype(np.float32)
    cache[P] = np.nan                                   # the sentinel must never be read
    pos = rng.integers(0, P * ps, size=(b, q)).astype(np.int32)
    pos[0, 0] = -1                                      # a padding query
    pages = rng.integers(0, P, size=(b, q, n)).astype(np.int32)
    pages = np.minimum(pages, np.maximum(pos[..., None], 0) // ps)
    slots = np.where(rng.random((b, q, n)) < owner_share, pages, -1).astype(np.int32)
    queries = rng.normal(size=(b, q, H, D)).astype(np.float32)
    return tuple(map(jnp.asarray, (queries, cache, slots, pages, pos)))


def _masks(seed, slots):
    """i32[B, Q, N, 2] token masks of pages of 64: about a quarter of the tokens, a fifth of
    the entries none, every third entry tokens 31 and 63 (each word's sign bit)."""
    rng = np.random.default_rng(seed)
    shape = (*slots.shape, 2)
    words = (rng.integers(0, 2 ** 32, shape, dtype=np.uint32)
             & rng.integers(0, 2 ** 32, shape, dtype=np.uint32))
    words[rng.random(slots.shape) < 0.2] = 0
    words[..., ::3, :] |= np.uint32(1 << 31)
    return jnp.asarray(words.view(np.int32))


def _assert_matches(args, shards, query_block=8, sel_masks=None):
    o_ref, lse_ref = sparse_attention(*args, value_dim=DV, scale=0.1, sel_masks=sel_masks)
    o, lse = sparse_attention_owned(*args, value_dim=DV, scale=0.1, num_shards=shards,
                                    query_block=query_block, sel_masks=sel_masks)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    assert finite.any()
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("owner_share, shards, query_block", [
    (0.1, 16, 8), (0.3, 4, 8), (1.0, 16, 8), (1.0, 1, 8), (0.3, 4, 5), (0.3, 16, 64)])
def test_matches_reference(owner_share, shards, query_block):
    """query_block 5 splits sequences across blocks; 64 puts every row in one block."""
    _assert_matches(_problem(0, owner_share=owner_share), shards, query_block)


def test_fallback_is_taken_when_one_shard_owns_everything():
    """owner_share 1.0 at S = 16: a block's union overflows the capacity, the exact path runs."""
    b, q, n = 3, 8, 5
    _, _, slots, _, _ = _problem(0, b=b, q=q, n=n, owner_share=1.0)
    distinct = max(len(np.unique(np.asarray(slots)[i])) for i in range(b))
    assert union_capacity(q, n, 16) < distinct
    _assert_matches(_problem(0, b=b, q=q, n=n, owner_share=1.0), 16)


def test_page_selected_twice_counts_twice():
    """The reference attends an entry per selection; a page listed twice weighs double."""
    q, cache, slots, pages, pos = _problem(1, owner_share=0.5)
    slots = slots.at[:, :, 1].set(slots[:, :, 0])
    pages = pages.at[:, :, 1].set(pages[:, :, 0])
    _assert_matches((q, cache, slots, pages, pos), 4)


def test_one_slot_shared_by_sequences():
    """Forked sessions share a physical page: the same slot, selected by rows of different
    sequences in one block."""
    q, cache, slots, pages, pos = _problem(2, owner_share=0.5)
    slots = slots.at[:, :, 0].set(3)
    pages = pages.at[:, :, 0].set(3)            # _problem's slot s holds page s
    pos = jnp.maximum(pos, 3 * PS)
    _assert_matches((q, cache, slots, pages, pos), 4, query_block=24)


@pytest.mark.parametrize("owner_share, shards, query_block", [
    (0.3, 4, 8), (0.3, 16, 5), (1.0, 16, 8)])
def test_token_masks_match_reference(owner_share, shards, query_block):
    """Token masks over pages of 64 (two words a page), unowned entries -1, a page listed
    twice under two masks: over the union, and on the fallback (1.0 at S = 16)."""
    q, cache, slots, pages, pos = _problem(3, owner_share=owner_share, ps=64)
    slots = slots.at[:, :, 1].set(slots[:, :, 0])
    pages = pages.at[:, :, 1].set(pages[:, :, 0])
    _assert_matches((q, cache, slots, pages, pos), shards, query_block,
                    sel_masks=_masks(3, slots))
