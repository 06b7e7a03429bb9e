"""fp8 plumbing: one cast at the backend's entry for every writer, readers upcast, and an error
gate of the fp8 cache against an identical bf16 cache on the prefill and decode paths."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.benchmarks.kernel_error import CACHE_ERROR_BOUNDS, cache_error
from conftest import make_engine, random_tokens
from cp_runtime.cache.pool import PoolSpec
from cp_runtime.kernels import cache_write, reference
from cp_runtime.kernels.storage import from_storage, storage_dtype


def test_prefill_and_decode_write_identical_bytes(tiny, tiny_params):
    """The same token at the same position, once written by prefill and once by decode."""
    tokens = random_tokens(tiny, 20, 4)
    caches = []
    for split in (20, 19):                       # all by prefill / the last token by decode
        engine = make_engine(tiny, tiny_params, kv_cache_dtype="fp8_e4m3", num_shards=2,
                             pages_per_shard=4, page_size=16, chunk_size=32)
        s = engine.create_session()
        engine.extend(s.id, tokens[:split])
        if split < 20:
            engine.decode([s.id], tokens[split:])
        pool = engine.executor.pool
        # Logical page 1 (tokens 16..19) lives on shard 1, slot s.pages[1].
        caches.append([np.asarray(x)[1, s.pages[1], :4].view(np.uint8) for x in pool.latent])
    for a, b in zip(*caches):
        assert a.dtype == np.uint8 and (a == b).all()
    assert any((a != 0).any() for a in caches[0])


def test_fp8_latent_buffer_is_half_of_bf16(tiny):
    def spec(dtype):
        return PoolSpec(model=tiny, kv_cache_dtype=dtype, num_shards=4, pages_per_shard=8,
                        page_size=16)
    for fp8 in ("fp8_e4m3", "fp8_e5m2"):
        latent = np.dtype(spec(fp8).latent_dtype).itemsize * np.prod(spec(fp8).latent_shape)
        bf16 = np.dtype(spec("bf16").latent_dtype).itemsize * np.prod(spec("bf16").latent_shape)
        assert 2 * latent == bf16
        assert spec(fp8).indexer_dtype == jnp.bfloat16


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_fp8_error_gate(path):
    """rel-L2 of attention output, fp8 cache vs identical bf16 cache, bounded above and below."""
    errors = {d: cache_error(d, path, seed=0) for d in ("fp8_e4m3", "fp8_e5m2")}
    for dtype, err in errors.items():
        rel_bound, peak_bound = CACHE_ERROR_BOUNDS[(dtype, path)]
        assert 0 < err["rel_l2"] <= rel_bound, (dtype, err)
        assert 0 < err["peak"] <= peak_bound, (dtype, err)
    # Proof that the dtypes are plumbed, not aliased: fewer mantissa bits, more error.
    assert errors["fp8_e5m2"]["rel_l2"] > 1.3 * errors["fp8_e4m3"]["rel_l2"]


# ---- saturating writes ----------------------------------------------------------------------

# What each cache dtype stores for an out-of-range value (storage.saturating_cast). A plain
# astype stores NaN for every e4m3 entry past 464 and inf for e5m2 and bf16 past their max.
_BIG = [500.0, 1e6, -1e6, np.inf, -np.inf, 3.4e38, 1.5, np.nan]


def _stored(dtype) -> list[float]:
    """Expected stored values of _BIG (NaN stays NaN; see saturating_cast)."""
    m = float(jnp.finfo(dtype).max)
    big = {jnp.float8_e4m3fn: [448.0, 448.0, -448.0],
           jnp.float8_e5m2: [512.0, 57344.0, -57344.0],     # 500 is in e5m2's range: 512
           jnp.bfloat16: [500.0, 999424.0, -999424.0],      # 1e6 rounds to 999424 in bf16
           jnp.float32: [500.0, 1e6, -1e6]}[dtype]
    top = float(np.float32(3.4e38)) if dtype == jnp.float32 else m  # plain bf16 cast: inf
    return big + [m, -m, top, 1.5, np.nan]


def _write_big(dtype, path: str):
    """Write _BIG (lanes 0..7 of row 0, 1.0 elsewhere) through one write path; -> f64[8]."""
    ps, d = 16, 128
    row = np.ones((2, d), np.float32)
    row[0, : len(_BIG)] = _BIG
    new = jnp.asarray(row)
    slots, offsets = jnp.array([0, 1], jnp.int32), jnp.array([3, 0], jnp.int32)
    if path == "storage":   # the pool's form: uint8/uint16 buffers, reference.write_kv
        cache = jnp.zeros((3, ps, d), storage_dtype(dtype))
        out = from_storage(reference.write_kv(cache, new, slots, offsets, cache_dtype=dtype),
                           dtype)
    else:
        cache = jnp.zeros((3, ps, d), dtype)
        write = (functools.partial(cache_write.write_kv, interpret=True) if path == "pallas"
                 else reference.write_kv)
        out = write(cache, new, slots, offsets)
    assert out.dtype == np.dtype(dtype)
    return np.asarray(out), np.asarray(out)[0, 3, : len(_BIG)].astype(np.float64)


SAT_DTYPES = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32]


@pytest.mark.parametrize("dtype", SAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("path", ["reference", "storage", "pallas"])
def test_writes_saturate(dtype, path):
    """500, 1e6, -1e6, +-inf are stored as the dtype's largest finite value (448 in e4m3, 57344
    in e5m2) on every write path; NaN stays NaN; in-range values are untouched."""
    _, stored = _write_big(dtype, path)
    np.testing.assert_array_equal(stored, _stored(dtype))
    assert np.isfinite(stored[:-1]).all()


@pytest.mark.parametrize("dtype", SAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_pallas_write_matches_reference_bits_on_overflow(dtype):
    """One cast function in both paths, so saturated entries agree byte for byte with the pool's
    storage-form reference write. (The value-dtype reference matches as values only: XLA's CPU
    scatter into an fp8 buffer round-trips the buffer through a wider float, which turns e5m2's
    NaN 0x7e into 0x7f; both are NaN.)"""
    pallas, _ = _write_big(dtype, "pallas")
    ref, _ = _write_big(dtype, "storage")
    np.testing.assert_array_equal(pallas.view(np.uint8), ref.view(np.uint8))
    np.testing.assert_array_equal(pallas.astype(np.float64),
                                  _write_big(dtype, "reference")[0].astype(np.float64))


def test_plain_cast_would_store_nan():
    """Why the clip exists: without it e4m3 stores NaN for 500, e5m2 and bf16 store inf."""
    x = jnp.asarray(_BIG[:3], jnp.float32)
    assert np.isnan(np.asarray(x.astype(jnp.float8_e4m3fn), np.float64)).all()
    assert np.isinf(np.asarray(x[1:].astype(jnp.float8_e5m2), np.float64)).all()
    assert np.isinf(float(jnp.float32(3.4e38).astype(jnp.bfloat16)))


def _poisoned_run(tiny, tiny_params, monkeypatch, *, clip: bool):
    """Layer 0's k_pe rows of kv_a_proj_with_mqa scaled by 1e6 (k_pe ~ 1e6, e4m3 max 448): a
    20-token prefill and 2 decode steps on an fp8_e4m3 engine. Returns (logits f32[22, V],
    layer 0's latent cache bytes). clip=False swaps the saturating cast for a plain astype in
    both places that call it, to show the check can fail."""
    if not clip:
        from cp_runtime.kernels import storage
        plain = lambda x, dtype: x.astype(dtype)  # noqa: E731
        monkeypatch.setattr(storage, "saturating_cast", plain)
        monkeypatch.setattr(reference, "saturating_cast", plain)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    params = dict(tiny_params)
    params[name] = params[name].at[tiny.kv_lora_rank:].multiply(1e6)
    engine = make_engine(tiny, params, kv_cache_dtype="fp8_e4m3", num_shards=2,
                         pages_per_shard=4, page_size=16, chunk_size=32)
    tokens = random_tokens(tiny, 22, 4)
    s = engine.create_session()
    logits = [engine.extend(s.id, tokens[:20], all_logits=True)]
    logits += [engine.decode([s.id], [t]) for t in tokens[20:]]
    return np.concatenate(logits), np.asarray(engine.executor.pool.latent[0]).view(np.uint8)


@pytest.mark.parametrize("clip", [True, False], ids=["saturating", "plain_astype"])
def test_huge_k_pe_never_reaches_logits_as_nan(tiny, tiny_params, monkeypatch, clip):
    """End to end. Measured (tiny model, 2 shards, 20 + 2 tokens): with the saturating cast no
    logit is NaN and the poisoned layer's cache holds +-448 (e4m3 0x7e/0xfe) and no NaN code;
    with a plain astype every one of the 22 logit rows is NaN (the poisoned keys are read by
    every later query of the sequence) and the cache holds NaN codes (0x7f/0xff) instead. Each
    run ~15 s on the 2-core development machine."""
    logits, cache = _poisoned_run(tiny, tiny_params, monkeypatch, clip=clip)
    nan_codes, max_codes = np.isin(cache, [0x7F, 0xFF]), np.isin(cache, [0x7E, 0xFE])
    if clip:
        assert np.isfinite(logits).all()
        assert max_codes.any() and not nan_codes.any()
    else:
        assert np.isnan(logits).any(axis=-1).all()
        assert nan_codes.any() and not max_codes.any()
