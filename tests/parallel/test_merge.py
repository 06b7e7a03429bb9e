"""Exact merge of per-shard partials over real collectives on 16 virtual devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cp_runtime.parallel.merge import (MERGES, merge_all_gather, merge_by_head_exchange,
                                       merge_stacked)

S = 16


def _partials(rng, lead=(3, 5, 4), dv=8, keys=12):
    """Per-shard partials of a real softmax over S * keys keys, and the exact answer."""
    scores = rng.normal(size=(S, *lead, keys)) * 3
    values = rng.normal(size=(S, *lead, keys, dv))
    lse = np.log(np.exp(scores).sum(-1))
    o = (np.exp(scores - lse[..., None])[..., None] * values).sum(-2)
    all_scores = np.moveaxis(scores, 0, -2).reshape(*lead, S * keys)
    all_values = np.moveaxis(values, 0, -3).reshape(*lead, S * keys, dv)
    p = np.exp(all_scores - all_scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    exact = (p[..., None] * all_values).sum(-2)
    exact_lse = np.log(np.exp(all_scores).sum(-1))
    return o.astype(np.float32), lse.astype(np.float32), exact, exact_lse


# Every merge variant; all_gather both flat and staged (cp_runtime.parallel.collectives).
VARIANTS = {**MERGES,
            "all_gather_staged": functools.partial(merge_all_gather, gathers="staged")}


@functools.cache
def _collective(name: str):
    mesh = jax.make_mesh((S,), ("cp",))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("cp"), P("cp")),
                       out_specs=(P(), P()), check_vma=False)
    def run(o, lse):
        return VARIANTS[name](o[0], lse[0], "cp")

    return mesh, run


def _merge_on_devices(name, o, lse):
    mesh, run = _collective(name)
    shard = NamedSharding(mesh, P("cp"))
    out = run(jax.device_put(o, shard), jax.device_put(lse, shard))
    return np.asarray(out[0]), np.asarray(out[1])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_merge_is_exact(name):
    o, lse, exact, exact_lse = _partials(np.random.default_rng(0))
    merged, merged_lse = _merge_on_devices(name, o, lse)
    np.testing.assert_allclose(merged, exact, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(merged_lse, exact_lse, rtol=1e-5)
    ref, ref_lse = merge_stacked(jnp.asarray(o), jnp.asarray(lse))
    np.testing.assert_allclose(merged, ref, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_empty_shards_contribute_nothing(name):
    o, lse, _, _ = _partials(np.random.default_rng(1))
    o[np.arange(S) != 5] = 0.0
    lse[np.arange(S) != 5] = -np.inf               # only shard 5 saw any key
    lse[5, 0] = -np.inf                             # and one row no shard saw
    o[5, 0] = 0.0
    merged, merged_lse = _merge_on_devices(name, o, lse)
    assert np.isfinite(merged).all()
    np.testing.assert_allclose(merged[1:], o[5, 1:], rtol=1e-6)
    assert (merged[0] == 0).all() and np.isneginf(merged_lse[0]).all()


def test_a_wrong_merge_is_caught():
    """The check above can fail: averaging partials instead of weighting by exp(lse)."""
    o, lse, exact, _ = _partials(np.random.default_rng(2))
    wrong = o.mean(0)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(wrong, exact, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("merge, weights, gathers", [("gather_psum", "replicated", "auto"),
                                                     ("all_to_all", "replicated", "auto"),
                                                     ("hidden_psum", "replicated", "auto"),
                                                     ("all_gather", "replicated", "flat"),
                                                     ("all_gather", "replicated", "staged"),
                                                     ("auto", "replicated", "auto"),
                                                     ("gather_psum", "sharded", "auto"),
                                                     ("all_gather", "sharded", "flat"),
                                                     ("auto", "sharded", "staged"),
                                                     ("head_scatter", "sharded", "auto"),
                                                     ("head_exchange", "sharded", "auto")])
def test_combine_projects_the_exact_merge(merge, weights, gathers):
    """combine() = W (exact merge) for every variant, the projection's weights whole or split
    by head; 12 heads over 16 shards, so the head split is padded."""
    from cp_runtime.parallel.merge import combine
    from cp_runtime.weights.shards import WeightShards

    rng = np.random.default_rng(3)
    heads, dv, hidden = 12, 8, 6
    o, lse, exact, _ = _partials(rng, lead=(5, heads), dv=dv)
    w = rng.normal(size=(heads, dv, hidden)).astype(np.float32)
    want = np.einsum("thc,hcd->td", exact, w)
    mesh = jax.make_mesh((S,), ("cp",))
    ws = WeightShards("cp" if weights == "sharded" else None)
    w_padded = np.pad(w, ((0, S - heads), (0, 0), (0, 0)))           # one head per shard
    w_spec = P("cp") if weights == "sharded" else P()

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("cp"), P("cp"), w_spec),
                       out_specs=P(), check_vma=False)
    def run(o, lse, w):
        return combine(merge, o[0], lse[0], lambda x: jnp.einsum("thc,hcd->td", x, w), "cp", ws,
                       gathers)

    shard = NamedSharding(mesh, P("cp"))
    got = run(jax.device_put(o, shard), jax.device_put(lse, shard),
              jax.device_put(w_padded, shard) if weights == "sharded" else w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def _exchanged(o, lse):
    """merge_by_head_exchange over 16 devices of o f32[S, T, H, Dv], lse f32[S, T, H] ->
    every shard's own heads side by side, f32[T, H, Dv] (the heads' padding cut)."""
    mesh = jax.make_mesh((S,), ("cp",))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("cp"), P("cp")),
                       out_specs=P(None, "cp"), check_vma=False)
    def run(o, lse):
        return merge_by_head_exchange(o[0], lse[0], "cp")

    shard = NamedSharding(mesh, P("cp"))
    return np.asarray(run(jax.device_put(o, shard), jax.device_put(lse, shard)))[:, :o.shape[2]]


def test_head_exchange_merges_each_shards_heads():
    """One all-to-all over heads (12 heads over 16 shards: padded) gives each shard its heads
    merged exactly; a head no shard saw merges to 0."""
    o, lse, exact, _ = _partials(np.random.default_rng(4), lead=(5, 12), dv=8)
    o[:, 0, 3], lse[:, 0, 3] = 0.0, -np.inf
    exact[0, 3] = 0.0
    got = _exchanged(o, lse)
    np.testing.assert_allclose(got, exact, rtol=2e-5, atol=2e-6)
    want, _ = merge_stacked(jnp.asarray(o), jnp.asarray(lse))
    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-5, atol=2e-6)
    assert (got[0, 3] == 0).all() and np.isfinite(got).all()
