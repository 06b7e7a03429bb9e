"""MLA's per-head products for every head of a device's rows (kernels/whole_heads.py): W_uk on
the queries, and W_uv then o_proj on the outputs. Each equal to its reference in interpret
mode, the references equal to the model's XLA path, and compiled for TPU7x at GLM-5.2's and
DeepSeek-V3.2's shapes for a device's own rows of a 16K and a 32K chunk."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot import hlo, topology
from cp_runtime.config import load_model_config
from cp_runtime.kernels import reference, whole_heads
from cp_runtime.kernels.dispatch import select_kernels
from cp_runtime.kernels.vmem import VMEM_BUDGET_BYTES
from cp_runtime.model import mla, ops
from cp_runtime.weights.fp8_blocks import quantize

needs_libtpu = pytest.mark.skipif(not topology.has_libtpu() and not os.environ.get("CI"),
                                  reason="needs libtpu (tpu extra)")

# Interpret mode against the reference: the same bf16 values, sums in another order; W_uv's
# product is rounded to bf16 on both sides, so an f32 sum a hair apart can round a product
# one bf16 step apart. Measured worst error 3.7e-5 of the output's largest value.
KERNEL_BOUND = 1e-4


def _case(rng, rows, heads, nope, v, dv, hidden):
    kv_b, kv_b_s = quantize(rng.standard_normal((heads * (nope + v), dv)).astype(np.float32),
                            (128, 128))
    o_proj, o_proj_s = quantize(rng.standard_normal((hidden, heads * v)).astype(np.float32),
                                (128, 128))
    o_lat = jnp.asarray(rng.standard_normal((rows, heads, dv)), jnp.float32)
    return (o_lat, jnp.asarray(kv_b), jnp.asarray(kv_b_s * 0.05), jnp.asarray(o_proj),
            jnp.asarray(o_proj_s * 0.05))


@pytest.mark.parametrize("rows, heads, nope, v, dv, hidden", [
    (64, 4, 192, 256, 512, 1024),     # GLM-5.2's head: 448 rows, scale runs crossing heads
    (40, 3, 128, 128, 256, 256),      # DeepSeek-V3.2's: 256 rows a head, whole runs
    (8, 2, 192, 256, 512, 2048),      # two column groups of o_proj's product
])
def test_kernel_matches_reference(rows, heads, nope, v, dv, hidden):
    args = _case(np.random.default_rng(rows), rows, heads, nope, v, dv, hidden)
    got = whole_heads.project_output(*args, nope=nope, interpret=True)
    want = reference.project_output(*args, nope=nope)
    assert got.shape == want.shape == (rows, hidden)
    assert float(jnp.abs(got - want).max()) <= KERNEL_BOUND * float(jnp.abs(want).max())


@pytest.mark.parametrize("rows, heads, nope, v, dv", [
    (72, 4, 192, 256, 512),           # GLM-5.2's heads: W_uk's 192 rows in 64-row pieces
    (40, 3, 128, 128, 256),           # DeepSeek-V3.2's
])
def test_absorb_matches_reference(rows, heads, nope, v, dv):
    """W_uk on every head's q_nope, q as q_b's [R, H Dq] output (q_pe's lanes ignored)."""
    rng = np.random.default_rng(rows)
    kv_b, kv_b_s = quantize(rng.standard_normal((heads * (nope + v), dv)).astype(np.float32),
                            (128, 128))
    dq = nope + 64 if nope % 128 else nope + 128
    q = jnp.asarray(rng.standard_normal((rows, heads * dq)), jnp.float32)
    kv_b, kv_b_s = jnp.asarray(kv_b), jnp.asarray(kv_b_s * 0.05)
    got = whole_heads.absorb_queries(q, kv_b, kv_b_s, heads=heads, nope=nope, interpret=True)
    want = reference.absorb_queries(jnp.moveaxis(q.reshape(rows, heads, dq), 0, 1), kv_b,
                                    kv_b_s, nope)
    assert got.shape == want.shape == (heads, rows, dv) and got.dtype == jnp.bfloat16
    # both bf16-rounded products of the same values: at most one bf16 step apart
    assert float(jnp.abs(got - want).max()) <= 2.0 ** -8 * float(jnp.abs(want).max())


@pytest.mark.parametrize("rows, heads, nope, v, dv", [
    (72, 16, 192, 256, 512),          # GLM-5.2's heads: 64 rope lanes in the second lane tile
    (300, 32, 128, 128, 256),         # a whole lane tile of rope; two groups, two row tiles
])
@pytest.mark.parametrize("interleaved", [True, False])
def test_absorb_writes_the_query_rows_with_their_rope_part(rows, heads, nope, v, dv,
                                                           interleaved):
    """With `rope` factors, the query rows as the attention takes them, [R, H, Dv + 128]:
    every head's product exactly as the call without rope writes it (the matmuls that move
    the heads into sublanes move each value unchanged, whatever the padding of the rows to
    whole tiles), its rope part rotated in VMEM as `ops.rope` rotates the same lanes,
    zeros to the lane tile's end. The two are the same f32 products and sums, rounded to
    bf16; XLA:CPU may fuse a multiply and add in one and not the other, an f32 step that can
    round to the next bf16 value (measured: 1 of 15,360 values, one bf16 step), so each
    value is held to one bf16 step and all but a thousandth to equality; a value the sum
    cancels to near zero, to one bf16 step plus the f32 sum's rounding (2^-20 of terms of
    order 1: measured 3e-8 at a value of 2.7e-6, 1 of 1.2M)."""
    rng = np.random.default_rng(rows + 1)
    kv_b, kv_b_s = quantize(rng.standard_normal((heads * (nope + v), dv)).astype(np.float32),
                            (128, 128))
    dq = nope + 64 if nope % 128 else nope + 128
    half = (dq - nope) // 2
    q = jnp.asarray(rng.standard_normal((rows, heads * dq)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 1 << 20, rows), jnp.int32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(half) / half)).astype(np.float32)
    factors = whole_heads.rope_factors(*ops.rope_cos_sin(pos, inv_freq, 1.25), nope=nope,
                                       interleaved=interleaved)
    args = (q, jnp.asarray(kv_b), jnp.asarray(kv_b_s * 0.05))
    got = whole_heads.absorb_queries(*args, heads=heads, nope=nope, rope=factors,
                                     interleaved=interleaved, interpret=True)
    apart = whole_heads.absorb_queries(*args, heads=heads, nope=nope, interpret=True)
    assert got.shape == (rows, heads, dv + 128) and got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    np.testing.assert_array_equal(got[..., :dv],
                                  np.asarray(jnp.moveaxis(apart, 0, 1), np.float32))
    q_pe = ops.rope(q.reshape(rows, heads, dq)[..., nope:], pos, inv_freq,
                        interleaved=interleaved, mscale=1.25)
    want = np.zeros((rows, heads, 128), np.float32)
    want[..., :2 * half] = np.asarray(q_pe.astype(jnp.bfloat16), np.float32)
    step = np.abs(got[..., dv:] - want)
    assert np.all(step <= 2.0 ** -7 * np.abs(want) + 2.0 ** -20), step.max()
    assert np.count_nonzero(step) <= want.size // 1000
    assert np.all(got[..., dv + 2 * half:] == 0)
    with pytest.raises(ValueError, match="absorb_queries"):
        whole_heads.absorb_queries(*args, heads=heads, nope=nope, rope=factors[:, :-64],
                                   interpret=True)


def test_query_rows_take_whole_groups_of_heads():
    """The query rows are written HEAD_GROUP heads at a time (a bf16 sublane tile of the
    heads axis): fewer heads, such as a device's own of a split q_b, are not taken."""
    glm = dict(nope=192, dq=256, kv_b_shape=(64 * 448, 512), kv_b_scales=(224, 4))
    assert whole_heads.supports_absorb(1024, 64, rope=True, **glm)
    four = glm | {"kv_b_shape": (4 * 448, 512), "kv_b_scales": (14, 4)}
    assert whole_heads.supports_absorb(1024, 4, **four)
    assert not whole_heads.supports_absorb(1024, 4, rope=True, **four)


def test_reference_is_the_models_xla_path():
    """Off a TPU `mla.mla_output` runs W_uv and o_proj in XLA, rounding o_proj's output to
    bf16 (the kernel keeps f32): the two differ by that rounding only."""
    nope, v, dv, heads = 192, 256, 512, 2
    o_lat, kv_b, kv_b_s, o_proj, o_proj_s = _case(np.random.default_rng(3), 80, heads, nope,
                                                  v, dv, 256)
    cfg = load_model_config("glm-5.2")
    p = {"self_attn.kv_b_proj.weight": kv_b, "self_attn.kv_b_proj.weight_scale_inv": kv_b_s,
         "self_attn.o_proj.weight": o_proj, "self_attn.o_proj.weight_scale_inv": o_proj_s}
    got = mla.mla_output(p, cfg, o_lat)
    want = reference.project_output(o_lat, kv_b, kv_b_s, o_proj, o_proj_s, nope=nope)
    assert float(jnp.abs(got - want).max()) <= 2.0 ** -8 * float(jnp.abs(want).max())


def test_supports_names_what_does_not_fit():
    glm = dict(heads=64, nope=192, kv_b_shape=(64 * 448, 512), kv_b_scales=(224, 4),
               o_proj_shape=(6144, 64 * 256), o_proj_scales=(48, 128))
    assert whole_heads.supports_output(1024, **glm)
    assert not whole_heads.supports_output(whole_heads.MAX_ROWS + 1, **glm)    # the sum: VMEM
    sixteen_row_runs = glm | {"kv_b_scales": (1792, 4)}
    assert not whole_heads.supports_output(1024, **sixteen_row_runs)
    assert not whole_heads.supports_output(1024, **(glm | {"nope": 100}))
    with pytest.raises(ValueError, match="project_output: .* do not fit together or the kernel"):
        whole_heads.project_output(*_case(np.random.default_rng(0), 8, 2, 192, 256, 512, 256),
                                  nope=128, interpret=True)


@pytest.fixture(scope="module")
def device():
    return topology.compile_only_devices("tpu7x-16")[0]


def test_absorb_needs_whole_lane_tiles_of_q():
    """A head's q is a block of q_b's [R, H Dq] output: DeepSeek-V3.2's Dq = 192 is no whole
    number of lane tiles, so its steps keep XLA's W_uk (GLM-5.2's is 256)."""
    ds = load_model_config("deepseek-v3.2")
    n = 128 * 256
    assert not whole_heads.supports_absorb(512, 128, 128, ds.qk_head_dim, (n, 512),
                                           (n // 128, 4))
    assert whole_heads.supports_absorb(512, 128, 128, 256, (n, 512), (n // 128, 4))


@needs_libtpu
@pytest.mark.parametrize("rows", [1024, 512])
@pytest.mark.parametrize("rope", [False, True])
def test_absorb_compiles_for_tpu7x_at_every_head(device, rows, rope):
    """GLM-5.2's W_uk for every head of a device's own rows of a 32K (1,024 rows a half) or
    16K (512) chunk, q as q_b's output (with `rope`, the query rows written whole, each
    head's rope part rotated by lane rolls): Mosaic compiles it within the VMEM budget and
    its estimate reaches the module."""
    cfg = load_model_config("glm-5.2")
    heads, nope, v, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim,
                          cfg.kv_lora_rank)

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    n = heads * (nope + v)
    args = (struct((rows, heads * cfg.qk_head_dim), jnp.float32),
            struct((n, dv), jnp.float8_e4m3fn), struct((n // 128, dv // 128), jnp.float32))
    factors = struct((rows, 2 * 128), jnp.float32) if rope else None
    with jax.default_device(device):
        absorb = jax.jit(whole_heads.absorb_queries, static_argnames=("heads", "nope"))
        compiled = absorb.lower(*args, heads=heads, nope=nope, rope=factors).compile()
    module = hlo.parse_module(compiled.as_text())
    calls = [i for i in module.computations[module.entry] if i.is_kernel]
    figures = whole_heads.absorb_cost(rows, heads, nope, v, cfg.qk_head_dim, dv,
                                      n // 128 * dv // 128, rope=rope)
    assert [i.kernel_cost for i in calls] == [(figures["flops"], figures["bytes"])]
    assert figures["vmem_bytes"] <= VMEM_BUDGET_BYTES


@needs_libtpu
def test_query_rows_reach_the_attention_kernel_as_they_lie(device):
    """GLM-5.2's query rows of a device's own 1,024 rows (a 32K chunk's half) go from the
    absorbing kernel to the sparse prefill kernel (as the TPU kernel set hands it its
    queries) through bitcasts alone: the heads sit in sublanes, as the attention takes them.
    Written head by head ([R, H (Dv + 128)]), XLA:TPU laid them out again between the two,
    on the SparseCores, in the queue of their collectives."""
    cfg = load_model_config("glm-5.2")
    heads, nope, v, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim,
                          cfg.kv_lora_rank)
    rows, pages, entries, n = 1024, 4096, 33, heads * (nope + v)

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))

    def rows_then_attention(q, kv_b, kv_b_s, factors, cache, slots, page_ids, pos):
        q_rows = whole_heads.absorb_queries(q, kv_b, kv_b_s, heads=heads, nope=nope,
                                            rope=factors)
        return select_kernels("pallas").sparse_attention(
            q_rows.reshape(1, rows, heads, -1).astype(jnp.float32), cache, slots, page_ids,
            pos, value_dim=dv, scale=cfg.softmax_scale, query_block=64)

    args = (struct((rows, heads * cfg.qk_head_dim), jnp.float32),
            struct((n, dv), jnp.float8_e4m3fn), struct((n // 128, dv // 128), jnp.float32),
            struct((rows, 2 * 128), jnp.float32),
            struct((pages, 64, dv + 128), jnp.float8_e4m3fn),
            struct((1, rows, entries), jnp.int32), struct((1, rows, entries), jnp.int32),
            struct((1, rows), jnp.int32))
    with jax.default_device(device):
        compiled = jax.jit(rows_then_attention).lower(*args).compile()
    module = hlo.parse_module(compiled.as_text())
    kernels = {i.name: i for i in module.computations[module.entry] if i.is_kernel}
    (attention,) = [i for i in kernels.values() if "sparse_prefill" in i.line]
    producer = module.by_name[attention.operands[3]]                         # its q
    while producer.op == "bitcast":
        producer = module.by_name[producer.operands[0]]
    assert producer.name in kernels and "absorb_queries" in producer.line, producer.line[:200]


@needs_libtpu
@pytest.mark.parametrize("model, rows", [("glm-5.2", 1024), ("glm-5.2", 512),
                                         ("deepseek-v3.2", 512)])
def test_output_compiles_for_tpu7x_at_every_head(device, model, rows):
    """Every head of a device's own rows of a 16K (1,024 rows) or 8K (512) chunk: Mosaic
    compiles the kernel within the VMEM budget and its estimate reaches the module."""
    cfg = load_model_config(model)
    heads, nope, v, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim,
                          cfg.kv_lora_rank)

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    n = heads * (nope + v)
    args = (struct((rows, heads, dv), jnp.float32), struct((n, dv), jnp.float8_e4m3fn),
            struct((n // 128, dv // 128), jnp.float32),
            struct((cfg.hidden_size, heads * v), jnp.float8_e4m3fn),
            struct((cfg.hidden_size // 128, heads * v // 128), jnp.float32))
    with jax.default_device(device):
        compiled = jax.jit(whole_heads.project_output, static_argnames=("nope",)).lower(
            *args, nope=nope).compile()
    module = hlo.parse_module(compiled.as_text())
    calls = [i for i in module.computations[module.entry] if i.is_kernel]
    figures = whole_heads.output_cost(rows, heads, nope, v, dv, cfg.hidden_size,
                                      n // 128 * dv // 128,
                                      cfg.hidden_size // 128 * heads * v // 128)
    assert [i.kernel_cost for i in calls] == [(figures["flops"], figures["bytes"])]
    assert figures["vmem_bytes"] <= VMEM_BUDGET_BYTES
