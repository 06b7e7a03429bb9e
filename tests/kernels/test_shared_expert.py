"""The shared experts added to the routed sum in one kernel (kernels/shared_expert.py): equal to
its reference in interpret mode, within bf16 roundings of the model's XLA path, taken by the
model on a TPU for a prefill's fp8 rows, and compiled for TPU7x at GLM-5.2's per-device shapes
with nothing of XLA's own over the [T, hidden] rows."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot import hlo, topology
from cp_runtime.config import load_model_config
from cp_runtime.kernels import fp8_rows, reference, shared_expert
from cp_runtime.kernels.vmem import VMEM_BUDGET_BYTES
from cp_runtime.model import mlp
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.fp8_blocks import quantize

needs_libtpu = pytest.mark.skipif(not topology.has_libtpu() and not os.environ.get("CI"),
                                  reason="needs libtpu (tpu extra)")

PREFIX = "mlp.shared_experts.{}_proj.weight"


def _case(rows: int, hidden: int, inner: int, seed: int = 0):
    """fp8 rows [rows, hidden], a bf16 routed sum, and block-scaled gate/up/down weights."""
    rng = np.random.default_rng(seed)

    def weight(n, k):
        values, scales = quantize(rng.standard_normal((n, k)).astype(np.float32), (128, 128))
        return jnp.asarray(values), jnp.asarray(scales * 0.05)

    x = fp8_rows.quantize(jnp.asarray(rng.standard_normal((rows, hidden)), jnp.float32))
    routed = jnp.asarray(rng.standard_normal((rows, hidden)) * 0.1, jnp.bfloat16)
    blocks = [*weight(inner, hidden), *weight(inner, hidden), *weight(hidden, inner)]
    return x, routed, blocks


def _steps(got: jax.Array, want: jax.Array) -> float:
    """The largest difference in bf16 steps of the output's largest magnitude (2^-7 of it):
    an output is a sum of terms as large as that, so its roundings are that size even where
    the terms cancel."""
    got, want = (np.asarray(a, np.float32) for a in (got, want))
    return float(np.abs(got - want).max() / (np.abs(want).max() * 2.0 ** -7))


# Interpret mode against the reference (the same roundings, sums in another order; a gated
# value's bf16 rounding may flip): measured 0.47 of a bf16 step of the output's largest value
# over three seeds of these cases; the bound is 1.
@pytest.mark.parametrize("rows, hidden, inner", [
    (96, 384, 128),         # one tile of everything
    (1024, 4096, 256),      # two row tiles of 512, two column tiles of 2,048
])
def test_kernel_matches_reference(rows, hidden, inner):
    x, routed, blocks = _case(rows, hidden, inner)
    got = shared_expert.shared_expert(x.values, x.scales, routed, *blocks, interpret=True)
    want = reference.shared_expert(x.values, x.scales, routed, *blocks)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, hidden)
    assert _steps(got, want) <= 1.0


@pytest.mark.parametrize("rows, hidden, inner", [(96, 384, 128), (1024, 4096, 256)])
def test_kernel_is_the_models_xla_path_within_bf16_roundings(rows, hidden, inner):
    """`mlp.shared_experts_sum` off a TPU: XLA rounds the gate, up and down products to
    bf16 where the kernel keeps them in f32. Measured 0.95 of a bf16 step of the output's
    largest value (three seeds); the bound is 2."""
    x, routed, blocks = _case(rows, hidden, inner, seed=1)
    p = {}
    for i, proj in enumerate(("gate", "up", "down")):
        p[PREFIX.format(proj)], p[PREFIX.format(proj) + SCALE_SUFFIX] = blocks[2 * i:2 * i + 2]
    xla = mlp.shared_experts_sum(p, routed, x)
    got = shared_expert.shared_expert(x.values, x.scales, routed, *blocks, interpret=True)
    assert xla.dtype == jnp.float32
    assert _steps(got, xla.astype(jnp.bfloat16)) <= 2.0


def test_bad_shapes_are_named():
    x, routed, blocks = _case(96, 384, 128)
    with pytest.raises(ValueError, match="do not fit together"):
        shared_expert.shared_expert(x.values, x.scales, routed[:, :256], *blocks,
                                    interpret=True)
    with pytest.raises(ValueError, match="no tiling of 90 rows"):
        shared_expert.shared_expert(x.values[:90], x.scales[:90], routed[:90], *blocks,
                                    interpret=True)


def test_supports_whole_tiles_only():
    glm = ((128, 6144), (1, 48), (6144, 128), (48, 1))
    assert shared_expert.supports(16384, *glm)
    assert shared_expert.tiles(16384, 6144) == (512, 2048)
    assert shared_expert.tiles(16384, 7168) == (512, 1792)        # DeepSeek-V3.2's hidden
    assert not shared_expert.supports(16000 + 8, *glm)            # no 32-row divisor tile
    runs_of_16 = ((128, 6144), (8, 48), (6144, 128), (48, 1))
    assert not shared_expert.supports(16384, *runs_of_16)
    figures = shared_expert.cost(16384, *glm)
    assert figures["vmem_bytes"] <= VMEM_BUDGET_BYTES
    assert figures["bytes"] == (16384 * 6144 + 16384 * 4 + 2 * 16384 * 6144 * 2
                                + 3 * 128 * 6144 + (48 + 48 + 48) * 4)


@pytest.fixture(scope="module")
def device():
    return topology.compile_only_devices("tpu7x-16")[0]


def _glm_structs(device, rows):
    cfg = load_model_config("glm-5.2")
    hidden, inner = cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts // 16

    def struct(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    f8 = jnp.float8_e4m3fn
    p = {}
    for proj, (n, k) in (("gate", (inner, hidden)), ("up", (inner, hidden)),
                         ("down", (hidden, inner))):
        p[PREFIX.format(proj)] = struct((n, k), f8)
        p[PREFIX.format(proj) + SCALE_SUFFIX] = struct((n // 128, k // 128), jnp.float32)
    rows_in = fp8_rows.Fp8Rows(struct((1, rows, hidden), f8), struct((1, rows, 1), jnp.float32))
    return p, struct((1, rows, hidden), jnp.bfloat16), rows_in, (hidden, inner)


@needs_libtpu
def test_model_takes_the_kernel_on_tpu7x_at_glm_shapes(device):
    """A half of a GLM-5.2 32K chunk (16,384 rows a device; the shared expert's 128 inner
    features a device of tpu7x-16): the model's step adds the shared expert through the
    kernel, Mosaic compiles it within its VMEM limit, its estimate reaches the module, and
    XLA makes no [T, hidden] array of its own beside it."""
    rows = 16384
    p, routed, x, (hidden, inner) = _glm_structs(device, rows)
    with jax.default_device(device):
        compiled = jax.jit(lambda p, r, x: mlp.shared_experts_sum(p, r, x).astype(
            jnp.bfloat16)).lower(p, routed, x).compile()
    entry = (module := hlo.parse_module(compiled.as_text())).computations[module.entry]
    calls = [i for i in entry if i.is_kernel]
    figures = shared_expert.cost(rows, (inner, hidden), (1, hidden // 128),
                                 (hidden, inner), (hidden // 128, 1))
    assert [i.name.split(".")[0] for i in calls] == ["shared_expert"]
    assert calls[0].kernel_cost == (figures["flops"], figures["bytes"])
    assert not [i.name for i in entry if not i.is_kernel and i.op not in ("parameter",
                "bitcast", "tuple", "get-tuple-element") and int(np.prod(i.dims)) == rows * hidden]
