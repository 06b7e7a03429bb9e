"""The linear layer from block-scaled fp8 weights (kernels/scaled_linear.py): equal to its
reference in interpret mode, equal to the model's XLA path (`ops.linear` off a TPU), and
compiled for TPU7x at GLM-5.2's per-device shapes without the f32 broadcast of the scales
that XLA writes to HBM."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot import hlo, topology
from cp_runtime.config import load_model_config
from cp_runtime.kernels import reference, scaled_linear
from cp_runtime.kernels.vmem import VMEM_BUDGET_BYTES
from cp_runtime.kernels.dispatch import LINEAR_KERNEL_MIN_ELEMENTS
from cp_runtime.model import ops
from cp_runtime.weights.fp8_blocks import quantize

needs_libtpu = pytest.mark.skipif(not topology.has_libtpu() and not os.environ.get("CI"),
                                  reason="needs libtpu (tpu extra)")

# Interpret mode against the f32 reference: the same bf16 values, products summed in f32 in a
# different order. Measured worst error 4.6e-7 of the output's largest value over these cases.
KERNEL_BOUND = 1e-5


def _weights(rng, n, k, runs):
    values, scales = quantize(rng.standard_normal((n, k)).astype(np.float32), runs)
    return jnp.asarray(values), jnp.asarray(scales * 0.05)


@pytest.mark.parametrize("rows, shape, runs", [
    (1, (256, 384), (128, 128)),          # a decode step's one row, three K runs
    (8, (1024, 256), (128, 128)),         # two row runs a column tile... and a few rows
    (300, (384, 128), (128, 128)),        # many rows, K one tile: one 304-row tile
    (300, (384, 1024), (128, 128)),       # the tiled form: two input tiles summed
    (1500, (640, 1536), (128, 128)),      # two 752-row tiles (4 padded), three input tiles
    (700, (576, 1024), (64, 128)),        # kv_a_proj's 64-row runs, tiled
    (5, (64, 96), (32, 16)),              # narrow runs (interpret mode only: not on a TPU)
    (1, (576, 256), (64, 128)),           # kv_a_proj's rows: 64-row runs, one 576-row tile
])
def test_kernel_matches_reference(rows, shape, runs):
    rng = np.random.default_rng(rows)
    w, s = _weights(rng, *shape, runs)
    x = jnp.asarray(rng.standard_normal((rows, shape[1])), jnp.float32)
    got = scaled_linear.scaled_linear(x, w, s, interpret=True)
    want = reference.scaled_linear(x, w, s)
    assert got.shape == want.shape == (rows, shape[0])
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got - want).max()) <= KERNEL_BOUND * scale


def test_leading_dims_and_bad_shapes():
    rng = np.random.default_rng(0)
    w, s = _weights(rng, 256, 128, (128, 128))
    x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.float32)
    got = scaled_linear.scaled_linear(x, w, s, interpret=True)
    assert got.shape == (2, 3, 256)
    np.testing.assert_allclose(got, reference.scaled_linear(x, w, s), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit together"):
        scaled_linear.scaled_linear(x[..., :64], w, s, interpret=True)


def test_reference_is_the_models_xla_path():
    """Off a TPU `ops.linear` dequantises with `weight()` and runs a bf16 matmul whose
    output XLA rounds to bf16; the reference keeps f32. They differ by that rounding only
    (bf16's 2^-9 relative step)."""
    rng = np.random.default_rng(1)
    w, s = _weights(rng, 256, 256, (128, 128))
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.float32)
    p = {"w": w, "w_scale_inv": s}
    got = ops.linear(p, "w", x)
    want = reference.scaled_linear(x, w, s)
    assert float(jnp.abs(got - want).max()) <= 2.0 ** -8 * float(jnp.abs(want).max())


@pytest.fixture(scope="module")
def device():
    return topology.compile_only_devices("tpu7x-16")[0]


def _compiled(device, rows, n, k, ga=128):
    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    args = (struct((rows, k), jnp.bfloat16), struct((n, k), jnp.float8_e4m3fn),
            struct((n // ga, k // 128), jnp.float32))
    with jax.default_device(device):
        compiled = jax.jit(scaled_linear.scaled_linear).lower(*args).compile()
    return hlo.parse_module(compiled.as_text())


@needs_libtpu
@pytest.mark.parametrize("rows", [1, 256])     # a B = 1 decode step; the most the model sends
def test_compiles_for_tpu7x_at_glm_shapes(device, rows):
    """GLM-5.2's o_proj per device of tpu7x-16 ([hidden, 64 heads x 256 / 16]): Mosaic
    compiles the kernel, its cost estimate reaches the module, and nothing outside it makes a
    weight-sized array wider than fp8 (XLA's own form wrote the scales broadcast to f32, 25 MB;
    XLA may still copy the fp8 weight itself between memory spaces for the call)."""
    cfg = load_model_config("glm-5.2")
    n, k = cfg.hidden_size, cfg.num_attention_heads * cfg.v_head_dim // 16
    module = _compiled(device, rows, n, k)
    entry = module.computations[module.entry]
    calls = [i for i in entry if i.is_kernel]
    assert [i.name.split(".")[0] for i in calls] == ["scaled_linear"]
    figures = scaled_linear.cost(rows, (n, k), (n // 128, k // 128))
    assert calls[0].kernel_cost == (figures["flops"], figures["bytes"])
    assert figures["vmem_bytes"] <= VMEM_BUDGET_BYTES
    wide = [i.name for i in entry if not i.is_kernel and i.dtype not in ("f8e4m3fn", "")
            and int(np.prod(i.dims)) == n * k]
    assert not wide                   # no dequantised or broadcast copy of the weight


def test_tiles_of_many_rows():
    """A prefill chunk's rows take the tiled form: tall row tiles, as even as 16-row steps
    allow, and the weight in blocks of whole scale runs; few rows keep one block of all K."""
    assert scaled_linear.tiles(1024, (6144, 16384), (48, 128)) == (1024, 2048, 512)
    assert scaled_linear.tiles(8192, (768, 2048), (6, 16)) == (1024, 768, 512)
    assert scaled_linear.tiles(1500, (640, 1536), (5, 12)) == (752, 640, 512)
    assert scaled_linear.tiles(8, (6144, 16384), (48, 128)) == (8, 128, 16384)
    whole = scaled_linear.cost(1024, (6144, 16384), (48, 128), x_itemsize=4)
    assert whole["bytes"] == (6144 * 16384 + 48 * 128 * 4 + 3 * 1024 * 16384 * 4
                              + 1024 * 6144 * 4)
    assert whole["vmem_bytes"] <= VMEM_BUDGET_BYTES


@needs_libtpu
@pytest.mark.parametrize("rows", [512, 1024])     # a device's rows of an 8K and a 16K chunk
def test_compiles_for_tpu7x_at_whole_o_proj(device, rows):
    """GLM-5.2's o_proj gathered whole ([hidden, 64 heads x 256]) for a device's own rows of a
    prefill chunk, in f32 as the model hands them over: Mosaic compiles the tiled form within
    its VMEM limit, its estimate reaches the module, and no f32 copy of the weight is made."""
    cfg = load_model_config("glm-5.2")
    n, k = cfg.hidden_size, cfg.num_attention_heads * cfg.v_head_dim

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    args = (struct((rows, k), jnp.float32), struct((n, k), jnp.float8_e4m3fn),
            struct((n // 128, k // 128), jnp.float32))
    with jax.default_device(device):
        compiled = jax.jit(scaled_linear.scaled_linear).lower(*args).compile()
    entry = (module := hlo.parse_module(compiled.as_text())).computations[module.entry]
    calls = [i for i in entry if i.is_kernel]
    figures = scaled_linear.cost(rows, (n, k), (n // 128, k // 128), x_itemsize=4)
    assert [i.kernel_cost for i in calls] == [(figures["flops"], figures["bytes"])]
    assert not [i.name for i in entry if not i.is_kernel and i.dtype not in ("f8e4m3fn", "")
                and int(np.prod(i.dims)) == n * k]


@needs_libtpu
@pytest.mark.parametrize("heads, kernel", [(64, True), (4, False)])
def test_model_takes_the_kernel_for_whole_weights_of_many_rows(device, heads, kernel):
    """`ops.linear` for 1,024 rows: o_proj whole (64 heads, 100M values) goes through the
    kernel, as XLA would write its scales broadcast to f32; a device's 4 heads of it (6M)
    keep XLA's fusion, which fuses the casts around it."""
    cfg = load_model_config("glm-5.2")
    n, k = cfg.hidden_size, heads * cfg.v_head_dim

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    p = {"w": struct((n, k), jnp.float8_e4m3fn),
         "w_scale_inv": struct((n // 128, k // 128), jnp.float32)}
    with jax.default_device(device):
        compiled = jax.jit(lambda p, x: ops.linear(p, "w", x)).lower(
            p, struct((1024, k), jnp.float32)).compile()
    module = hlo.parse_module(compiled.as_text())
    names = [i.name.split(".")[0] for i in module.computations[module.entry] if i.is_kernel]
    assert (names == ["scaled_linear"]) is kernel
    assert (n * k >= LINEAR_KERNEL_MIN_ELEMENTS) is kernel


def test_supports_the_down_projections_runs():
    """The down projections are whole on every device (cp_runtime.weights.sharding): kv_a_proj's
    576 rows have scale runs of 64 (gcd with the 128-row block), taken as one column tile;
    runs that are not whole sublane tiles are not."""
    assert scaled_linear.supports((576, 6144), (9, 48))
    assert scaled_linear.column_tile(576, 6144, 64, 1) == 576
    assert scaled_linear.column_tile(2048, 6144, 128, 1) == 256
    assert not scaled_linear.supports((576, 6144), (36, 48))           # runs of 16 rows
    assert not scaled_linear.supports((576, 6144), (9, 96))            # 64-lane runs


@needs_libtpu
def test_compiles_for_tpu7x_at_kv_a_shape(device):
    """GLM-5.2's kv_a_proj whole ([576, hidden], 64-row scale runs) for a B = 1 step: Mosaic
    compiles the kernel with its 576-row output block, and its estimate reaches the module."""
    cfg = load_model_config("glm-5.2")
    n, k = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size
    module = _compiled(device, 1, n, k, ga=64)
    calls = [i for i in module.computations[module.entry] if i.is_kernel]
    figures = scaled_linear.cost(1, (n, k), (n // 64, k // 128))
    assert [i.kernel_cost for i in calls] == [(figures["flops"], figures["bytes"])]
    assert figures["vmem_bytes"] <= VMEM_BUDGET_BYTES
