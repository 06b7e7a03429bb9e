"""Pool buffers are donated to the jitted steps and updated in place: the compiled step aliases
every pool buffer to its output and allocates no pool-sized temporary."""

import pytest

from conftest import make_engine, random_tokens
from cp_runtime.engine.plans import Row


def _compiled_step(engine, q):
    """The compiled step of one segment of q queries (a decode row, or a prefill chunk)."""
    ex = engine.executor
    s = engine.create_session()
    engine._reserve(s, q)
    segment = engine._segment("logits", [Row(s.table, random_tokens(engine.model, q, 0), 0)])
    args = segment.to_device(ex.mesh, engine.runtime.num_shards)
    return ex._step.lower(ex.params, ex.pool, args, kind="logits").compile(), ex


# Decode (q 1) and a prefill chunk (q 32); fp8 decode, 1.5 minutes on 2 cores, runs with the
# slow tests.
@pytest.mark.parametrize("dtype, q", [pytest.param("fp8_e4m3", 1, marks=pytest.mark.slow),
                                      ("fp8_e4m3", 32), ("bf16", 1), ("bf16", 32)])
def test_compiled_step_has_no_pool_sized_temporary(tiny, tiny_params, dtype, q):
    temps = {}
    for pages in (64, 1024):
        engine = make_engine(tiny, tiny_params, kv_cache_dtype=dtype, num_shards=16,
                             pages_per_shard=pages, page_size=16, chunk_size=32)
        compiled, ex = _compiled_step(engine, q)
        mem = compiled.memory_analysis()
        # Donation honoured: every pool buffer (per device) is aliased to an output.
        assert mem.alias_size_in_bytes >= ex.pool.nbytes() // 16
        temps[pages] = mem.temp_size_in_bytes
    latent_buffer = ex.pool.latent[0].nbytes // 16
    # Temporaries do not grow with the pool (16x more pages), and are smaller than one latent
    # buffer: no step copies a pool buffer. (Before pool buffers were stored as integers and
    # one-row writes kept as scatters, temporaries grew 15x over the same range.)
    assert temps[1024] == temps[64], temps
    assert temps[1024] < latent_buffer, (temps, latent_buffer)


def test_step_consumes_the_donated_pool(tiny, tiny_params):
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="fp8_e4m3", num_shards=16,
                         pages_per_shard=4, page_size=16, chunk_size=32)
    old = engine.executor.pool
    s = engine.create_session()
    engine.extend(s.id, random_tokens(tiny, 20, 1))
    assert all(x.is_deleted() for x in old.latent + old.indexer)
    assert not any(x.is_deleted() for x in engine.executor.pool.latent)
