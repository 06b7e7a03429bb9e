"""Where the queries meet the position-sharded cache (runtime field `attention`): gather_q (every
head of q to every shard, partials merged) against gather_kv (the pages to every shard, each
attends its own heads): the same logits and greedy tokens, `auto`'s choice by bytes, and the
program it compiles for TPU7x."""


import dataclasses
import functools

import numpy as np
import pytest

from conftest import make_engine, random_tokens, rel_l2
from cp_runtime.aot import topology
from cp_runtime.config import ConfigError, RuntimeConfig, load_model_config
from cp_runtime.model.attention_modes import (HBM_BYTES_PER_ICI_BYTE, attention_layout,
                                              row_attention_mode)
from cp_runtime.model.halves import (AHEAD_LAYERS, ahead_layers, layers_gathered_ahead,
                                     layers_gathered_in_chain)
from cp_runtime.weights.params import init_params

GLM = load_model_config("glm-5.2")
MINI = load_model_config("deepseek-mini")          # 16 heads: one a shard at S = 16


def _glm_layout(rows: int, context: int, **kw) -> str:
    args = dict(rows=rows, heads=GLM.num_attention_heads, latent_dim=GLM.latent_dim,
                value_dim=GLM.kv_lora_rank, table_pages=context // 64, page_size=64,
                cache_itemsize=1, num_shards=16, split=True)
    return attention_layout("auto", **{**args, **kw})


def test_auto_gathers_the_pages_for_long_prefill_chunks_only():
    # GLM-5.2 at a 1M-token context, fp8 pages of 64: the pages weigh 671 MB; q and partials
    # 302 MB for a 1K-token chunk, 2.4 GB for an 8K one, 295 kB for a decode row.
    assert _glm_layout(8192, 1 << 20) == "gather_kv"
    assert _glm_layout(1024, 1 << 20) == "gather_q"
    assert _glm_layout(1024, 128 << 10) == "gather_kv"
    assert _glm_layout(32, 1 << 20) == "gather_q"
    # Only with heads split evenly over the shards: replicated weights or 64 heads over 48
    # shards keep every head of q.
    assert _glm_layout(8192, 1 << 20, split=False) == "gather_q"
    assert _glm_layout(8192, 1 << 20, num_shards=48) == "gather_q"
    for choice in ("gather_q", "gather_kv"):
        assert attention_layout(choice, rows=1, heads=3, latent_dim=1, value_dim=1,
                                table_pages=1, page_size=16, cache_itemsize=1, num_shards=16,
                                split=False) == choice


# GLM-5.2's q_b, kv_b and o_proj, fp8 with 128 x 128 block scales, 1/16 of them a device.
GLM_HEAD_WEIGHTS = (64 * 256 * 2048 + 64 * 448 * 512 + 6144 * 64 * 256) * (1 + 4 / 128 ** 2) // 16


def _glm_mode(rows: int, pages: int, choice: str = "auto", **kw) -> str:
    import jax.numpy as jnp

    args = dict(rows=rows, heads=GLM.num_attention_heads, latent_dim=GLM.latent_dim,
                value_dim=GLM.kv_lora_rank, hidden=GLM.hidden_size,
                q_lora_rank=GLM.q_lora_rank, entries=33,
                every_pages=pages, page_size=64, cache_dtype=jnp.float8_e4m3fn,
                num_shards=16, wire_itemsize=2, query_block=64,
                head_weight_bytes=int(GLM_HEAD_WEIGHTS), dequantised_elements=0)
    return row_attention_mode(choice, **{**args, **kw})


def test_split_rows_attend_the_way_the_kernels_bound_and_the_wire_price_lowest():
    """GLM-5.2's chunks over fp8 pages of 64, the rows split. At the end of a 1M prompt (16,416
    gathered pages) 4 heads of every row read a block's union of 16 x 33 pages for 4 heads,
    S times the reads of every head of the device's rows: every head of its rows. With 8K or
    16K rows, from the 149 MB of head-split weights gathered whole (140 MB sent; kernels read
    their fp8 blocks) rather than the rows' heads and sums (165 MB at 8K, and the relayouts
    around the all-to-alls), as the compiler priced the two (543 against 569 ms for the 8K
    chunk); with 4K rows the trade, as the weights' bytes do not shrink with the chunk. On a
    prompt's first chunk (160 pages) the cache caps every block's union, yet the weights
    still win at 8K rows (292 against 301 ms compiled: no q_lora gather in most layers, no
    heads' reduce-scatter) and each device keeps its own heads at 4K. Were kv_b dequantised
    by XLA (15 bytes a value), the first 8K chunk would keep its heads. DeepSeek-V3.2's 128
    heads (8 a device) take the weights there. A named mode is taken as it is."""
    assert _glm_mode(16_384, 16_416) == _glm_mode(16_384, 160) == "weights"
    assert _glm_mode(8192, 16_416) == _glm_mode(8192, 1936) == "weights"
    assert _glm_mode(4096, 16_416) == "rows"
    assert _glm_mode(8192, 160) == "weights"
    assert _glm_mode(4096, 160) == "heads"
    assert _glm_mode(8192, 160, dequantised_elements=64 * 448 * 512) == "heads"
    assert _glm_mode(8192, 160, heads=128) == "weights"
    assert [_glm_mode(8192, 16_416, m) for m in ("heads", "rows")] == ["heads", "rows"]
    with pytest.raises(ConfigError, match="row_attention='cols' is not one of"):
        RuntimeConfig(row_attention="cols")


def test_the_wire_is_priced_at_the_roofline_ratio():
    from cp_runtime.aot.roofline import TPU7X_DEVICE

    assert HBM_BYTES_PER_ICI_BYTE == round(TPU7X_DEVICE.hbm_bytes_per_s
                                           / TPU7X_DEVICE.ici_bytes_per_s)


def test_gather_kv_needs_split_weights_and_a_known_name():
    with pytest.raises(ConfigError, match="gather_kv.*needs weights split"):
        RuntimeConfig(attention="gather_kv", weights="replicated")
    with pytest.raises(ConfigError, match="attention='pages' is not one of"):
        RuntimeConfig(attention="pages")


@functools.lru_cache(maxsize=None)
def _run(attention: str, wire_dtype: str = "auto", kv_cache_dtype: str = "fp8_e4m3",
         length: int = 300, decoded: int = 4, residual: str = "auto",
         row_attention: str = "auto", chunk_halves: str = "auto"):
    """Logits of every query of a `length`-token prompt (chunks of 64 over 16 shards) and
    `decoded` greedy tokens (the decode steps take gather_q under auto; here each runs the
    layout it names); one run per setting for the whole module."""
    engine = make_engine(MINI, init_params(MINI, seed=0), kv_cache_dtype=kv_cache_dtype,
                         num_shards=16, pages_per_shard=4, page_size=16, chunk_size=64,
                         weights="sharded", attention=attention, wire_dtype=wire_dtype,
                         residual=residual, row_attention=row_attention,
                         chunk_halves=chunk_halves)
    s = engine.create_session()
    logits = engine.extend(s.id, random_tokens(MINI, length, seed=5), all_logits=True)
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < decoded:
        tokens.append(int(np.argmax(engine.decode([s.id], tokens[-1:])[0])))
    return logits, tokens


def test_gathering_the_pages_gives_the_logits_of_gathering_q():
    """A 300-token prompt in five chunks, fp8 cache, then decode: the pages' selection is the
    same either way, so only the softmax's summation order differs (one pass over every page
    against a merge of 16 shards' partials); bound: f32 rounding, measured 4.6e-7 rel-L2."""
    q_logits, q_tokens = _run("gather_q")
    kv_logits, kv_tokens = _run("gather_kv")
    assert np.isfinite(kv_logits).all()
    assert rel_l2(kv_logits, q_logits) <= 1e-5
    assert kv_tokens == q_tokens


@pytest.mark.parametrize("row_attention", [pytest.param("heads", marks=pytest.mark.slow),
                                           pytest.param("rows", marks=pytest.mark.slow),
                                           "weights"])
def test_splitting_the_rows_gives_the_logits_of_every_row_on_every_device(row_attention):
    """gather_kv's chunks (64 rows, 4 a shard) with the residual stream split by row (auto),
    each shard attending its own head of every row, or every head of its rows (q and outputs
    traded, or the head-split weights gathered), against every row on every device: the
    same per-row math, the sums reduce-scattered rather than all-reduced (f32 on the CPU):
    bound as above, the same greedy tokens (the decode steps run gather_q, every row on
    every device, either way)."""
    split_logits, split_tokens = _run("gather_kv", row_attention=row_attention)
    whole_logits, whole_tokens = _run("gather_kv", residual="replicated")
    assert rel_l2(split_logits, whole_logits) <= 1e-5
    assert split_tokens == whole_tokens
    with pytest.raises(ConfigError, match="residual='split' is not one of"):
        RuntimeConfig(residual="split")


def test_two_halves_of_a_chunk_give_the_logits_of_one_pass():
    """gather_kv's 64-row chunks with each device attending every head of its rows, run as two
    halves of 32 rows interleaved layer by layer (cp_runtime.model.halves; on, where auto
    leaves the CPU in one pass) against one pass: the second half attends the first's rows
    through the pages it handed on, so only the matmuls' row counts (and so XLA:CPU's
    summation orders) differ; bound as above, measured 5.2e-7 rel-L2."""
    halves_logits, halves_tokens = _run("gather_kv", row_attention="weights",
                                        chunk_halves="on")
    one_logits, one_tokens = _run("gather_kv", row_attention="weights")
    assert np.isfinite(halves_logits).all()
    assert rel_l2(halves_logits, one_logits) <= 1e-5
    assert halves_tokens == one_tokens
    with pytest.raises(ConfigError, match="chunk_halves='two' is not one of"):
        RuntimeConfig(chunk_halves="two")


def test_pages_gathered_ahead_give_the_logits_of_gathering_them_in_their_layer():
    """As two halves, every layer's pages are gathered at the start of an earlier layer
    (cp_runtime.model.halves, `ShardState.ahead`). tiny with one indexer layer and three
    shared ones: layer 0 gathers 0 and 1 beside its kernels, 0 gathers 2 and 1 gathers 3 in
    the chain. Halves against one pass, 64-row chunks over 16 shards, each device attending
    every head of its 4 rows; bound as above, measured 3.6e-7 (layer 3's pages gathered
    from layer 2's cache: 0.23)."""
    tiny = dataclasses.replace(load_model_config("tiny"),
                               indexer_types=("full", "shared", "shared", "shared"))
    assert [layers_gathered_ahead(tiny, i) + layers_gathered_in_chain(tiny, i)
            for i in range(4)] == [(0, 1, 2), (3,), (), ()]
    logits = {}
    for halves in ("on", "off"):
        engine = make_engine(tiny, init_params(tiny, seed=0), kv_cache_dtype="fp8_e4m3",
                             num_shards=16, pages_per_shard=4, page_size=16, chunk_size=64,
                             weights="sharded", attention="gather_kv", row_attention="weights",
                             chunk_halves=halves)
        s = engine.create_session()
        logits[halves] = engine.extend(s.id, random_tokens(tiny, 200, seed=3), all_logits=True)
    assert np.isfinite(logits["on"]).all()
    assert rel_l2(logits["on"], logits["off"]) <= 1e-5


def test_every_layers_pages_are_gathered_ahead_once():
    """GLM-5.2's indexers (layers 0-3, then every fourth to 71): layer 3 gathers 3 and 4
    beside its kernels (AHEAD_LAYERS), 5 and 6 in the chain, two layers before each; the six
    shared layers after 71 all in the chain; a shared layer nothing beside kernels of its own.
    Every layer is gathered by exactly one layer, before or at its own."""
    assert layers_gathered_ahead(GLM, 0) == (0,)
    assert layers_gathered_ahead(GLM, 3) == tuple(range(3, 3 + AHEAD_LAYERS)) == (3, 4)
    assert [layers_gathered_in_chain(GLM, i) for i in range(3, 8)] == [(5,), (6,), (), (), (9,)]
    assert layers_gathered_ahead(GLM, 5) == ()
    assert [layers_gathered_in_chain(GLM, i) for i in range(71, 78)] == [
        (73,), (74,), (75,), (76,), (77,), (), ()]
    _each_gathered_once(GLM, AHEAD_LAYERS)


def test_a_32k_chunk_gathers_a_whole_group_beside_its_kernels():
    """A 32K chunk's indexer kernels outlast twice the gathers a 16K chunk's do
    (`ahead_layers`): GLM-5.2's layer 3 gathers its whole group (3 and the shared 4, 5, 6)
    beside them, and nothing is left to the chain but in the last group's seven layers."""
    assert ahead_layers(8192) == ahead_layers(16384) == AHEAD_LAYERS == 2
    four = ahead_layers(32768)
    assert four == 4
    assert layers_gathered_ahead(GLM, 3, four) == (3, 4, 5, 6)
    assert [layers_gathered_in_chain(GLM, i, four) for i in range(3, 8)] == [()] * 5
    assert [layers_gathered_in_chain(GLM, i, four) for i in range(71, 78)] == [
        (), (), (75,), (76,), (77,), (), ()]
    _each_gathered_once(GLM, four)


def _each_gathered_once(cfg, ahead: int) -> None:
    """Every layer's pages gathered by exactly one layer, before or at its own."""
    by = {}
    for i in range(cfg.num_hidden_layers):
        for later in (layers_gathered_ahead(cfg, i, ahead)
                      + layers_gathered_in_chain(cfg, i, ahead)):
            assert later not in by and later >= i
            by[later] = i
    assert sorted(by) == list(range(cfg.num_hidden_layers))


@pytest.mark.slow        # the default suite's time budget: one row's case runs by default
def test_gathering_the_pages_of_two_rows_gives_the_logits_of_gathering_q():
    """Two sessions (40 and 70 tokens, both ending inside a page) decoded together, gather_kv
    against gather_q: each row finds its own table's pages among the gathered ones, and its
    new row written into its partly filled page; bound as above."""
    logits = {}
    for attention in ("gather_q", "gather_kv"):
        engine = make_engine(MINI, init_params(MINI, seed=0), kv_cache_dtype="fp8_e4m3",
                             num_shards=16, pages_per_shard=4, page_size=16, chunk_size=64,
                             weights="sharded", attention=attention)
        a, b = engine.create_session(), engine.create_session()
        engine.extend(a.id, random_tokens(MINI, 40, seed=1))
        engine.extend(b.id, random_tokens(MINI, 70, seed=2))
        logits[attention] = np.concatenate([engine.decode([a.id, b.id], [3, 4]),
                                            engine.decode([a.id, b.id], [5, 6])])
    assert rel_l2(logits["gather_kv"], logits["gather_q"]) <= 1e-5


def test_bf16_on_the_wire_rounds_only_the_joined_activations():
    """wire_dtype bf16 (what auto gives on a TPU) against f32 (auto on the CPU), gather_kv, f32
    cache, 48 tokens (one chunk, its rows split, each shard attending its rows; the prompt's
    logits only): the joined sums, and the q heads and outputs the rows trade, cross in bf16
    (on a TPU the kernels round q to bf16 anyway; the CPU's XLA path would not), so a query's
    logits move by bf16 rounding: measured per-query rel-L2 0.56% median, 0.75% at the 90th
    percentile (0.33% and 0.43% with only the sums rounded). A query can move further where rounding flips one of its discrete choices (an
    expert or a page), as in any bf16 serving: here the worst query by 7.4%; with the fp8
    cache and 300 tokens, 1.2% median, 4.7% at the 90th percentile and 63% for the worst
    query (this random-weight model amplifies)."""
    f32, _ = _run("gather_kv", "f32", "f32", 48, decoded=1, row_attention="rows")
    bf16, _ = _run("gather_kv", "bf16", "f32", 48, decoded=1, row_attention="rows")
    per_query = np.linalg.norm(bf16 - f32, axis=1) / np.linalg.norm(f32, axis=1)
    assert 0 < np.median(per_query) <= 1e-2
    assert np.percentile(per_query, 90) <= 1.5e-2


def _resolved(mesh, **knobs):
    """Strategy(**knobs) as a step on `mesh` resolves it."""
    from cp_runtime.config import Strategy, resolve_strategy

    return resolve_strategy(Strategy(**knobs), load_model_config("tiny"),
                            mesh.devices.flat[0].platform)


def test_auto_wire_dtype_is_f32_on_the_cpu():
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), ("cp",))
    assert _resolved(mesh, wire_dtype="auto").wire_dtype == "f32"
    assert _resolved(mesh, wire_dtype="bf16").wire_dtype == "bf16"
    with pytest.raises(ConfigError, match="wire_dtype='f16' is not one of"):
        RuntimeConfig(wire_dtype="f16")


def test_auto_mlp_rows_are_the_wire_on_the_cpu_and_fp8_on_a_tpu():
    import jax
    from jax.sharding import Mesh

    cpu = Mesh(np.array(jax.devices()[:2]), ("cp",))
    assert _resolved(cpu, mlp_rows="auto").mlp_rows == "wire"
    assert _resolved(cpu, mlp_rows="fp8").mlp_rows == "fp8"
    if topology.has_libtpu():
        tpu = Mesh(np.array(topology.compile_only_devices("tpu7x-16")[:2]), ("cp",))
        assert _resolved(tpu, mlp_rows="auto").mlp_rows == "fp8"
    with pytest.raises(ConfigError, match="mlp_rows='int8' is not one of"):
        RuntimeConfig(mlp_rows="int8")


needs_libtpu = pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu (tpu extra)")


@needs_libtpu
# The default run compiles the TPU's own layout (each device attending every head of its rows
# from the gathered weights); the other three (22-36 s each here) run with the slow tests.
@pytest.mark.parametrize("residual, row_attention", [
    pytest.param("auto", "rows", marks=pytest.mark.slow),
    pytest.param("auto", "heads", marks=pytest.mark.slow),
    ("auto", "weights"),
    pytest.param("replicated", "auto", marks=pytest.mark.slow)])
def test_gather_kv_prefill_compiles_for_tpu7x_without_a_merge(residual, row_attention):
    """The prefill chunk with gather_kv, compiled for tpu7x-16 with the Pallas kernels: its
    collectives are the pages' all-gather and the heads' sum in hidden space, none gathers q
    or merges partials over heads; with the rows split (auto) that sum is a reduce-scatter
    to each row's device, replicated an all-reduce, and the split rows' heads trade places by
    all-to-all. Each device attending every head of its rows, the chunk runs as two halves
    (chunk_halves auto, on a TPU): two attention kernels a layer, over pages gathered once.
    (The chunk with its logits: without them XLA drops the last layer's attention, whose
    output nothing reads.)"""
    from cp_runtime.aot.deploy import CompilePlan, compile_plan

    result = compile_plan(CompilePlan(model="deepseek-mini", page_size=16, pages_per_shard=256,
                                      chunk_size=256, context=4096, weights="sharded",
                                      attention="gather_kv", residual=residual,
                                      row_attention=row_attention,
                                      programs=("prefill_logits",)))
    program = result["programs"][0]
    assert program["compiled"], program["error"]
    phases = program["phases"]
    layers, heads = MINI.num_hidden_layers, MINI.num_attention_heads
    halves = 2 if row_attention == "weights" else 1
    assert phases["kv_gather"]["collectives"] == layers
    assert phases["sparse_attention"]["kernels"] == halves * layers
    # the merge phase holds the heads' sum in hidden space, one per layer, in bf16 (auto on a
    # TPU): 256 rows x 64 hidden x 2 bytes, of which each device keeps its 16 rows when the
    # rows are split. Split, each device attends every head of its 16 rows: an all-to-all of
    # the q heads (q_gather) and one of the outputs (merge), each producing [256 rows, 1 head]
    # in bf16
    if row_attention == "rows":
        q_bytes = 256 * (heads // 16) * MINI.latent_dim * 2
        o_bytes = 256 * (heads // 16) * MINI.kv_lora_rank * 2
        assert phases["q_gather"]["collectives"] == layers
        assert phases["q_gather"]["collective_bytes"] == layers * q_bytes
        assert phases["merge"]["collectives"] == 2 * layers
        assert phases["merge"]["collective_bytes"] == layers * (16 * 64 * 2 + o_bytes)
    elif row_attention == "weights":
        # q_b, kv_b and (every layer has its own indexer) wq_b gathered whole (q_gather),
        # o_proj (merge), in their bf16; no heads' sum, and no q_lora gathered
        m = MINI
        q_b = m.num_attention_heads * m.qk_head_dim * m.q_lora_rank * 2
        kv_b = m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * 2
        wq_b = m.index_n_heads * m.index_head_dim * m.q_lora_rank * 2
        o_proj = m.hidden_size * m.num_attention_heads * m.v_head_dim * 2
        assert set(m.indexer_types) == {"full"}
        assert phases["q_gather"]["collectives"] == 3 * layers
        assert phases["q_gather"]["collective_bytes"] == layers * (q_b + kv_b + wq_b)
        assert phases["merge"]["collectives"] == layers
        assert phases["merge"]["collective_bytes"] == layers * o_proj
    else:
        rows = 256 // 16 if residual == "auto" else 256
        assert phases["q_gather"]["collectives"] == 0
        assert phases["merge"]["collectives"] == layers
        assert phases["merge"]["collective_bytes"] == layers * rows * 64 * 2
    both = {r["layer"] for r in program["layer_phases"] if r["phase"] == "kv_gather"}
    assert both == set(range(MINI.num_hidden_layers))
