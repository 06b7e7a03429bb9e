"""The experts' grouped matmul from fp8 blocks (kernels/expert_matmul.py): equal to its
reference in interpret mode for every shape of grouping, the MoE layer through it equal to the
XLA paths, and compiled for TPU7x at GLM-5.2's per-device shapes, reading only the experts a
decode step's rows choose."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot import hlo, topology
from cp_runtime.config import load_model_config
from cp_runtime.kernels import expert_matmul, fp8_rows, reference
from cp_runtime.kernels.vmem import VMEM_BUDGET_BYTES
from cp_runtime.model import moe
from cp_runtime.weights.fp8_blocks import quantize

# Under CI (which installs the tpu extra) a missing libtpu fails these instead of skipping them.
needs_libtpu = pytest.mark.skipif(not topology.has_libtpu() and not os.environ.get("CI"),
                                  reason="needs libtpu (tpu extra)")

# Interpret mode against the f32 reference: both sum exact bf16 x fp8 products in f32, in a
# different order. Measured worst relative error 5e-7 over these cases.
KERNEL_BOUND = 1e-5


def _weights(rng, e, k, m, runs):
    w = rng.standard_normal((e, k, m)).astype(np.float32)
    values, scales = quantize(w, runs)
    return jnp.asarray(values), jnp.asarray(scales)


@pytest.mark.parametrize("rows, sizes, shape, runs", [
    (8, [3, 0, 5, 0], (4, 256, 256), (128, 128)),          # decode: a few rows, empty groups
    (40, [3, 0, 20, 10, 2], (5, 128, 384), (64, 128)),    # three column tiles' worth of runs
    (300, [100, 0, 190], (3, 128, 256), (128, 128)),      # 2 row tiles, groups across them
    (600, [0, 520, 0, 40], (4, 64, 32), (32, 16)),        # narrow runs; rows past the groups
    (20, [0, 0, 0], (3, 128, 128), (128, 128)),            # no rows in any group: all zero
])
def test_kernel_matches_reference(rows, sizes, shape, runs):
    rng = np.random.default_rng(rows)
    w, s = _weights(rng, *shape, runs)
    x = jnp.asarray(rng.standard_normal((rows, shape[1])), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = expert_matmul.grouped_matmul(x, w, s, sizes, interpret=True)
    want = reference.grouped_matmul(x, w, s, sizes)
    past = int(sizes.sum())
    assert not np.asarray(got[past:]).any()                # rows past the groups are zero
    scale = float(jnp.abs(want).max()) or 1.0
    assert float(jnp.abs(got - want).max()) <= KERNEL_BOUND * scale


@pytest.mark.parametrize("rows, sizes, shape, runs", [
    (8, [3, 0, 5, 0], (4, 256, 256), (128, 128)),
    (300, [100, 0, 190], (3, 128, 256), (128, 128)),      # a row tile shared by two groups
])
def test_bf16_output_is_the_f32_sum_rounded_once(rows, sizes, shape, runs):
    """out_dtype=bf16 (the MoE's down projection on a TPU) writes each row's f32 sum rounded
    to bf16 as it leaves VMEM: the f32 output rounded, element for element, and the
    estimate's bytes 2 less an output value."""
    rng = np.random.default_rng(rows + 2)
    w, s = _weights(rng, *shape, runs)
    x = jnp.asarray(rng.standard_normal((rows, shape[1])), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = expert_matmul.grouped_matmul(x, w, s, sizes, out_dtype=jnp.bfloat16, interpret=True)
    f32 = expert_matmul.grouped_matmul(x, w, s, sizes, interpret=True)
    assert got.dtype == jnp.bfloat16
    assert not np.asarray(got[int(sizes.sum()):].astype(jnp.float32)).any()
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(f32.astype(jnp.bfloat16).astype(jnp.float32)))
    figures = expert_matmul.cost(rows, shape, s.shape, out_itemsize=2)
    f32_figures = expert_matmul.cost(rows, shape, s.shape)
    assert f32_figures["bytes"] - figures["bytes"] == (
        -(-rows // expert_matmul.row_tile(rows, shape[0]))
        * expert_matmul.row_tile(rows, shape[0]) * shape[2] * 2)


@pytest.mark.parametrize("rows, sizes, shape, runs", [
    (8, [3, 0, 5, 0], (4, 256, 256), (128, 128)),          # decode: a few rows, empty groups
    (300, [100, 0, 190], (3, 128, 256), (128, 128)),      # 2 row tiles; rows past the groups
])
def test_gated_kernel_matches_reference(rows, sizes, shape, runs):
    """silu(x . gate) * (x . up) in one call against the reference's (and against the two
    products of the single-weight kernel, combined outside it)."""
    rng = np.random.default_rng(rows + 1)
    gate, up = _weights(rng, *shape, runs), _weights(rng, *shape, runs)
    x = jnp.asarray(rng.standard_normal((rows, shape[1])), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = expert_matmul.grouped_matmul(x, *gate, sizes, up=up, interpret=True)
    want = reference.grouped_matmul(x, *gate, sizes, up=up)
    apart = (jax.nn.silu(expert_matmul.grouped_matmul(x, *gate, sizes, interpret=True))
             * expert_matmul.grouped_matmul(x, *up, sizes, interpret=True))
    assert not np.asarray(got[int(sizes.sum()):]).any()
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got - want).max()) <= KERNEL_BOUND * scale
    assert float(jnp.abs(got - apart).max()) <= KERNEL_BOUND * scale
    with pytest.raises(ValueError, match="not shaped as the gate"):
        expert_matmul.grouped_matmul(x, *gate, sizes, up=(up[0][:, :, :128], up[1]),
                                     interpret=True)

@pytest.mark.parametrize("rows, sizes, shape, runs", [
    (8, [3, 0, 5, 0], (4, 256, 256), (128, 128)),          # decode-sized: one tile of 8 rows
    (300, [100, 0, 190], (3, 128, 256), (128, 128)),      # fp8 tiles of 32 rows and more
    (600, [0, 520, 0, 40], (4, 64, 32), (32, 16)),        # narrow runs; rows past the groups
])
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_rows_kernel_matches_reference(rows, sizes, shape, runs, gated):
    """Rows as e4m3 with one scale a row (cp_runtime.kernels.fp8_rows; rows of very different
    sizes) against the reference over the same fp8 rows: within the kernel's bound. Against
    the unrounded rows they differ by e4m3's rounding, rel-L2 about 0.025 (0.035 gated);
    a row's scale applied twice or not at all moves them by its size."""
    rng = np.random.default_rng(rows + 7)
    gate, up = _weights(rng, *shape, runs), _weights(rng, *shape, runs)
    x = rng.standard_normal((rows, shape[1])) * rng.uniform(0.01, 100, (rows, 1))
    fp8 = fp8_rows.quantize(jnp.asarray(x, jnp.float32))
    sizes = jnp.asarray(sizes, jnp.int32)
    up = up if gated else None
    got = expert_matmul.grouped_matmul(fp8.values, *gate, sizes, up=up, row_scales=fp8.scales,
                                       interpret=True)
    want = reference.grouped_matmul(fp8.values, *gate, sizes, up=up, row_scales=fp8.scales)
    assert not np.asarray(got[int(sizes.sum()):]).any()
    assert float(jnp.abs(got - want).max()) <= KERNEL_BOUND * float(jnp.abs(want).max())
    exact = reference.grouped_matmul(jnp.asarray(x, jnp.float32), *gate, sizes, up=up)
    assert float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact)) <= 0.05
    with pytest.raises(ValueError, match="scaled rows must be fp8"):
        expert_matmul.grouped_matmul(fp8.values.astype(jnp.bfloat16), *gate, sizes,
                                     row_scales=fp8.scales, interpret=True)


@pytest.mark.parametrize("rows, sizes, shape, runs", [
    (8, [3, 0, 5, 0], (4, 256, 256), (128, 128)),          # decode-sized
    (300, [100, 0, 190], (3, 128, 256), (128, 128)),      # a row tile shared by two groups
])
@pytest.mark.parametrize("fp8", [False, True])
def test_row_weights_are_the_product_taken_outside_rounded_once(rows, sizes, shape, runs, fp8):
    """The gated call with row weights (a MoE's routing weights) and bf16 outputs, as the MoE
    layer runs it on a TPU: each row's f32 product times its weight, rounded to bf16 once,
    bit for bit what the f32 call's output times the weights, cast outside, gave before; the
    reference's weighted product within the kernel's bound (of bf16's rounding); the rows'
    scale and weight read as one block: [8, tm] a row a lane where tm is whole lane tiles (the
    300-row case; 8 f32 a row for one factor or two), else [tm, 2] (4 bytes a row a factor)."""
    rng = np.random.default_rng(rows + 11)
    gate, up = _weights(rng, *shape, runs), _weights(rng, *shape, runs)
    x = jnp.asarray(rng.standard_normal((rows, shape[1])), jnp.float32)
    scaled = fp8_rows.quantize(x) if fp8 else None
    x_in, row_scales = (scaled.values, scaled.scales) if fp8 else (x, None)
    weights = jnp.asarray(rng.uniform(0.1, 2.0, (rows, 1)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    call = functools.partial(expert_matmul.grouped_matmul, x_in, *gate, sizes, up=up,
                             row_scales=row_scales, interpret=True)
    got = call(row_weights=weights, out_dtype=jnp.bfloat16)
    before = (call() * weights).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(before.astype(jnp.float32)))
    want = reference.grouped_matmul(x_in, *gate, sizes, up=up, row_scales=row_scales,
                                    row_weights=weights)
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) <= 2 ** -8 * float(
        jnp.abs(want).max())
    itemsize = 1 if fp8 else 2
    plain = expert_matmul.cost(rows, shape, gate[1].shape, weights=2, row_itemsize=itemsize)
    weighted = expert_matmul.cost(rows, shape, gate[1].shape, weights=2, row_itemsize=itemsize,
                                  row_weights=True)
    tm = expert_matmul.row_tile(rows, shape[0], itemsize)
    padded = -(-rows // tm) * tm
    assert expert_matmul.factor_lanes(tm) == (rows == 300)
    if expert_matmul.factor_lanes(tm):
        extra = 0 if fp8 else 4 * expert_matmul.FACTOR_ROWS * padded
    else:
        extra = 4 * padded
    assert weighted["bytes"] - plain["bytes"] == extra
    with pytest.raises(ValueError, match="row weights must be"):
        call(row_weights=weights[:-1])


def test_visit_plan_reads_each_group_once():
    """Groups with rows, in order, each tile of theirs once; the tiles past the groups zeroed
    once; nothing after."""
    sizes = jnp.asarray([0, 20, 0, 3, 40], jnp.int32)     # rows 0-19, 20-22, 23-62
    tm, tiles = 16, 5
    group, tile, fresh, bounds, counts = (np.asarray(a) for a in expert_matmul.visit_plan(
        sizes, tm, tiles, expert_matmul.visits_bound(tiles * tm, 5, tm)))
    real, zeroing = counts
    assert list(zip(group[:real], tile[:real])) == [(1, 0), (1, 1), (3, 1), (4, 1), (4, 2),
                                                    (4, 3)]
    assert tile[real:zeroing].tolist() == [4]
    assert list(bounds) == [0, 0, 20, 20, 23, 63]
    assert fresh[:zeroing].tolist() == [1, 1, 0, 0, 1, 1, 1]


def test_the_plan_kernel_is_visit_plan():
    """The scalar-core plan (interpret mode) equals the XLA one, array for array: no groups
    with rows, one group, every group one row, rows past the groups, and random sizes."""
    rng = np.random.default_rng(0)
    cases = [([0, 20, 0, 3, 40], 16, 5), ([0] * 8, 16, 2), ([5, 0, 0, 0], 16, 1),
             ([1] * 8, 16, 1)]
    for _ in range(4):
        e = int(rng.integers(1, 40))
        sizes = rng.integers(0, 30, e) * (rng.random(e) < 0.6)
        tm = int(2 ** rng.integers(4, 7))
        rows = int(sizes.sum()) + int(rng.integers(0, 40))
        cases.append((sizes.tolist(), tm, max(1, -(-rows // tm))))
    for sizes, tm, tiles in cases:
        sizes = jnp.asarray(sizes, jnp.int32)
        visits = expert_matmul.visits_bound(tiles * tm, sizes.shape[0], tm)
        want = expert_matmul.visit_plan(sizes, tm, tiles, visits)
        got = expert_matmul.plan_visits(sizes, tm, tiles, visits, interpret=True)
        for name, a, b in zip(("group", "tile", "fresh", "bounds", "counts"), got, want):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: {sizes}, {tm}, {tiles}")


def _moe_params(rng, cfg, runs):
    """One MoE layer's routed experts, fp8 with block scales, in the model layout."""
    e, hid, inner = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    p = {}
    for proj, shape in (("gate", (e, hid, inner)), ("up", (e, hid, inner)),
                        ("down", (e, inner, hid))):
        w, s = _weights(rng, *shape, runs)
        p[f"mlp.experts.{proj}_proj.weight"] = w
        p[f"mlp.experts.{proj}_proj.weight_scale_inv"] = s * 0.05
    return p


@pytest.mark.parametrize("tokens", [3, 70])
def test_moe_layer_through_kernel_matches_xla_paths(tokens):
    """The routed experts through the kernel (interpret mode) against the XLA paths: the
    dequantised ragged matmul (weights rounded to bf16 once dequantised) and every expert from
    its fp8 blocks (each block's product rounded to bf16). The kernel keeps each block's
    product in f32 and rounds each row's down projection to bf16, summed in bf16; the XLA
    paths sum in f32. So they differ by bf16 rounding only: measured rel-L2 5.8e-3 / 4.7e-3
    (3 tokens) and 5.2e-3 / 4.4e-3 (70 tokens; with f32 sums 5.0e-3 / 4.1e-3 and 4.7e-3 /
    3.8e-3); bound 1e-2."""
    cfg = load_model_config("tiny")
    rng = np.random.default_rng(tokens)
    p = _moe_params(rng, cfg, (8, 8))
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), jnp.float32)
    chosen = jnp.asarray(np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok,
                                              replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, chosen.shape), jnp.float32)
    kernel = functools.partial(expert_matmul.grouped_matmul, interpret=True)
    got, _ = moe.pairs_by_expert(p, x, chosen, weights, kernel)
    ragged, _ = moe.pairs_by_expert(p, x, chosen, weights)
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))   # noqa: E731
    assert rel(got, ragged) <= 1e-2
    assert rel(got, moe.every_expert(p, x, chosen, weights)) <= 1e-2


@pytest.fixture(scope="module")
def device():
    return topology.compile_only_devices("tpu7x-16")[0]


def _compiled(device, rows, e, k, m, gated=False, out_dtype=jnp.float32, fp8=False,
              weighted=False):
    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    w, s = struct((e, k, m), jnp.float8_e4m3fn), struct((e, k // 128, m // 128), jnp.float32)
    x = struct((rows, k), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    args = (x, w, s, struct((e,), jnp.int32), struct((rows, 1), jnp.float32))
    up = (w, s) if gated else ()  # gate and up at once: up's weight and scales as the gate's

    def fn(x, w, s, sizes, factors, *up):
        return expert_matmul.grouped_matmul(x, w, s, sizes, up=up or None, out_dtype=out_dtype,
                                            row_scales=factors if fp8 else None,
                                            row_weights=factors if weighted else None)
    args = (*args, *up)
    with jax.default_device(device):
        compiled = jax.jit(fn).lower(*args).compile()
    return hlo.parse_module(compiled.as_text())


@needs_libtpu
@pytest.mark.parametrize("rows", [8, 8192 * 8])     # a B = 1 decode step; an 8K prefill chunk
@pytest.mark.parametrize("proj", ["gate", "gate_up", "down", "gate_up_fp8"])
def test_compiles_for_tpu7x_at_glm_shapes(device, rows, proj):
    """GLM-5.2's routed experts per device of tpu7x-16 (256 experts, inner 2048 / 16 = 128):
    Mosaic compiles the kernel, its cost estimate reaches the module, and the HBM bytes it
    claims are only the chosen experts' at decode (8 rows: 8 of 256 experts). gate_up_fp8:
    the prefill chunk's rows as fp8 with their scales (Strategy.mlp_rows), multiplied
    by the fp8 weights as they are, which the kernel's name tells the compiler's figures, and,
    as the MoE layer calls it, each row's product times its routing weight written in bf16."""
    cfg = load_model_config("glm-5.2")
    e, hid, inner = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size // 16
    k, m = (inner, hid) if proj == "down" else (hid, inner)
    fp8 = proj == "gate_up_fp8"
    out_itemsize = 2 if proj == "down" or fp8 else 4  # bf16 where the model writes bf16
    module = _compiled(device, rows, e, k, m, gated=proj.startswith("gate_up"),
                       out_dtype=jnp.bfloat16 if out_itemsize == 2 else jnp.float32, fp8=fp8,
                       weighted=fp8)
    calls = [i for i in module.computations[module.entry] if i.is_kernel]
    matmul = "expert_grouped_matmul" + ("_fp8" if fp8 else "")   # priced at the fp8 rate
    assert sorted(i.name.split(".")[0] for i in calls) == [matmul, "expert_visit_plan"]
    assert [i.fp8_mxu for i in calls if i.name.startswith(matmul)] == [fp8]
    flops, nbytes = next(i for i in calls if i.name.startswith("expert_grouped")).kernel_cost
    n_w = 2 if proj.startswith("gate_up") else 1
    figures = expert_matmul.cost(rows, (e, k, m), (e, k // 128, m // 128), weights=n_w,
                                 out_itemsize=out_itemsize, row_itemsize=1 if fp8 else 2,
                                 row_weights=fp8)
    assert (flops, nbytes) == (figures["flops"], figures["bytes"])
    assert figures["vmem_bytes"] <= VMEM_BUDGET_BYTES
    weights = n_w * min(e, rows) * k * m
    assert weights <= nbytes
    if rows == 8:
        assert nbytes < 0.05 * n_w * e * k * m    # far below reading every expert
    if fp8:                                       # the rows at a byte a value, plus a scale
        bf16 = expert_matmul.cost(rows, (e, k, m), (e, k // 128, m // 128), weights=n_w)
        assert bf16["bytes"] - nbytes >= 0.9 * rows * k


def test_column_tiles_take_whole_sublane_tiles_of_scale_runs():
    """tn / gb, the scale runs a column tile's SMEM block holds, is a multiple of 8 or all of
    M's runs: GLM-5.2's down projection (6,144 columns) stays whole, an expert's 512 columns
    behind 6,144 rows (2 MB allows 256) go whole rather than in halves of 2 runs."""
    assert expert_matmul.column_tile(128, 6144, 128, 1) == 6144
    assert expert_matmul.column_tile(6144, 128, 128, 1) == 128
    assert expert_matmul.column_tile(6144, 512, 128, 1) == 512
    assert expert_matmul.column_tile(512, 6144, 128, 1) == 3072          # 24 runs of 48
    for k, m in [(6144, 2048), (2048, 6144), (7168, 256), (64, 1536)]:
        runs = expert_matmul.column_tile(k, m, 128, 1) // 128
        assert (m // 128) % runs == 0 and (runs % 8 == 0 or runs == m // 128)


@needs_libtpu
@pytest.mark.parametrize("proj", ["gate_up_fp8", "down"])
def test_compiles_for_tpu7x_with_experts_in_groups(device, proj):
    """GLM-5.2's experts in 4 groups of 64 whole-row experts, 512 of their inner features a
    device: column tiles of part of M compile (the scales' block in whole runs of 8)."""
    e, hid, inner = 64, 6144, 512
    k, m = (inner, hid) if proj == "down" else (hid, inner)
    fp8 = proj == "gate_up_fp8"
    module = _compiled(device, 40960, e, k, m, gated=fp8, out_dtype=jnp.bfloat16, fp8=fp8,
                       weighted=fp8)
    assert any(i.name.startswith("expert_grouped_matmul")
               for i in module.computations[module.entry] if i.is_kernel)
