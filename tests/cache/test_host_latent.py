"""The latent cache held in host memory (runtime field `latent_memory = "host"`): its pages as
32-bit words (kernels/page_words.py), staged into HBM a group at a time
(cp_runtime.cache.host_pages), and a step's writes, selections and gathered tables over them
(cp_runtime.model.host_latent). Everything a session does over a host-held cache gives, bit
for bit, what it gives over a device-held one: prompts in both attention layouts, decode steps
through the decode kernel reading words, forks, exported and restored rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from conftest import make_engine, random_tokens
from cp_runtime.cache import host_pages
from cp_runtime.config import ConfigError, RuntimeConfig
from cp_runtime.kernels import page_words, sparse_decode
from cp_runtime.kernels.packing import interpret_params


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.uint8])
def test_words_pack_rows_as_a_tpu_does_and_come_back_bit_for_bit(dtype):
    """Word (i, l) holds rows pk i .. pk i + pk - 1 of lane l: what `pltpu.bitcast` of the
    words gives inside a kernel, here checked in interpret mode."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 256, (3, 16, 256 * jnp.dtype(dtype).itemsize), dtype=np.uint8)
    pages = jax.lax.bitcast_convert_type(
        jnp.asarray(bits).reshape(3, 16, 256, -1), dtype).reshape(3, 16, 256)
    words = page_words.to_words(pages)
    assert words.dtype == jnp.uint32
    assert words.shape == (3,) + page_words.page_words(16, 256, jnp.dtype(dtype).itemsize)
    back = page_words.from_words(words, dtype)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8),
                                  np.asarray(pages).view(np.uint8))

    def kernel(w_ref, o_ref):
        o_ref[...] = pltpu.bitcast(w_ref[...], dtype)

    in_kernel = pl_call(kernel, words[1], jax.ShapeDtypeStruct((16, 256), dtype))
    np.testing.assert_array_equal(np.asarray(in_kernel).view(np.uint8),
                                  np.asarray(pages[1]).view(np.uint8))


def pl_call(kernel, x, out):
    from jax.experimental import pallas as pl
    return pl.pallas_call(kernel, out_shape=out, interpret=interpret_params(True))(x)


def test_pages_are_staged_and_written_back_a_group_at_a_time():
    """Counts that are not whole groups: the pages past `count` are the sentinel's, and only
    the first `count` pages are written back."""
    rng = np.random.default_rng(1)
    words = jnp.asarray(rng.integers(0, 2**32, (40, 4, 128), dtype=np.uint32))
    slots = jnp.asarray([7, 3, 30, 11, 0, 25, 12, 5, 9, 21, 33], jnp.int32)
    staged = host_pages.read_pages(words, slots, jnp.int32(9))
    assert staged.shape == (2 * host_pages.GROUP + 1, 4, 128)
    np.testing.assert_array_equal(staged[:9], words[slots[:9]])
    np.testing.assert_array_equal(staged[9:16], jnp.broadcast_to(words[-1], (7, 4, 128)))
    assert not np.asarray(staged[16]).any()
    pages = jnp.asarray(rng.integers(0, 2**32, (11, 4, 128), dtype=np.uint32))
    out = np.asarray(host_pages.write_pages(words, pages, slots, jnp.int32(9)))
    expect = np.asarray(words).copy()
    expect[np.asarray(slots[:9])] = np.asarray(pages[:9])
    np.testing.assert_array_equal(out[:-1], expect[:-1])      # the sentinel took the rest


def test_owned_first_puts_the_owned_entries_first_in_slot_order():
    order, count = host_pages.owned_first(jnp.asarray([9, 2, 9, 4, 1, 9, 2], jnp.int32), 9)
    assert int(count) == 4 and np.asarray(order).tolist() == [4, 1, 6, 3, 0, 2, 5]


def test_latent_memory_is_checked():
    with pytest.raises(ConfigError, match="latent_memory='disk' is not one of"):
        RuntimeConfig(latent_memory="disk")


def test_the_decode_kernel_reads_words_as_it_reads_pages():
    """sparse_decode over the words of a pool against the same kernel over its pages: the same
    bits, so the same outputs exactly (interpret mode)."""
    rng = np.random.default_rng(2)
    pool = jnp.asarray(rng.standard_normal((9, 16, 256)), jnp.float8_e4m3fn)
    q = jnp.asarray(rng.standard_normal((2, 1, 8, 256)), jnp.bfloat16)
    slots = jnp.asarray([[[3, -1, 5, 0]], [[8, 2, -1, 7]]], jnp.int32)
    pages = jnp.asarray([[[0, 1, 2, 3]], [[3, 2, 1, 0]]], jnp.int32)
    pos = jnp.asarray([[60], [50]], jnp.int32)
    kw = dict(value_dim=128, scale=0.1, interpret=True)
    o, lse = sparse_decode.sparse_decode(q, pool, slots, pages, pos, **kw)
    ow, lsew = sparse_decode.sparse_decode(q, page_words.to_words(pool), slots, pages, pos,
                                           page_dtype=np.dtype(jnp.float8_e4m3fn), **kw)
    np.testing.assert_array_equal(o, ow)
    np.testing.assert_array_equal(lse, lsew)


def _session(model, params, memory: str, shards: int, length: int, **runtime):
    """A prompt's logits, two decode steps', a fork's decode step, the rows the session
    exports, and a decode step of a session restored from them."""
    engine = make_engine(model, params, num_shards=shards, pages_per_shard=24, page_size=16,
                         chunk_size=64, latent_memory=memory, **runtime)
    s = engine.create_session()
    prompt = engine.extend(s.id, random_tokens(model, length, seed=3), all_logits=True)
    steps = [engine.decode([s.id], [7]), engine.decode([s.id], [9])]
    fork = engine.fork(s.id)
    steps.append(engine.decode([fork.id], [11]))
    tokens, rows = engine.export_session(s.id)
    restored = engine.restore_session("restored", tokens, rows)
    while engine.has_work:
        engine.step()
    steps.append(engine.decode([restored.id], [13]))
    return [np.asarray(prompt)] + [np.asarray(x) for x in steps], rows, engine


@pytest.mark.parametrize("shards,length,runtime", [
    pytest.param(16, 200, dict(kv_cache_dtype="fp8_e4m3"), marks=pytest.mark.slow),
    (16, 200, dict(kv_cache_dtype="bf16", weights="sharded", attention="gather_kv",
                   row_attention="weights", chunk_halves="on")),
    pytest.param(4, 400, dict(kv_cache_dtype="fp8_e4m3"), marks=pytest.mark.slow)],
    ids=["fp8-gather_q", "bf16-gather_kv", "fp8-selected-pages"])
def test_a_session_over_a_host_held_cache_matches_a_device_held_one(tiny, tiny_params, shards,
                                                                    length, runtime):
    """(The fp8 cases are slow, for the default suite's time budget: the bf16 case and, for
    the selected pages over both tiers, test_a_prompt_takes_hbm_from_a_finished_session_...
    cover their paths.) 200 tokens over 16 shards: a decode row's K + 1 selected entries outnumber its table's
    pages on a shard, so the step stages the tables (gather_kv's chunks as two halves, each
    gathering its pages ahead); 400 over 4 shards: a table of 7 pages a shard, so a decode step
    stages the selected pages alone."""
    device, device_rows, _ = _session(tiny, tiny_params, "device", shards, length, **runtime)
    host, host_rows, engine = _session(tiny, tiny_params, "host", shards, length, **runtime)
    latent = engine.executor.pool.latent[0]
    assert latent.dtype == jnp.uint32 and latent.shape[2:] == (16 // 4 * (
        1 if runtime["kv_cache_dtype"] == "fp8_e4m3" else 2), tiny.latent_dim)
    for a, b in zip(device, host):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(device_rows.latent, host_rows.latent)
    np.testing.assert_array_equal(device_rows.indexer, host_rows.indexer)


def _tiered(words: jax.Array, device_pages: int) -> host_pages.TieredPages:
    """words u32[P + 1, 4, 128] (fp8 pages of 16 x 128) split as a shard holding its first
    `device_pages` slots in HBM, those as fp8 pages."""
    pages = page_words.from_words(words[:device_pages], jnp.float8_e4m3fn)
    return host_pages.TieredPages(
        device=jnp.concatenate([pages, jnp.zeros_like(pages[:1])]), host=words[device_pages:])


def _joined(tiered: host_pages.TieredPages) -> np.ndarray:
    return np.concatenate([np.asarray(page_words.to_words(tiered.device[:-1])),
                           np.asarray(tiered.host)])


def test_tiered_words_read_and_write_as_one_buffer():
    """Slots in both tiers, in no order, a count short of the entries: the pages read are the
    one buffer's, and the pages written land where the one buffer's would."""
    rng = np.random.default_rng(4)
    words = jnp.asarray(rng.integers(0, 2**32, (40, 4, 128), dtype=np.uint32))
    tiered = _tiered(words, 12)
    assert tiered.shape == words.shape and tiered.dtype == jnp.uint32
    assert tiered[None].shape == (1,) + words.shape
    slots = jnp.asarray([30, 3, 11, 12, 0, 25, 39, 5, 21, 33, 7], jnp.int32)
    staged = host_pages.read_pages(tiered, slots, jnp.int32(9))
    assert staged.shape == host_pages.read_pages(words, slots, jnp.int32(9)).shape
    np.testing.assert_array_equal(staged[:9], words[slots[:9]])
    pages = jnp.asarray(rng.integers(0, 2**32, (11, 4, 128), dtype=np.uint32))
    out = host_pages.write_pages(tiered, pages, slots, jnp.int32(9))
    expect = np.asarray(host_pages.write_pages(words, pages, slots, jnp.int32(9)))
    np.testing.assert_array_equal(_joined(out)[:-1], expect[:-1])
    page = host_pages.read_pages(tiered, jnp.asarray([30], jnp.int32), jnp.int32(1))
    copied = host_pages.write_pages(tiered, page[:1], jnp.asarray([2], jnp.int32), jnp.int32(1))
    np.testing.assert_array_equal(_joined(copied)[2], np.asarray(words[30]))


def test_latent_device_pages_are_checked():
    with pytest.raises(ConfigError, match="latent_device_pages=4 needs latent_memory='host'"):
        RuntimeConfig(latent_device_pages=4)
    with pytest.raises(ConfigError, match="less than pages_per_shard=64"):
        RuntimeConfig(latent_memory="host", latent_device_pages=64)


@pytest.mark.parametrize("shards,length,in_hbm,runtime", [
    pytest.param(16, 200, 1, dict(kv_cache_dtype="bf16", weights="sharded",
                                  attention="gather_kv", row_attention="weights",
                                  chunk_halves="on"), marks=pytest.mark.slow),
    pytest.param(4, 400, 3, dict(kv_cache_dtype="fp8_e4m3"), marks=pytest.mark.slow)],
    ids=["bf16-gather_kv", "fp8-selected-pages"])
def test_a_session_over_both_tiers_matches_a_device_held_cache(tiny, tiny_params, shards,
                                                               length, in_hbm, runtime):
    """`in_hbm` of each shard's 24 slots in HBM (both slow, for the default suite's time
    budget; the default run has the tiers' unit test and the spill's session test). 16
    shards, one: the prompt's pages there, the fork's copy and the restored session's on the
    host. 4 shards, three: the prompt's first three pages of each shard there, its other four
    on the host, so its table mixes the two."""
    device, device_rows, _ = _session(tiny, tiny_params, "device", shards, length, **runtime)
    tiered, tiered_rows, engine = _session(tiny, tiny_params, "host", shards, length,
                                           latent_device_pages=in_hbm, **runtime)
    latent = engine.executor.pool.latent[0]
    assert host_pages.is_tiered(latent) and latent.device.shape[1] == in_hbm + 1
    for a, b in zip(device, tiered):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(device_rows.latent, tiered_rows.latent)
    np.testing.assert_array_equal(device_rows.indexer, tiered_rows.indexer)


def _two_prompts(model, params, **runtime):
    """Session a's prompt and a decode step, then session b's prompt, then a decode step of
    each. (One row a step: the XLA attention path sums a block's pages, its rows' together, in
    slot order, and the two runs place b's pages below and above a's.)"""
    engine = make_engine(model, params, num_shards=4, pages_per_shard=24, page_size=16,
                         chunk_size=64, **runtime)
    a, b = engine.create_session(), engine.create_session()
    out = [engine.extend(a.id, random_tokens(model, 400, seed=5), all_logits=True),
           engine.decode([a.id], [7]),
           engine.extend(b.id, random_tokens(model, 400, seed=6), all_logits=True),
           engine.decode([a.id], [9]), engine.decode([b.id], [11])]
    return [np.asarray(x) for x in out], engine, a, b


@pytest.mark.slow     # over a minute on 2 cores
def test_a_prompt_takes_hbm_from_a_finished_session_which_moves_to_the_host(tiny, tiny_params):
    """8 of 24 slots a shard in HBM, two prompts of 7 pages a shard: a's prompt fills HBM, so
    b's moves a's pages to the host (copied) and is prefilled in HBM; every output is, bit for
    bit, what a device-held cache gives."""
    device, _, _, _ = _two_prompts(tiny, tiny_params)
    tiered, engine, a, b = _two_prompts(tiny, tiny_params, latent_memory="host",
                                        latent_device_pages=8)
    for x, y in zip(device, tiered):
        np.testing.assert_array_equal(x, y)
    assert min(a.table.slots) >= 8 and max(b.table.slots[:25]) < 8
    # Both prompts ran the device pool's programs over the HBM tier; a's decode after the
    # spill, the staging program.
    assert {shape[1] for shape in engine.executor._shapes_run} == {True, False}
    stats = engine.stats()
    assert stats["pages_spilled_total"] == 26
    assert sum(stats["hbm_pages_free_per_shard"]) == 4 * 8 - 26
    engine.allocator.check_invariants()
