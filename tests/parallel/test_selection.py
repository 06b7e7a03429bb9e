"""The DSA selection rule: total order, dense limit, IndexShare, exact global top-k over shards."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cp_runtime.model.oracle import oracle_logits, selection_mask
from cp_runtime.parallel import selection
from cp_runtime.parallel.selection import (NO_PAGE, global_top_pages, halve_sorted_lists,
                                           local_candidates, rank_distinct_pages,
                                           rank_gathered_columns, rank_pages, rank_rows)


def brute_force_top(scores: np.ndarray, k: int) -> list[int]:
    """Pages by (score desc, page asc), -inf excluded: a plain Python loop."""
    order = sorted((-s, p) for p, s in enumerate(scores) if s > -np.inf)
    return [p for _, p in order[:k]] + [NO_PAGE] * max(0, k - len(order))


@pytest.mark.parametrize("seed", range(5))
def test_rank_pages_matches_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, (6, 20)).astype(np.float32)      # many ties
    scores[rng.random(scores.shape) < 0.2] = -np.inf
    pages = np.broadcast_to(np.arange(20, dtype=np.int32), scores.shape)
    _, top = rank_pages(jnp.asarray(scores), jnp.asarray(pages), 7)
    for row in range(6):
        assert top[row].tolist() == brute_force_top(scores[row], 7)


@pytest.mark.parametrize("seed", range(5))
def test_rank_rows_is_rank_pages_of_ascending_pages(seed):
    """Ranking by position (`lax.top_k`, a partial selection) picks, for pages that ascend
    with position, the pages the two-key sort picks: ties, signed zeros, -inf and rows with
    fewer than k candidates."""
    rng = np.random.default_rng(seed)
    scores = rng.integers(-1, 3, (8, 40)).astype(np.float32)
    scores[scores == 0] = rng.choice([0.0, -0.0], (scores == 0).sum())
    scores[rng.random(scores.shape) < 0.3] = -np.inf
    scores[0, 3:] = -np.inf                                          # 3 candidates < k
    pages = np.sort(rng.choice(400, (8, 40), replace=False), axis=-1).astype(np.int32)
    for k in (1, 7, 40, 41):
        top_scores, rows = rank_rows(jnp.asarray(scores), k)
        fast = top_scores, np.where(rows >= 0, np.take_along_axis(pages, np.maximum(rows, 0),
                                                                  axis=-1), NO_PAGE)
        full = rank_pages(jnp.asarray(scores), jnp.asarray(pages), k)
        np.testing.assert_array_equal(fast[1], full[1])
        np.testing.assert_array_equal(fast[0], full[0])


@pytest.mark.parametrize("seed", range(5))
def test_rank_distinct_pages_is_rank_pages(seed):
    """Rounds of best-then-lowest-page agree with the sort on distinct pages in any order."""
    rng = np.random.default_rng(seed)
    scores = rng.integers(-1, 3, (8, 48)).astype(np.float32)
    scores[scores == 0] = rng.choice([0.0, -0.0], (scores == 0).sum())
    scores[rng.random(scores.shape) < 0.3] = -np.inf
    scores[0, 2:] = -np.inf                                          # 2 candidates < k
    pages = np.stack([rng.permutation(500)[:48] for _ in range(8)]).astype(np.int32)
    pages[scores == -np.inf] = NO_PAGE                               # unused entries, repeated
    for k in (1, 4, 48):
        fast = rank_distinct_pages(jnp.asarray(scores), jnp.asarray(pages), k)
        full = rank_pages(jnp.asarray(scores), jnp.asarray(pages), k)
        np.testing.assert_array_equal(fast[1], full[1])
        np.testing.assert_array_equal(fast[0], full[0])
        # Candidates on the first axis: the columns form the gathered lists rank in.
        columns = rank_gathered_columns(jnp.asarray(scores.T), jnp.asarray(pages.T), k)
        np.testing.assert_array_equal(np.asarray(columns[1]).T, full[1])
        np.testing.assert_array_equal(np.asarray(columns[0]).T, full[0])


@pytest.mark.parametrize("seed", range(5))
def test_halved_lists_keep_the_top_k_of_each_pair(seed):
    """Pairs of ranked lists (ties, signed zeros, short lists padded with -inf and NO_PAGE)
    halved to k entries each: ranking the halves gives the pages and scores ranking all of
    them gives; an odd number of lists is left whole."""
    rng = np.random.default_rng(seed)
    g, rows, k = 6, 8, 5
    scores = rng.integers(-1, 3, (g, rows, 40)).astype(np.float32)
    scores[scores == 0] = rng.choice([0.0, -0.0], (scores == 0).sum())
    scores[rng.random(scores.shape) < 0.3] = -np.inf
    scores[1, 0, 2:] = -np.inf                                        # a list of 2 < k
    pages = np.stack([np.stack([rng.permutation(1000)[:40] for _ in range(rows)])
                      for _ in range(g)]).astype(np.int32)
    pages = pages + 1000 * np.arange(g, dtype=np.int32)[:, None, None]   # distinct over lists
    lists = [rank_pages(jnp.asarray(scores[i]), jnp.asarray(pages[i]), k) for i in range(g)]
    every = jnp.stack([jnp.stack([s.T, jax.lax.bitcast_convert_type(p, jnp.float32).T])
                       for s, p in lists])                            # [G, 2, k, rows]
    halved = halve_sorted_lists(every)
    assert halved.shape == (g // 2, 2, k, rows)
    assert halve_sorted_lists(every[:3]).shape == (3, 2, k, rows)

    def ranked(x):
        flat = jnp.moveaxis(x, 0, 1).reshape(2, -1, rows).transpose(0, 2, 1)   # [2, rows, G k]
        return rank_pages(flat[0], jax.lax.bitcast_convert_type(flat[1], jnp.int32), k)
    np.testing.assert_array_equal(ranked(halved)[1], ranked(every)[1])
    np.testing.assert_array_equal(ranked(halved)[0], ranked(every)[0])


def test_ties_resolve_to_lower_page_index():
    scores = jnp.zeros((1, 10))
    _, top = rank_pages(scores, jnp.arange(10)[None][:, ::-1], 3)   # pages given in reverse
    assert top.tolist() == [[0, 1, 2]]


def test_large_k_selects_everything_causal():
    rng = np.random.default_rng(0)
    t, ps = 70, 16
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), jnp.asarray(rng.normal(size=(t, t))),
                       -jnp.inf)
    assert (selection_mask(scores, ps, k=100) == jnp.tril(jnp.ones((t, t), bool))).all()
    sparse = selection_mask(scores, ps, k=1)
    assert sparse.sum() < jnp.tril(jnp.ones((t, t))).sum()


def test_sparse_equals_dense_when_k_covers_all_pages(tiny, tiny_params):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, tiny.vocab_size, 80))
    dense_cfg = tiny.__class__(**{**tiny.__dict__, "index_topk": 16 * 16})
    # A model with the indexer removed entirely: every query attends all earlier tokens.
    big = oracle_logits(tiny_params, tokens, cfg=dense_cfg, page_size=16)
    causal = _dense_causal_logits(tiny_params, tokens, tiny)
    np.testing.assert_allclose(big, causal, rtol=1e-5, atol=1e-5)
    small = oracle_logits(tiny_params, tokens, cfg=tiny.__class__(
        **{**tiny.__dict__, "index_topk": 16}), page_size=16)
    assert np.abs(np.asarray(small) - np.asarray(causal)).max() > 1e-3   # selection mattered


def _dense_causal_logits(params, tokens, cfg):
    from cp_runtime.model.layers import forward
    from cp_runtime.model.ops import logits
    from cp_runtime.model.oracle import dense_sparse_attention
    from cp_runtime.weights.params import model_layout
    t = tokens.shape[0]
    mask = jnp.tril(jnp.ones((t, t), bool))

    def attend(layer, state, q_row, kv_row, index, project):
        return project(dense_sparse_attention(q_row, kv_row, mask, value_dim=cfg.kv_lora_rank,
                                              scale=cfg.softmax_scale)), state

    hidden, _ = forward(model_layout(params, cfg), cfg, tokens, jnp.arange(t), attend, None)
    return logits(params, hidden)


def test_shared_layers_reuse_last_full_selection(tiny, tiny_params):
    from cp_runtime.model.layers import forward
    from cp_runtime.model.oracle import make_oracle_attend
    from cp_runtime.weights.params import model_layout
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, tiny.vocab_size, 96))
    attend = make_oracle_attend(tiny, page_size=16, kv_cache_dtype=None)
    masks = {}

    def recording(layer, state, *args):
        o, state = attend(layer, state, *args)
        masks[layer] = np.asarray(state)
        return o, state

    forward(model_layout(tiny_params, tiny), tiny, tokens, jnp.arange(96), recording, None)
    assert (masks[1] == masks[0]).all() and (masks[3] == masks[2]).all()
    assert (masks[2] != masks[0]).any()          # the second full layer selects afresh


@functools.cache
def _selector(num_shards: int, k: int, page_size: int, by_kernel: bool = False):
    """A jitted selection through real collectives over S devices (compiled once per S); with
    `by_kernel` the gathered rank a TPU runs (`_pairs_by_kernel`), in interpret mode."""
    mesh = jax.make_mesh((num_shards,), ("cp",), devices=jax.devices()[:num_shards])

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("cp"), P(), P()), out_specs=P(),
                       check_vma=False)
    def select(local_scores, pos, rotation):
        shard = jax.lax.axis_index("cp")
        s, p = local_candidates(local_scores[0], pos, shard, rotation, num_shards=num_shards,
                                page_size=page_size, k=k)
        if by_kernel:
            top = selection._pairs_by_kernel(selection._packed_columns(s, p), axis_name="cp",
                                             k=k, interpret=True)
            return jnp.moveaxis(top, 0, -1)
        return global_top_pages(s, p, k=k, axis_name="cp")

    return mesh, select


def _sharded_selection(scores: np.ndarray, q_pos: np.ndarray, *, num_shards: int, k: int,
                       page_size: int, rotation=(0, 0), by_kernel: bool = False) -> np.ndarray:
    """scores f32[B, Q, M] split by owner (row b's page p on shard (p + rotation[b]) % S, as
    local page (p + rotation[b]) // S) and selected on S devices."""
    b, q, m = scores.shape
    mesh, select = _selector(num_shards, k, page_size, by_kernel)
    width = -(-(m + num_shards) // num_shards) * num_shards
    rotated = np.full((b, q, width), -np.inf, np.float32)
    for row, r in enumerate(rotation):
        rotated[row, :, r: r + m] = scores[row]
    local = rotated.reshape(b, q, width // num_shards, num_shards).transpose(3, 0, 1, 2)
    local = jax.device_put(local, NamedSharding(mesh, P("cp")))
    q_pos = jax.device_put(q_pos, NamedSharding(mesh, P()))
    rotation = jax.device_put(np.asarray(rotation, np.int32), NamedSharding(mesh, P()))
    return np.asarray(select(local, q_pos, rotation))


def _cases():
    rng = np.random.default_rng(3)
    m = 40
    yield "random", rng.normal(size=(2, 5, m)).astype(np.float32)
    yield "all_equal", np.ones((2, 5, m), np.float32)
    one_shard = rng.normal(size=(2, 5, m)).astype(np.float32)
    one_shard[..., 3::16] += 100.0                                  # best pages all on shard 3
    yield "best_on_one_shard", one_shard
    yield "integer_ties", rng.integers(0, 3, (2, 5, m)).astype(np.float32)


@pytest.mark.parametrize("name, scores", list(_cases()))
@pytest.mark.parametrize("length", [16 * 40, 16 * 5 + 3, 10])   # long, < S pages, one page
def test_global_top_k_equals_single_device(name, scores, length):
    ps, k = 16, 6
    q_pos = np.stack([np.linspace(0, length - 1, 5).astype(np.int32),
                      np.full(5, length - 1, np.int32)])
    q_pos[1, 0] = -1                                                # a padding query
    one = _sharded_selection(scores, q_pos, num_shards=1, k=k, page_size=ps)
    for rotation in [(0, 0), (5, 15)]:      # rotated rows select exactly as unrotated ones
        many = _sharded_selection(scores, q_pos, num_shards=16, k=k, page_size=ps,
                                  rotation=rotation)
        np.testing.assert_array_equal(one, many)
    # The TPU's gathered rank (odd shards' lists sent worst first, halved and ranked in one
    # kernel), in interpret mode over the same 16 devices.
    by_kernel = _sharded_selection(scores, q_pos, num_shards=16, k=k, page_size=ps,
                                   rotation=(5, 15), by_kernel=True)
    np.testing.assert_array_equal(one, by_kernel)
    for bi in range(2):
        for qi in range(5):
            own = q_pos[bi, qi] // ps if q_pos[bi, qi] >= 0 else 0
            row = np.where(np.arange(40) < own, scores[bi, qi], -np.inf)
            assert one[bi, qi].tolist() == brute_force_top(row, k)
