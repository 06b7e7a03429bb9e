"""kv_b's per-head products from fp8 blocks (kernels/latent_heads.py): the queries' W_uk and
the merge with W_uv, each equal to its reference in interpret mode, the references equal to the
model's XLA paths (`mla.absorbed_queries` and `OutputProjection.of_exchanged` off a TPU),
and both compiled for TPU7x at GLM-5.2's and DeepSeek-V3.2's per-device shapes with no XLA
pass left around them but copies and the scales' flattening."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot import hlo, topology
from cp_runtime.config import load_model_config
from cp_runtime.kernels import reference, latent_heads
from cp_runtime.kernels.vmem import VMEM_BUDGET_BYTES
from cp_runtime.kernels.dispatch import MODEL_KERNELS
from cp_runtime.model import mla, ops
from cp_runtime.parallel.merge import merge_received
from cp_runtime.weights.fp8_blocks import quantize

needs_libtpu = pytest.mark.skipif(not topology.has_libtpu() and not os.environ.get("CI"),
                                  reason="needs libtpu (tpu extra)")

# Interpret mode against the f32 reference: the kernel rounds its output to bf16 (2^-9 of a
# value) and its merged o to bf16 before W_uv as the reference does, summing in another
# order, so a value near a rounding boundary may round the other way. Measured worst error
# over these cases: 2.2e-3 of the output's largest value.
KERNEL_BOUND = 2.0 ** -8


def _received(rng, shards, heads, rows, dv, *, unseen=()):
    """Partials [o | lse] f32[S, H', R, Dv + 1] of a real softmax per shard; the (head, row)
    pairs in `unseen` saw no key on any shard (o = 0, lse = -inf)."""
    o = rng.standard_normal((shards, heads, rows, dv)).astype(np.float32)
    lse = (3 * rng.standard_normal((shards, heads, rows, 1))).astype(np.float32)
    lse[rng.random(lse.shape) < 0.2] = -np.inf          # shards that saw none of a row's keys
    for h, r in unseen:
        lse[:, h, r], o[:, h, r] = -np.inf, 0.0
    o[np.isneginf(lse[..., 0])] = 0.0
    return jnp.asarray(np.concatenate([o, lse], -1))


def _kv_b(rng, heads, nope, v, dv, runs=(128, 128)):
    values, scales = quantize(rng.standard_normal((heads * (nope + v), dv)).astype(np.float32),
                              runs)
    return jnp.asarray(values), jnp.asarray(scales * 0.05)


@pytest.mark.parametrize("shards, heads, rows, nope, v, dv", [
    (16, 4, 1, 192, 256, 512),          # GLM-5.2 on 16 devices, a B = 1 decode step
    (16, 8, 3, 128, 128, 512),          # DeepSeek-V3.2's head shape, 3 rows
    (4, 2, 8, 64, 64, 128),             # small: one scale run a head and a half
])
def test_kernel_matches_reference(shards, heads, rows, nope, v, dv):
    rng = np.random.default_rng(rows)
    received = _received(rng, shards, heads, rows, dv, unseen=[(1, 0)])
    w, s = _kv_b(rng, heads, nope, v, dv)
    got = latent_heads.merge_values(received, w, s, nope=nope, interpret=True)
    want = reference.merge_values(received, w, s, nope)
    assert got.shape == want.shape == (rows, heads * v) and got.dtype == jnp.bfloat16
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) <= KERNEL_BOUND * scale
    assert (got[0, v:2 * v] == 0).all()                  # head 1, row 0: no shard saw a key


@pytest.mark.parametrize("heads, rows, nope, v, rope, dv", [
    (4, 1, 192, 256, 64, 512),          # GLM-5.2 on 16 devices, B = 1
    (8, 5, 128, 128, 64, 512),          # DeepSeek-V3.2's head shape, 5 rows
])
def test_absorbed_queries_match_reference(heads, rows, nope, v, rope, dv):
    rng = np.random.default_rng(heads + rows)
    q = jnp.asarray(rng.standard_normal((heads, rows, nope + rope)), jnp.float32)
    w, s = _kv_b(rng, heads, nope, v, dv)
    got = latent_heads.absorb_queries(q, w, s, nope=nope, interpret=True)
    want = reference.absorb_queries(q, w, s, nope)
    assert got.shape == want.shape == (heads, rows, dv) and got.dtype == jnp.bfloat16
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) <= KERNEL_BOUND * scale


def _lane_model():
    """The tiny model with kv_b's shapes a TPU runs the kernels for (128-row and 128-lane
    scale runs: 2 heads of 64 + 64 rows, kv_lora 128), so the model takes the kernels' calls
    (their XLA branch off a TPU) rather than its plain path."""
    return dataclasses.replace(load_model_config("tiny"), kv_lora_rank=128,
                               qk_nope_head_dim=64, v_head_dim=64)


def test_the_models_absorbed_queries_are_the_reference():
    """Off a TPU `mla.absorbed_queries` takes the XLA branch of the kernel's call (bf16
    matmul, rounded); it differs from the f32 reference by that rounding only, and equals the
    plain einsum the model runs for long steps."""
    cfg = _lane_model()
    rng = np.random.default_rng(2)
    heads, nope, v, dv = 2, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w, s = _kv_b(rng, heads, nope, v, dv)
    assert MODEL_KERNELS.latent_heads_take(w, s, 3)
    p = {"self_attn.kv_b_proj.weight": w, "self_attn.kv_b_proj.weight_scale_inv": s}
    q = jnp.asarray(rng.standard_normal((3, heads, cfg.qk_head_dim)), jnp.float32)
    got = mla.absorbed_queries(p, cfg, q)                              # [R, H', Dv]
    ref = jnp.moveaxis(reference.absorb_queries(jnp.moveaxis(q, 0, 1), w, s, nope), 0, 1)
    assert float(jnp.abs(got - ref).max()) <= KERNEL_BOUND * float(jnp.abs(ref).max())
    plain = ops.matmul("...hn,hnc->...hc", q[..., :nope],
                        mla.kv_b_heads(p, cfg)[:, :nope])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))


def test_bad_shapes_are_refused():
    rng = np.random.default_rng(0)
    received = _received(rng, 4, 2, 1, 128)
    w, s = _kv_b(rng, 2, 64, 64, 128)
    with pytest.raises(ValueError, match="do not fit together"):
        latent_heads.merge_values(received[..., :-1], w, s, nope=64, interpret=True)
    with pytest.raises(ValueError, match="do not fit together"):
        latent_heads.merge_values(received, w, s, nope=128, interpret=True)
    with pytest.raises(ValueError, match="do not fit together"):
        latent_heads.absorb_queries(received[0, :, :, :32], w, s, nope=64, interpret=True)


def test_reference_is_the_models_xla_path():
    """Off a TPU `of_exchanged` merges in XLA and runs W_uv as `mla_output` does; with o_proj
    it equals the merge followed by the plain projection, and the reference's W_uv output
    differs from the model's by its bf16 rounding only."""
    cfg = _lane_model()
    rng = np.random.default_rng(1)
    heads, nope, v, dv = 2, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    received = _received(rng, 4, heads, 3, dv)
    w, s = _kv_b(rng, heads, nope, v, dv)
    assert MODEL_KERNELS.latent_heads_take(w, s, 3)
    o_proj = jnp.asarray(rng.standard_normal((cfg.hidden_size, heads * v)), jnp.bfloat16)
    p = {"self_attn.kv_b_proj.weight": w, "self_attn.kv_b_proj.weight_scale_inv": s,
         "self_attn.o_proj.weight": o_proj}
    projection = mla.OutputProjection(p, cfg)
    got = projection.of_exchanged(received)
    want = projection(merge_received(received))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    values = mla.merged_values(received, w, s, cfg).astype(jnp.float32)
    ref = reference.merge_values(received, w, s, nope)
    assert float(jnp.abs(values - ref).max()) <= KERNEL_BOUND * float(jnp.abs(ref).max())


@pytest.fixture(scope="module")
def device():
    return topology.compile_only_devices("tpu7x-16")[0]


def _compiled_entry(device, fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
            for shape, dtype in shapes]
    with jax.default_device(device):
        compiled = jax.jit(fn).lower(*args).compile()
    module = hlo.parse_module(compiled.as_text())
    return module.computations[module.entry]


def _check_one_kernel(entry, name, figures):
    """One Mosaic call named `name` carrying `figures` as its estimate; around it nothing that
    computes (copies between memory spaces and the scales' flattening only)."""
    calls = [i for i in entry if i.is_kernel]
    assert [i.name.split(".")[0] for i in calls] == [name]
    assert calls[0].kernel_cost == (figures["flops"], figures["bytes"])
    assert figures["vmem_bytes"] <= VMEM_BUDGET_BYTES
    assert {i.op for i in entry if not i.is_kernel} <= {
        "parameter", "copy", "reshape", "bitcast", "copy-start", "copy-done"}


@needs_libtpu
@pytest.mark.parametrize("model, rows", [("glm-5.2", 1), ("glm-5.2", 64),
                                         ("deepseek-v3.2", 1)])
def test_compiles_for_tpu7x(device, model, rows):
    """A device's heads of tpu7x-16 (GLM-5.2: 4 heads of 192 + 256 rows; DeepSeek-V3.2: 8 of
    128 + 128), at a B = 1 decode step and at the most rows the model sends (GLM-5.2)."""
    cfg = load_model_config(model)
    heads, nope, dv = cfg.num_attention_heads // 16, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    n = heads * (nope + cfg.v_head_dim)
    kv_b = ((n, dv), jnp.float8_e4m3fn)
    scales = ((n // 128, dv // 128), jnp.float32)
    received = (16, heads, rows, dv + 1)
    entry = _compiled_entry(device, lambda r, w, s: latent_heads.merge_values(
        r, w, s, nope=nope), (received, jnp.float32), kv_b, scales)
    _check_one_kernel(entry, "merge_values", latent_heads.cost(
        received, kv_b[0], scales[0], cfg.v_head_dim))
    queries = (heads, rows, cfg.qk_head_dim)
    entry = _compiled_entry(device, lambda q, w, s: latent_heads.absorb_queries(
        q, w, s, nope=nope), (queries, jnp.float32), kv_b, scales)
    _check_one_kernel(entry, "absorb_queries", latent_heads.absorb_cost(
        queries, kv_b[0], scales[0], nope))
