"""The indexer's fp8 scoring (Strategy.indexer_scores; kernels/indexer.py `k_scale` and
`quantized_scores_inputs`): the interpreted kernel against the same rounding on the XLA path,
what the rounding costs against unrounded scores, scores that do not depend on the shard count,
and the runtime's choice. The kernel compiled for TPU7x: tests/aot/test_tpu_compile.py (the
`indexer fp8` cases of cp_runtime.aot.kernel_cases)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import make_engine, random_tokens, rel_l2
from test_kernels import indexer_inputs

from cp_runtime.aot import topology
from cp_runtime.config import (ConfigError, RuntimeConfig, Strategy, load_model_config,
                               resolve_strategy)
from cp_runtime.kernels import fp8_rows
from cp_runtime.kernels.dispatch import select_kernels
from cp_runtime.kernels.indexer import quantized_scores_inputs

# The kernel's e4m3 x e4m3 products are exact in f32, as are the XLA path's products of the
# same values widened; what differs is the f32 summation order and where each key's scale
# multiplies (the kernel: the pooled score; the XLA path: the key before the dot). Scores reach
# 61 on these shapes (4 heads of ReLU(q . k) over Di = 128); measured max 1.5e-5, four f32
# ulps of the largest score. Bound 6e-5.
KERNEL_BOUND = 6e-5
# e4m3 keeps 3 bits of mantissa: each query head and key moves by up to 2^-4 of itself.
# Measured against the unrounded scores (standard-normal queries, bf16 keys): rel-L2 2.6e-2
# (shard 0) and 2.8e-2 (shard 1). Bound 5e-2.
ROUNDING_BOUND = 5e-2

# The XLA path's scores at 1, 2 and 4 shards: its dot's summation order follows the number of
# pages a shard holds; measured 6.1e-6 relative. Bound 2e-5.
XLA_ORDER_RTOL = 2e-5

STATICS = dict(num_shards=2, key_block_pages=2)


def _scores(backend, shard, fp8, nq=6):
    q, w, cache, local, pos = indexer_inputs(jnp.bfloat16, shard=shard, num_shards=2, nq=nq)
    kernels = select_kernels(backend, 2)
    return np.asarray(kernels.indexer_page_scores(q.astype(jnp.float32), w, cache, local, pos,
                                                  jnp.int32(shard), fp8=fp8, **STATICS))


@pytest.mark.parametrize("shard", [0, 1])
@pytest.mark.parametrize("nq", [6, 40])
def test_fp8_kernel_matches_the_xla_paths_rounding(shard, nq):
    """40 queries: two query blocks, the second mostly padding."""
    got = _scores("pallas_interpret", shard, True, nq)
    for backend in ("reference", "xla"):
        ref = _scores(backend, shard, True, nq)
        seen = np.isfinite(ref)
        np.testing.assert_array_equal(np.isfinite(got), seen)
        np.testing.assert_array_equal(np.isneginf(got), ~seen)      # masked: -inf, never NaN
        assert seen.any() and not seen.all()
        assert np.abs(got[seen] - ref[seen]).max() <= KERNEL_BOUND, backend


@pytest.mark.parametrize("shard", [0, 1])
def test_fp8_scores_stay_near_the_unrounded_ones(shard):
    fp8, exact = _scores("reference", shard, True), _scores("reference", shard, False)
    seen = np.isfinite(exact)
    np.testing.assert_array_equal(np.isfinite(fp8), seen)
    assert 0 < rel_l2(fp8[seen], exact[seen]) <= ROUNDING_BOUND


def test_quantized_inputs_round_each_head_and_each_key_of_the_rows_pages():
    q, w, cache, local, _ = indexer_inputs(jnp.bfloat16, shard=0, num_shards=2, nq=6)
    r = quantized_scores_inputs(q, w, cache, local)
    b, m = local.shape
    assert r.q.dtype == r.k_cache.dtype == fp8_rows.E4M3
    assert r.k_cache.shape == (b * m + 1, *cache.shape[1:]) and r.k_scale.shape == (b, m, 16)
    np.testing.assert_array_equal(np.asarray(r.local_pages).ravel(), np.arange(b * m))
    # Each head's scale is folded into its weight: w_h * s_h, s_h = max|q_h| / 448.
    head_scale = jnp.abs(q.astype(jnp.float32)).max(-1) / fp8_rows.E4M3_MAX
    np.testing.assert_allclose(np.asarray(r.w), np.asarray(w * head_scale), rtol=1e-6)
    # Local page j of row b is the pool's slot local[b, j] (the sentinel where -1), rounded.
    slots = np.where(np.asarray(local) < 0, cache.shape[0] - 1, np.asarray(local))
    keys = np.asarray(r.k_cache[:-1], np.float32).reshape(b, m, *cache.shape[1:])
    widened = keys * np.asarray(r.k_scale)[..., None]
    original = np.asarray(cache, np.float32)[slots]
    written = np.isfinite(original)           # the test pool's unwritten rows hold NaN
    assert written.any()
    error = np.abs(widened - original)[written]
    assert np.all(error <= 2.0 ** -4 * np.abs(original[written]) + 1e-6)
    assert np.all(np.asarray(r.k_cache[-1], np.float32) == 0)


def _logical_scores(backend, num_shards, keys, q, w, q_pos, page_size):
    """Scores f32[B, Q, pages] by logical page, each shard scoring the pages it holds
    (logical page p on shard p % S, local page p // S) from a pool of its own."""
    b, pages = 1, keys.shape[0] // page_size
    out = np.full((b, q.shape[1], pages), np.nan, np.float32)
    kernels = select_kernels(backend, num_shards)
    for shard in range(num_shards):
        mine = np.arange(shard, pages, num_shards)
        pool = np.concatenate([keys.reshape(pages, page_size, -1)[mine],
                               np.zeros((1, page_size, keys.shape[1]), keys.dtype)])
        local = np.arange(len(mine), dtype=np.int32)[None]
        scores = kernels.indexer_page_scores(q, w, jnp.asarray(pool, jnp.bfloat16),
                                             jnp.asarray(local), q_pos, jnp.int32(shard),
                                             fp8=True, num_shards=num_shards,
                                             key_block_pages=2)
        out[..., mine] = np.asarray(scores)
    return out


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_fp8_scores_are_the_same_at_every_shard_count(backend):
    """Each key and query head is rounded on its own, so a page's scores do not depend on
    which shard holds it: the kernel's bit for bit at 1, 2 and 4 shards, the XLA path's to
    its summation order (the selection after the scores is exact across shard counts,
    tests/parallel/test_selection.py)."""
    rng = np.random.default_rng(5)
    ps, tokens, nq, hi, di = 16, 128, 8, 4, 128
    keys = rng.standard_normal((tokens, di)).astype(np.float32) * rng.uniform(
        0.1, 10, (tokens, 1)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((1, nq, hi, di)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((1, nq, hi)), jnp.float32)
    q_pos = jnp.asarray(np.arange(tokens - nq, tokens)[None], jnp.int32)
    one = _logical_scores(backend, 1, keys, q, w, q_pos, ps)
    assert np.isfinite(one).all()
    for shards in (2, 4):
        got = _logical_scores(backend, shards, keys, q, w, q_pos, ps)
        if backend == "pallas_interpret":
            np.testing.assert_array_equal(got, one)
        else:       # XLA:CPU's dot sums in an order that follows the pages' count
            np.testing.assert_allclose(got, one, rtol=XLA_ORDER_RTOL)


def _prompt_logits(tiny, tiny_params, shards, **runtime):
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=shards,
                         pages_per_shard=max(48 // shards, 2), page_size=16, chunk_size=32,
                         **runtime)
    s = engine.create_session()
    return engine.extend(s.id, random_tokens(tiny, 200, 3), all_logits=True)


@pytest.mark.slow        # the default suite's time budget: the scores' shard invariance is
                         # test_fp8_scores_are_the_same_at_every_shard_count's
def test_fp8_scoring_serves_the_same_logits_at_sixteen_shards_as_at_one(tiny, tiny_params):
    """The runtime with indexer_scores "fp8" (the XLA path's rounding) selects the same pages
    at S = 16 as at S = 1, so the logits agree to f32 summation order (as the unrounded path's
    do, tests/model/test_paged_model.py), and its rounding moves them from the unrounded run's."""
    fp8 = {s: _prompt_logits(tiny, tiny_params, s, indexer_scores="fp8") for s in (1, 16)}
    assert rel_l2(fp8[16], fp8[1]) <= 1e-5
    cache = _prompt_logits(tiny, tiny_params, 1, indexer_scores="cache")
    assert rel_l2(fp8[1], cache) > 0


def _indexer_scores(choice: str, mesh: Mesh) -> str:
    """RuntimeConfig's indexer_scores as a step on `mesh` resolves it."""
    return resolve_strategy(Strategy(indexer_scores=choice), load_model_config("tiny"),
                            mesh.devices.flat[0].platform).indexer_scores


def test_auto_indexer_scores_are_the_cache_on_the_cpu_and_fp8_on_a_tpu():
    cpu = Mesh(np.array(jax.devices()[:2]), ("cp",))
    assert _indexer_scores("auto", cpu) == "cache"      # the CPU: the exact path
    assert _indexer_scores("fp8", cpu) == "fp8"
    if topology.has_libtpu():
        tpu = Mesh(np.array(topology.compile_only_devices("tpu7x-16")[:2]), ("cp",))
        assert _indexer_scores("auto", tpu) == "fp8"
    with pytest.raises(ConfigError, match="indexer_scores='int4' is not one of"):
        RuntimeConfig(indexer_scores="int4")
