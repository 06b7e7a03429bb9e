"""Token-level DSA selection: each shard's candidates (kernels/token_candidates.py), their exact
global rank over the shards, and the selection's attention entries (pages and token masks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_engine, random_tokens, rel_l2
from cp_runtime.kernels.token_candidates import NO_TOKEN, indexer_token_candidates
from cp_runtime.model.indexer_inputs import IndexerInputs
from cp_runtime.model.oracle import oracle_logits, token_scores, token_selection_mask
from cp_runtime.kernels.reference import mask_words
from cp_runtime.parallel.selection import rank_pages, token_entries

PS, T, HI, DI = 16, 200, 2, 8


def _indexer(seed: int, ties: bool = False):
    """Indexer queries, weights and keys of T positions; with `ties`, keys drawn from a few
    values so that many scores tie exactly."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, HI, DI)).astype(np.float32)
    k = rng.standard_normal((4 if ties else T, DI)).astype(np.float32)
    if ties:
        k = k[rng.integers(0, 4, T)]
        q = np.round(q)
    w = rng.uniform(0.5, 1.5, (T, HI)).astype(np.float32)
    return q, w, k


def _shard_candidates(q, w, k, shards: int, rotation: int, topk: int):
    """Every shard's candidates for every query, as the step computes them: f32/i32[S, T, topk]."""
    pages = -(-T // PS)
    cache = np.zeros((pages + 1, PS, DI), np.float32)          # physical slot = logical page
    cache.reshape(-1, DI)[:T] = k
    local = -(-(pages + rotation) // shards)
    out = []
    for shard in range(shards):
        logical = np.arange(local) * shards + shard - rotation
        table = np.where((logical >= 0) & (logical < pages), logical, pages)
        out.append(indexer_token_candidates(
            jnp.asarray(q)[None], jnp.asarray(w)[None], jnp.asarray(cache),
            jnp.asarray(table, jnp.int32)[None], jnp.arange(T, dtype=jnp.int32)[None],
            jnp.int32(shard), jnp.asarray([rotation], jnp.int32), num_shards=shards, k=topk,
            key_block_pages=3))
    scores = jnp.stack([s[0] for s, _ in out])
    tokens = jnp.stack([t[0] for _, t in out])
    return scores, tokens


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("shards,rotation", [(1, 0), (2, 1), (4, 3), (16, 5)])
def test_shards_rank_to_the_oracle_selection(shards, rotation, ties):
    q, w, k = _indexer(shards + 10 * ties, ties)
    topk = 24
    scores, tokens = _shard_candidates(q, w, k, shards, rotation, topk)
    joined = lambda x: jnp.moveaxis(x, 0, 1).reshape(T, -1)          # noqa: E731
    _, chosen = rank_pages(joined(scores), joined(tokens), topk)     # the global rank
    index = IndexerInputs(q=jnp.asarray(q), w=jnp.asarray(w), k=jnp.asarray(k))
    want = np.asarray(token_selection_mask(token_scores(index), topk))
    got = np.zeros((T, T), bool)
    for t in range(T):
        picked = np.asarray(chosen[t])
        got[t, picked[picked >= 0]] = True
    np.testing.assert_array_equal(got, want)
    assert (got.sum(1) == np.minimum(np.arange(T) + 1, topk)).all()


def test_ties_go_to_the_earlier_position():
    q, w, k = _indexer(3)
    k[:] = k[0]                                     # every key the same: every score ties
    scores, tokens = _shard_candidates(q, w, k, 4, 1, 8)
    joined = lambda x: jnp.moveaxis(x, 0, 1).reshape(T, -1)          # noqa: E731
    _, chosen = rank_pages(joined(scores), joined(tokens), 8)
    np.testing.assert_array_equal(np.asarray(chosen[150]), np.arange(8))


def test_token_entries_hold_exactly_the_tokens():
    rng = np.random.default_rng(0)
    b, nq, k, ps = 2, 3, 40, 64
    tokens = np.full((b, nq, k), NO_TOKEN, np.int32)
    for i in range(b):
        for j in range(nq):
            n = rng.integers(0, k + 1)
            tokens[i, j, :n] = rng.choice(1000, n, replace=False)
    tokens[0, 0, :3] = [31, 32, 63]                 # bits 31 and 63: the sign bits of the words
    pages, masks = token_entries(jnp.asarray(tokens), ps, k)
    assert masks.shape == (b, nq, k, mask_words(ps))
    words = np.asarray(masks).view(np.uint32)
    for i in range(b):
        for j in range(nq):
            got = set()
            for n, page in enumerate(np.asarray(pages[i, j])):
                if page < 0:
                    assert not words[i, j, n].any()
                    continue
                for t in range(ps):
                    if words[i, j, n, t // 32] >> (t % 32) & 1:
                        got.add(int(page) * ps + t)
            want = set(int(t) for t in tokens[i, j] if t >= 0)
            assert got == want
            listed = np.asarray(pages[i, j])
            listed = listed[listed >= 0]
            assert (np.diff(listed) > 0).all()      # distinct pages, ascending


# ---- the engine in token selection, against the dense oracle ---------------------------------

PROMPT = 150          # tiny's index_topk is 64: past position 63 every query drops tokens


def _logits(engine, model, seed: int) -> tuple[list[int], np.ndarray]:
    """A prompt's every logit, then two decode steps' (one session)."""
    s = engine.create_session()
    toks = random_tokens(model, PROMPT, seed)
    out = [engine.extend(s.id, toks, all_logits=True)]
    for step in range(2):
        new = random_tokens(model, 1, 100 + step)
        out.append(engine.decode([s.id], new)[0][None])
        toks = toks + new
    engine.allocator.check_invariants()
    return toks, np.concatenate(out)


@pytest.mark.parametrize("runtime", [
    dict(num_shards=1),
    dict(num_shards=16),
    dict(num_shards=4, weights="sharded", attention="gather_kv"),
    dict(num_shards=4, backend="pallas_interpret"),
], ids=["S1", "S16", "S4-gather_kv", "S4-pallas"])
def test_engine_matches_the_token_oracle(tiny, tiny_params, runtime):
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", page_size=16,
                         pages_per_shard=max(32 // runtime["num_shards"], 4), chunk_size=64,
                         selection="token", **runtime)
    toks, out = _logits(engine, tiny, seed=1)
    ref = oracle_logits(tiny_params, jnp.asarray(toks), cfg=tiny, page_size=16,
                        selection="token")
    # The TPU kernels take bf16 queries and round the probabilities to bf16 before PV
    # (kernels/dispatch.py): measured 6.1e-3 here, as the page path's 5.3e-3
    # (tests/kernels/test_kernel_path.py, whose bound this is); the XLA path is f32 throughout.
    bound = 1e-2 if runtime.get("backend") == "pallas_interpret" else 1e-5
    assert rel_l2(out, ref) <= bound


def test_page_selection_is_another_model(tiny, tiny_params):
    """Past index_topk the page rule attends other tokens: the logits move by far more than
    any path's rounding (measured 0.37 on this prompt)."""
    toks = jnp.asarray(random_tokens(tiny, PROMPT, 1))
    token = oracle_logits(tiny_params, toks, cfg=tiny, page_size=16, selection="token")
    pages = oracle_logits(tiny_params, toks, cfg=tiny, page_size=16, selection="page")
    k = tiny.index_topk
    assert rel_l2(pages[:k], token[:k]) <= 1e-6          # every earlier token either way
    assert rel_l2(pages[k:], token[k:]) > 0.1


def test_index_topk_over_the_table_selects_every_token(tiny, tiny_params):
    """index_topk past every token of the rows' tables (a dense model, as `bench throughput`
    makes one): each shard's tokens are gathered whole, unranked, and the engine is dense
    attention."""
    import dataclasses
    dense = dataclasses.replace(tiny, index_topk=4096)
    engine = make_engine(dense, tiny_params, kv_cache_dtype="f32", page_size=16, num_shards=4,
                         pages_per_shard=8, chunk_size=64, selection="token")
    toks, out = _logits(engine, dense, seed=2)
    ref = oracle_logits(tiny_params, jnp.asarray(toks), cfg=dense, page_size=16,
                        selection="token")
    assert rel_l2(out, ref) <= 1e-5
