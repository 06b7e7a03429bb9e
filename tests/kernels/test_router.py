"""A MoE layer's routing in one Pallas kernel (kernels/router.py): equal to its reference in
interpret mode, choices and weights bit for bit, with and without the group limit and through
ties; the reference equal to the model's XLA routing (`router.route_tokens` off a TPU); the
experts' result unchanged by the ordered choices; and compiled for TPU7x at GLM-5.2's and
DeepSeek-V3.2's router shapes with nothing computing outside the call."""

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
from cp_runtime.kernels import expert_matmul, reference, router
from cp_runtime.kernels.vmem import VMEM_BUDGET_BYTES
from cp_runtime.kernels.dispatch import ROUTER_KERNEL_MAX_ROWS
from cp_runtime.model import moe
from cp_runtime.model.expert_router import route_tokens, routing_keywords
from cp_runtime.weights.fp8_blocks import quantize

needs_libtpu = pytest.mark.skipif(not topology.has_libtpu() and not os.environ.get("CI"),
                                  reason="needs libtpu (tpu extra)")


def _exact_inputs(rng, rows, experts, hidden):
    """x, gate and bias on coarse grids (eighths, 64ths, 32nds): every product and sum of the
    router's matmul is exact in f32 whatever its order, so kernel and reference see the same
    logits, and the many equal scores exercise the ties."""
    x = (rng.integers(-8, 8, (rows, hidden)) / 8).astype(np.float32)
    gate = jnp.asarray((rng.integers(-8, 8, (experts, hidden)) / 64).astype(np.float32),
                       jnp.bfloat16)
    bias = (rng.integers(-8, 8, experts) / 32).astype(np.float32)
    return jnp.asarray(x), gate, jnp.asarray(bias)


@pytest.mark.parametrize("rows, experts, hidden, k, n_group, topk_group", [
    (1, 256, 512, 8, 1, 1),             # GLM-5.2's routing (no groups), a B = 1 step
    (5, 256, 512, 8, 8, 4),             # DeepSeek-V3.2's (8 groups, 4 kept)
    (3, 64, 256, 6, 8, 3),
    (2, 32, 128, 4, 32, 4),             # groups of one expert: a group's score is its best
])
def test_kernel_matches_reference(rows, experts, hidden, k, n_group, topk_group):
    rng = np.random.default_rng(rows + n_group)
    x, gate, bias = _exact_inputs(rng, rows, experts, hidden)
    routing = dict(k=k, n_group=n_group, topk_group=topk_group, norm=True, scale=2.5)
    chosen, weights = router.route(x, gate, bias, **routing, interpret=True)
    want_chosen, want_weights = reference.router(x, gate, bias, **routing)
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(want_chosen))
    np.testing.assert_array_equal(np.asarray(weights), np.asarray(want_weights))
    assert (np.diff(np.asarray(chosen), axis=-1) > 0).all()        # ascending, distinct


def test_ties_go_to_the_lowest_expert():
    """Every score equal: the k lowest experts, as lax.top_k. With groups of 8 and one
    expert (5) lifted: its group first, then the lowest of the tied groups, and the lowest
    experts of those."""
    x = jnp.zeros((2, 128), jnp.float32)
    gate = jnp.zeros((64, 128), jnp.bfloat16)
    bias = jnp.zeros((64,), jnp.float32)
    chosen, weights = router.route(x, gate, bias, k=4, n_group=1, topk_group=1, norm=False,
                                   scale=1.0, interpret=True)
    np.testing.assert_array_equal(np.asarray(chosen), [[0, 1, 2, 3]] * 2)
    np.testing.assert_array_equal(np.asarray(weights), 0.5)        # sigmoid(0)
    chosen, _ = router.route(x, gate, bias.at[5].set(1.0), k=4, n_group=8, topk_group=2,
                             norm=True, scale=1.0, interpret=True)
    np.testing.assert_array_equal(np.asarray(chosen), [[0, 1, 2, 5]] * 2)


def test_bad_shapes_are_refused():
    x, gate, bias = _exact_inputs(np.random.default_rng(0), 2, 64, 128)
    routing = dict(k=4, n_group=1, topk_group=1, norm=True, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="do not fit together"):
        router.route(x[:, :64], gate, bias, **routing)
    with pytest.raises(ValueError, match="do not fit together"):
        router.route(x, gate, bias[:32], **routing)
    with pytest.raises(ValueError, match="do not fit together"):
        router.route(x, gate, bias, **{**routing, "n_group": 5})


def test_the_models_routing_is_the_reference():
    """Off a TPU `route_tokens` takes the kernel's XLA branch for a few rows and a bf16
    gate: the model's own routing (`top_k_experts` of its bf16 logits) in ascending expert
    order, equal to the reference; long steps keep top_k_experts' order."""
    cfg = load_model_config("deepseek-mini")
    rng = np.random.default_rng(3)
    x, gate, bias = _exact_inputs(rng, 3, cfg.n_routed_experts, cfg.hidden_size)
    p = {"mlp.gate.weight": gate, "mlp.gate.e_score_correction_bias": bias}
    assert router.supports(3, gate.shape, gate.dtype, cfg.num_experts_per_tok)
    chosen, weights, by_expert = route_tokens(p, cfg, x)
    assert by_expert
    want_chosen, want_weights = reference.router(x, gate, bias, **routing_keywords(cfg))
    np.testing.assert_array_equal(np.asarray(chosen), np.asarray(want_chosen))
    np.testing.assert_array_equal(np.asarray(weights), np.asarray(want_weights))
    long_x = jnp.tile(x, (ROUTER_KERNEL_MAX_ROWS // 3 + 1, 1))
    long_chosen, _, long_by_expert = route_tokens(p, cfg, long_x)
    assert not long_by_expert
    np.testing.assert_array_equal(np.sort(np.asarray(long_chosen[:3]), -1), chosen)
    f32_gate = {**p, "mlp.gate.weight": gate.astype(jnp.float32)}
    assert not route_tokens(f32_gate, cfg, x)[2]                # f32 gates stay in XLA


def test_one_tokens_experts_skip_the_sort():
    """A token's choices in expert order run through the experts' kernel without the sort
    (`by_expert`), to the same result as sorting them."""
    rng = np.random.default_rng(4)
    experts, hidden, inner, k = 8, 128, 128, 4
    p = {}
    for proj, shape in (("gate", (experts, hidden, inner)), ("up", (experts, hidden, inner)),
                        ("down", (experts, inner, hidden))):
        values, scales = quantize(rng.standard_normal(shape).astype(np.float32), (128, 128))
        p[f"mlp.experts.{proj}_proj.weight"] = jnp.asarray(values)
        p[f"mlp.experts.{proj}_proj.weight_scale_inv"] = jnp.asarray(scales * 0.05)
    x = jnp.asarray(rng.standard_normal((1, hidden)), jnp.float32)
    chosen = jnp.asarray([[1, 3, 4, 6]])
    weights = jnp.asarray(rng.random((1, k)), jnp.float32)
    kernel = functools.partial(expert_matmul.grouped_matmul, interpret=True)
    sorted_once, _ = moe.pairs_by_expert(p, x, chosen, weights, kernel, by_expert=True)
    sorted_again, _ = moe.pairs_by_expert(p, x, chosen, weights, kernel)
    np.testing.assert_array_equal(np.asarray(sorted_once), np.asarray(sorted_again))


@pytest.fixture(scope="module")
def device():
    return topology.compile_only_devices("tpu7x-16")[0]


@needs_libtpu
@pytest.mark.parametrize("model, rows", [("glm-5.2", 1), ("deepseek-v3.2", 64)])
def test_compiles_for_tpu7x(device, model, rows):
    """The router of GLM-5.2 (256 experts, no groups) and DeepSeek-V3.2 (8 groups of 32),
    whole on every device: one Mosaic call carrying its estimate, nothing else computing
    (XLA may copy the outputs into its own layout)."""
    cfg = load_model_config(model)
    gate = (cfg.n_routed_experts, cfg.hidden_size)
    shapes = [((rows, cfg.hidden_size), jnp.float32), (gate, jnp.bfloat16),
              ((cfg.n_routed_experts,), jnp.float32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device))
            for s, d in shapes]
    fn = functools.partial(router.route, **routing_keywords(cfg))
    with jax.default_device(device):
        compiled = jax.jit(fn).lower(*args).compile()
    module = hlo.parse_module(compiled.as_text())
    entry = module.computations[module.entry]
    calls = [i for i in entry if i.is_kernel]
    assert [i.name.split(".")[0] for i in calls] == ["route"]
    figures = router.cost(rows, gate, cfg.num_experts_per_tok)
    assert calls[0].kernel_cost == (figures["flops"], figures["bytes"])
    assert figures["vmem_bytes"] <= VMEM_BUDGET_BYTES
    assert {i.op for i in entry if not i.is_kernel} <= {
        "parameter", "copy", "reshape", "bitcast", "tuple", "get-tuple-element",
        "copy-start", "copy-done"}
