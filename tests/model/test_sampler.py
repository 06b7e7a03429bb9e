"""On-device sampling (cp_runtime.model.sampler): greedy, temperature, top-k, top-p, seeds.
tests/model/test_sampling_fields.py checks the other fields against a numpy sampler."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.engine.requests import BadRequest, SamplingParams
from cp_runtime.model.sampler import SamplingArrays, sample_tokens

sample = jax.jit(sample_tokens)


def arrays(rows, temperature=0.0, top_p=1.0, top_k=0, seed=0):
    return dataclasses.replace(SamplingArrays.greedy(rows),
                               temperature=np.full(rows, temperature, np.float32),
                               top_p=np.full(rows, top_p, np.float32),
                               top_k=np.full(rows, top_k, np.int32),
                               seed=np.full(rows, seed, np.uint32))


LOGITS = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))


def draws(logits, n, **kw):
    """Tokens drawn at n positions (one fresh noise stream each) from the same logits."""
    rows = np.repeat(logits, n, axis=0)
    tokens, _ = sample(jnp.asarray(rows), arrays(n, **kw), jnp.arange(n, dtype=jnp.int32))
    return np.asarray(tokens)


def test_greedy_is_argmax_with_the_models_logprob():
    logits = jax.random.normal(jax.random.key(0), (5, 300))
    tokens, logprobs = sample(logits, arrays(5), jnp.zeros(5, jnp.int32))
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    ref = jax.nn.log_softmax(logits)[np.arange(5), np.asarray(tokens)]
    np.testing.assert_allclose(logprobs, ref, rtol=1e-6)


def test_temperature_draws_follow_the_softmax():
    counts = np.bincount(draws(LOGITS, 4000, temperature=1.0), minlength=4) / 4000
    # 4000 draws: the standard error of p = 0.5 is 0.008; 4 sigma.
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.032)
    hot = np.bincount(draws(LOGITS, 4000, temperature=100.0), minlength=4) / 4000
    assert hot.min() > 0.2                          # near uniform at a high temperature


def test_top_k_and_top_p_restrict_the_support():
    assert set(draws(LOGITS, 500, temperature=1.0, top_k=2)) == {0, 1}
    assert set(draws(LOGITS, 500, temperature=1.0, top_p=0.8)) == {0, 1}   # 0.5 + 0.3 >= 0.8
    assert set(draws(LOGITS, 500, temperature=1.0, top_p=0.81)) == {0, 1, 2}
    assert set(draws(LOGITS, 200, temperature=1.0, top_k=1)) == {0}
    assert set(draws(LOGITS, 200, temperature=1.0, top_p=0.01)) == {0}


def test_same_seed_same_tokens_and_filters_that_keep_everything_change_nothing():
    logits = jax.random.normal(jax.random.key(1), (64, 50)) * 3
    pos = jnp.arange(64, dtype=jnp.int32)
    a, _ = sample(logits, arrays(64, temperature=0.7, seed=5), pos)
    b, _ = sample(logits, arrays(64, temperature=0.7, seed=5), pos)
    c, _ = sample(logits, arrays(64, temperature=0.7, seed=6), pos)
    # top_k = V keeps every token, but takes the sorted path: the same draws.
    d, _ = sample(logits, arrays(64, temperature=0.7, seed=5, top_k=50), pos)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, d)
    assert (np.asarray(a) != np.asarray(c)).any()


def test_rows_are_independent_of_their_batch():
    """A row's draw depends on (seed, position, logits), not on the rows beside it."""
    logits = jax.random.normal(jax.random.key(2), (4, 40)) * 2
    mixed = dataclasses.replace(SamplingArrays.greedy(4),
                                temperature=np.array([0.0, 1.0, 0.5, 1.0], np.float32),
                                top_p=np.array([1.0, 0.9, 1.0, 1.0], np.float32),
                                top_k=np.array([0, 0, 5, 0], np.int32),
                                seed=np.array([0, 11, 12, 13], np.uint32))
    pos = jnp.array([3, 4, 5, 6], jnp.int32)
    together, _ = sample(logits, mixed, pos)
    for i in range(4):
        alone = jax.tree.map(lambda x: np.asarray(x)[i: i + 1], mixed)
        one, _ = sample(logits[i: i + 1], alone, pos[i: i + 1])
        assert int(one[0]) == int(together[i])


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("inf")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -1), ("max_tokens", 0), ("max_tokens", 2.5), ("seed", -1), ("seed", 2 ** 32),
    ("stop", [1.5]), ("logprobs", 1), ("temperature", True)])
def test_sampling_params_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(BadRequest, match=field):
        SamplingParams(**{field: value})
