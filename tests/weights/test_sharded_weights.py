"""Weights split over the `cp` mesh (runtime weights = "sharded") against the same weights whole
on every device: same logits, 1/S of the bytes per device, and the MoE's grouped matmul against
a dense loop over every expert."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import make_engine, random_tokens, rel_l2
from cp_runtime.config import ConfigError, RuntimeConfig, load_model_config
from cp_runtime.kernels import expert_matmul
from cp_runtime.kernels.reference import dequantize
from cp_runtime.kernels.dispatch import EVERY_EXPERT_MAX_ROWS
from cp_runtime.model.indexer_inputs import INDEXER_Q_WEIGHT, IndexerInputs, indexer_queries
from cp_runtime.model.mlp import mlp, swiglu
from cp_runtime.model.moe import every_expert, pairs_by_expert
from cp_runtime.model.expert_router import dense_expert_weights, top_k_experts
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.fp8_blocks import quantize
from cp_runtime.weights.format import resolve_runtime_weights
from cp_runtime.weights.sharding import split_of
from cp_runtime.weights.shards import FUSED_GATHER_MAX_ROWS, WeightShards
from cp_runtime.weights.params import init_params, layer_params, model_layout, model_shapes

DEEPSEEK_MINI = load_model_config("deepseek-mini")
# The experts' fp8 kernel (interpret mode) against f64 on the dequantised weights: bf16 inputs,
# exact block products in f32. Measured rel-L2 2.9e-3 (the XLA paths: 4.2e-3, 5.0e-3);
# bound 1e-2.
KERNEL_AGAINST_F64 = 1e-2


def _prefill(model, params, shards: int, weights: str) -> np.ndarray:
    """Logits f32[40, V] of every query of a 40-token prefill (one step: one compile; decode
    steps with split weights are compared over Ray in test_ray)."""
    engine = make_engine(model, params, kv_cache_dtype="f32", num_shards=shards,
                         pages_per_shard=max(8 // shards, 2), page_size=16, chunk_size=64,
                         weights=weights)
    s = engine.create_session()
    return engine.extend(s.id, random_tokens(model, 40, seed=3), all_logits=True)


@pytest.mark.parametrize("model_name", ["tiny", "deepseek-mini"])
# S = 1 (a split into one part) runs with the slow tests; S = 16 splits, pads and gathers.
@pytest.mark.parametrize("shards", [pytest.param(1, marks=pytest.mark.slow), 16])
def test_sharded_weights_give_the_replicated_logits(model_name, shards):
    model = load_model_config(model_name)
    params = init_params(model, seed=0)
    whole = _prefill(model, params, shards, "replicated")
    split = _prefill(model, params, shards, "sharded")
    assert rel_l2(split, whole) <= 1e-5


def test_each_device_holds_a_sixteenth_of_the_split_weights():
    model = DEEPSEEK_MINI
    engine = make_engine(model, init_params(model, seed=0), kv_cache_dtype="f32", num_shards=16,
                         pages_per_shard=2, page_size=16, weights="sharded")
    shapes = model_shapes(model)
    split_bytes = sum(4 * math.prod(s) for n, s in shapes.items() if split_of(n, s, model))
    whole_bytes = sum(4 * math.prod(s) for n, s in shapes.items() if not split_of(n, s, model))
    per_device = engine.executor.weight_bytes()
    assert len(per_device) == 16
    assert set(per_device.values()) == {split_bytes // 16 + whole_bytes}
    # Whole on every device: norms, biases, the router and the down projections from x.
    whole_kinds = {n.split(".")[-2] for n, s in shapes.items()
                   if len(s) > 1 and not split_of(n, s, model)}
    assert whole_kinds == {"gate", "q_a_proj", "kv_a_proj_with_mqa", "wk", "weights_proj"}
    assert whole_bytes < 0.1 * split_bytes
    assert engine.executor.stats()["weight_bytes_per_device"] == split_bytes // 16 + whole_bytes


def test_grouped_experts_match_a_dense_loop_over_every_expert():
    """The MoE layer (tokens go only to their k experts, ragged_dot) against running every
    expert on every token and weighting by the router's dense weights."""
    model = DEEPSEEK_MINI
    hf = init_params(model, seed=1)
    p = layer_params(model_layout(hf, model), 1)
    p_hf = layer_params(hf, 1)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 7, model.hidden_size)),
                    jnp.float32)
    gate = dense_expert_weights(model, jnp.einsum("...i,oi->...o", x, p_hf["mlp.gate.weight"]),
                                p_hf["mlp.gate.e_score_correction_bias"])
    dense = sum(gate[..., e, None] * swiglu(p_hf, f"mlp.experts.{e}", x)
                for e in range(model.n_routed_experts))
    dense = dense + swiglu(p_hf, "mlp.shared_experts", x)
    assert rel_l2(mlp(p, model, 1, x), dense) <= 1e-6
    assert int((gate > 0).sum(-1).max()) == model.num_experts_per_tok


def test_merge_variants_need_their_weight_split():
    with pytest.raises(ConfigError, match="head_scatter.*needs weights='sharded'"):
        RuntimeConfig(merge="head_scatter", weights="replicated")
    # "auto" is checked once it is resolved: the tiny model replicates, which head_scatter
    # cannot run with.
    with pytest.raises(ConfigError, match="head_scatter.*needs weights='sharded'"):
        resolve_runtime_weights(RuntimeConfig(merge="head_scatter"), load_model_config("tiny"),
                                device_bytes=2**34)
    with pytest.raises(ConfigError, match="hidden_psum.*needs weights='replicated'"):
        RuntimeConfig(merge="hidden_psum", weights="sharded")
    with pytest.raises(ConfigError, match="weights='halved' is not one of"):
        RuntimeConfig(weights="halved")


def test_fp8_experts_run_from_their_blocks_as_the_dequantised_grouped_matmul():
    """A few tokens through fp8 experts with block scales: every expert from its fp8 blocks
    (each block's scale applied to its partial product in f32) against the grouped matmul over
    weights dequantised to bf16, and both against f64 on the dequantised values. Measured
    rel-L2 against f64: 4.2e-3 from the blocks (bf16 inputs and block products), 5.0e-3
    grouped (bf16 inputs and weights), 5.5e-3 between the two; bound 1e-2."""
    model = DEEPSEEK_MINI
    rng = np.random.default_rng(4)
    p, dequantised = {}, {}
    for proj, (a, b) in (("gate", (64, 32)), ("up", (64, 32)), ("down", (32, 64))):
        w = rng.standard_normal((model.n_routed_experts, a, b)).astype(np.float32)
        values, scales = quantize(w, (16, 16))
        name = f"mlp.experts.{proj}_proj.weight"
        p[name], p[name + SCALE_SUFFIX] = jnp.asarray(values), jnp.asarray(scales)
        runs = values.astype(np.float64).reshape(-1, a // 16, 16, b // 16, 16)
        dequantised[proj] = (runs * scales.reshape(-1, a // 16, 1, b // 16, 1)).reshape(w.shape)
    x = rng.standard_normal((EVERY_EXPERT_MAX_ROWS, 64)).astype(np.float32)
    chosen, weights = top_k_experts(model, jnp.asarray(rng.standard_normal((len(x), 32)),
                                                       jnp.float32), jnp.zeros((32,)))
    chosen, weights = np.asarray(chosen), np.asarray(weights)

    def silu(v):
        return v / (1 + np.exp(-v))

    exact = np.zeros_like(x, np.float64)
    for t in range(len(x)):
        for e, wt in zip(chosen[t], weights[t]):
            h = silu(x[t] @ dequantised["gate"][e]) * (x[t] @ dequantised["up"][e])
            exact[t] += wt * (h @ dequantised["down"][e])
    args = (p, jnp.asarray(x), jnp.asarray(chosen), jnp.asarray(weights))
    blocks = every_expert(*args)
    grouped, _ = pairs_by_expert(*args)
    kernel, _ = pairs_by_expert(*args, functools.partial(expert_matmul.grouped_matmul,
                                                         interpret=True))
    assert rel_l2(blocks, exact) <= 1e-2
    assert rel_l2(grouped, exact) <= 1e-2
    assert rel_l2(kernel, exact) <= KERNEL_AGAINST_F64
    assert 0 < rel_l2(blocks, grouped) <= 1e-2


@pytest.mark.parametrize("rows", [3, FUSED_GATHER_MAX_ROWS + 1])
def test_gather_heads_of_q_and_the_indexers_q(rows):
    """A decode step's q heads and its indexer's q heads in one all-gather, both in f32 (the
    wire is bf16 here): each comes back whole and exact, padding cut (12 and 20 heads over 16
    devices). More rows: one gather each, q in the wire's bf16, the indexer's q in f32."""
    mesh = jax.make_mesh((16,), ("cp",))
    ws = WeightShards(axis="cp", wire_dtype="bf16")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "cp"), P(None, "cp")),
                       out_specs=P(), check_vma=False)
    def run(q, iq):
        return ws.gather_heads(q, 12, iq, 20)

    rng = np.random.default_rng(0)
    q = rng.normal(size=(rows, 16, 24)).astype(np.float32)        # one head a device
    iq = rng.normal(size=(rows, 32, 8)).astype(np.float32)        # two heads a device
    shard = NamedSharding(mesh, P(None, "cp"))
    got_q, got_iq = run(jax.device_put(q, shard), jax.device_put(iq, shard))
    assert got_q.shape == (rows, 12, 24) and got_iq.shape == (rows, 20, 8)
    np.testing.assert_array_equal(np.asarray(got_iq), iq[:, :20])
    if rows <= FUSED_GATHER_MAX_ROWS:
        np.testing.assert_array_equal(np.asarray(got_q), q[:, :12])
    else:
        np.testing.assert_array_equal(
            np.asarray(got_q), np.asarray(jnp.asarray(q[:, :12], jnp.bfloat16), np.float32))


def test_split_rows_sum_into_their_devices_and_gather_back():
    """The residual stream split by row: partial sums [2, 32, 8] (one a device) reduce-scatter
    into each device's 4 of the 64 rows (join_rows in the wire's bf16, psum_rows exact),
    own_rows picks the same rows of an array every device holds, and gather_rows_of brings
    every device's rows back in [2, 32] order: the wired one rounded to bf16, the others exact
    in one collective."""
    mesh = jax.make_mesh((16,), ("cp",))
    ws = WeightShards(axis="cp", wire_dtype="bf16", rows_split=True)
    rng = np.random.default_rng(1)
    parts = rng.normal(size=(16, 2, 32, 8)).astype(np.float32)
    pos = np.arange(64, dtype=np.int32).reshape(2, 32)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("cp"), P()),
                       out_specs=(P("cp"), P("cp"), P("cp"), P()), check_vma=False)
    def run(part, pos):
        joined, exact = ws.join_rows(part[0]), ws.psum_rows(part[0])
        own = ws.own_rows(pos)
        back = ws.gather_rows_of({"a": exact, "b": exact[:, :3] * 2, "own": own[:, None] * 1.0},
                                 pos.shape, wired=("a",))
        return joined, exact, own, (back["a"], back["b"], back["own"])

    joined, exact, own, (a, b, back_own) = run(
        jax.device_put(parts, NamedSharding(mesh, P("cp"))), pos)
    total = parts.sum(0).reshape(64, 8)
    np.testing.assert_allclose(np.asarray(exact), total, rtol=1e-6, atol=1e-6)
    assert 0 < np.abs(np.asarray(joined) - total).max() <= 2 ** -8 * np.abs(total).max()
    np.testing.assert_array_equal(np.asarray(own), np.arange(64))
    assert a.shape == (2, 32, 8) and b.shape == (2, 32, 3) and back_own.shape == (2, 32, 1)
    np.testing.assert_array_equal(
        np.asarray(a), np.asarray(jnp.asarray(np.asarray(exact), jnp.bfloat16),
                                  np.float32).reshape(2, 32, 8))
    np.testing.assert_array_equal(np.asarray(b), 2 * np.asarray(exact)[:, :3].reshape(2, 32, 3))
    np.testing.assert_array_equal(np.asarray(back_own)[..., 0], pos)
    with pytest.raises(ValueError, match="rows_split needs an axis"):
        WeightShards(rows_split=True)


def test_split_fp8_weights_gather_whole_with_their_scales():
    """gather_weights: a [256, 512] fp8 weight split by rows (16 a device, scale runs 16 x
    128: the runs a device's part allows) and a [512, 256] one split by columns joined on every
    device: their values and scales dequantise to exactly the whole weights' values."""
    mesh = jax.make_mesh((16,), ("cp",))
    rng = np.random.default_rng(3)
    rows_w, rows_s = quantize(rng.normal(size=(256, 512)), (16, 128))
    cols_w, cols_s = quantize(rng.normal(size=(512, 256)), (128, 16))
    p = {"a": rows_w, "a_s": rows_s, "b": cols_w, "b_s": cols_s}
    specs = {"a": P("cp"), "a_s": P("cp"), "b": P(None, "cp"), "b_s": P(None, "cp")}

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs,), out_specs=P(),
                       check_vma=False)
    def run(local):
        ws = WeightShards(axis="cp", rows_split=True, whole_heads=True)
        whole = ws.gather_weights(local, {"a": 0, "b": 1}, "_s")
        return (dequantize(whole["a"], whole["a_s"]),
                dequantize(whole["b"], whole["b_s"]))

    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in p.items()}
    a, b = run(placed)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(
        dequantize(jnp.asarray(rows_w), jnp.asarray(rows_s))))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(
        dequantize(jnp.asarray(cols_w), jnp.asarray(cols_s))))
    with pytest.raises(ValueError, match="whole_heads attends each device's own rows"):
        WeightShards(axis="cp", whole_heads=True)


def test_indexer_q_of_own_rows_is_every_rows_heads_gathered():
    """Where each device attends every head of its own rows, it makes every indexer head of
    those rows from wq_b gathered whole, and the heads are gathered by row
    (`IndexerInputs.rows`), against each device making its own heads of every row, gathered by
    head, and one device making every head of every row (S = 1; deepseek-mini: 16 indexer
    heads, one a device; fp8 wq_b with 32 x 32 scale runs). The same products of the same
    weights, each rounded to bf16 once by the projection: XLA:CPU sums a 4-row matmul in
    another order than a 64-row one, so a value may land one bf16 step away, and rope and
    the Hadamard transform (both orthonormal) spread that over its head; bound 2^-8 rel-L2,
    measured 1.7e-3 (by head 4e-8). Rounded to e4m3 (a chunk's fp8 scoring), a value near a
    rounding boundary may take the next e4m3 step: bound 2^-5, measured 8.7e-3."""
    cfg = DEEPSEEK_MINI
    mesh = jax.make_mesh((16,), ("cp",))
    rng = np.random.default_rng(5)
    name = INDEXER_Q_WEIGHT
    w, scales = quantize(rng.normal(size=(cfg.index_n_heads * cfg.index_head_dim,
                                          cfg.q_lora_rank)), (32, 32))
    q_lora = rng.normal(size=(2, 32, cfg.q_lora_rank)).astype(np.float32)
    pos = np.arange(64, dtype=np.int32).reshape(2, 32)
    specs = {name: P("cp"), name + SCALE_SUFFIX: P("cp")}
    unused = {"w": jnp.zeros((2, 32, cfg.index_n_heads)), "k": jnp.zeros((2, 32, 1))}

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P(),
                       check_vma=False)
    def run(local, q_lora, pos):
        ws = WeightShards(axis="cp", rows_split=True, whole_heads=True)
        by_head = IndexerInputs(q=indexer_queries(local, cfg, q_lora, pos),
                                heads=cfg.index_n_heads, **unused)
        whole = ws.gather_weights(local, {name: 0}, SCALE_SUFFIX)
        by_row = IndexerInputs(q=indexer_queries(whole, cfg, ws.own_rows(q_lora),
                                                 ws.own_rows(pos)), rows=pos.shape, **unused)
        rounded = [x.rounded().gathered(ws) for x in (by_head, by_row)]
        return ([x.gathered(ws).q for x in (by_head, by_row)],
                [x.q.astype(jnp.float32) * x.q_scale[..., None] for x in rounded])

    placed = {name: jax.device_put(w, NamedSharding(mesh, specs[name])),
              name + SCALE_SUFFIX: jax.device_put(scales, NamedSharding(mesh, P("cp")))}
    (by_head, by_row), (e4m3_head, e4m3_row) = run(placed, q_lora, pos)
    one_device = indexer_queries({name: jnp.asarray(w), name + SCALE_SUFFIX: jnp.asarray(scales)},
                                 cfg, q_lora, pos)
    assert by_row.shape == (2, 32, cfg.index_n_heads, cfg.index_head_dim)
    for got in (by_head, by_row):
        assert rel_l2(got, one_device) <= 2 ** -8
    assert rel_l2(e4m3_row, e4m3_head) <= 2 ** -5


def test_heads_trade_for_rows_and_back():
    """gather_kv's attention on split rows: device s holds heads [2s, 2s + 2) of every row of
    [2, 32]; heads_to_rows hands it rows [4s, 4s + 4) with all 32 heads in device order (in
    the wire's bf16, kept in bf16), and rows_to_heads returns each device its heads of every
    row (f32 exact)."""
    mesh = jax.make_mesh((16,), ("cp",))
    rng = np.random.default_rng(2)
    q = rng.normal(size=(2, 32, 32, 8)).astype(np.float32)        # [B, Q, H, D]

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, None, "cp"),
                       out_specs=(P("cp"), P(None, None, "cp"), P(None, None, "cp")),
                       check_vma=False)
    def run(heads):
        wired = WeightShards(axis="cp", wire_dtype="bf16", rows_split=True)
        exact = WeightShards(axis="cp", wire_dtype="f32", rows_split=True)
        rows = wired.heads_to_rows(heads)
        return rows, exact.rows_to_heads(exact.heads_to_rows(heads), heads.shape[:2]), \
            wired.rows_to_heads(rows, heads.shape[:2])

    rows, back, wired_back = run(jax.device_put(q, NamedSharding(mesh, P(None, None, "cp"))))
    as_bf16 = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float32)
    assert rows.shape == (64, 32, 8) and rows.dtype == wired_back.dtype == jnp.bfloat16
    assert back.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(rows), as_bf16.reshape(64, 32, 8))
    np.testing.assert_array_equal(np.asarray(back), q)
    np.testing.assert_array_equal(np.asarray(wired_back), as_bf16)
