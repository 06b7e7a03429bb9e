"""fp8 plumbing: one cast at the backend's entry for every writer, readers upcast, and an error
gate of the fp8 cache against an identical bf16 cache on the prefill and decode paths."""

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.benchmarks.kernel_error import CACHE_ERROR_BOUNDS, cache_error
from conftest import make_engine, random_tokens
from cp_runtime.pool import PoolSpec


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
