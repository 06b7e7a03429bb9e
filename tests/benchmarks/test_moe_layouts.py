"""cp-runtime bench moe_layouts' pieces: the layouts' arithmetic, passes below a group's pairs
(the same sum; test_expert_groups shows a dropped pass would not be), and device 0's program
compiled for TPU7x and priced (the grouped device moves a 16th of the rows through the
SparseCores). The benchmark's check itself runs in test_benchmark_smoke.py."""

import argparse
import os

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.aot import topology
from cp_runtime.benchmarks import moe_layouts

needs_libtpu = pytest.mark.skipif(not topology.has_libtpu() and not os.environ.get("CI"),
                                  reason="needs libtpu (tpu extra)")


def test_layouts_of_glm_on_16_devices():
    got = moe_layouts.layouts(256, 2048, 16, [1, 4, 16], 16384 * 8, 1.25)
    assert [(g["experts"], g["inner"], g["rows"]) for g in got] == [
        (256, 128, 131072), (64, 512, 40960), (16, 2048, 10240)]


def test_passes_below_the_pairs_give_the_same_sum():
    """128 pairs at 112 rows a pass: two passes (the runtime's exact path over a pass's rows,
    cp_runtime.model.expert_groups), the same sum to the bf16 rounding of adding each token's
    outputs in two scatters rather than one (measured 0 here; bound 1e-2 of the largest)."""
    rng = np.random.default_rng(0)
    t, k, experts, hidden, inner, block = 32, 4, 8, 64, 32, 16
    x8, scales, chosen, weights = (jnp.asarray(a) for a in
                                   moe_layouts._rows(rng, t, k, experts, hidden))
    stacks = [jnp.asarray(a) for a in moe_layouts._stacks(rng, experts, hidden, inner, block)]

    def total(rows):
        return np.asarray(moe_layouts.routed_experts(x8, scales, chosen, weights, *stacks,
                                                     group=0, rows=rows, interpret=True),
                          np.float32)

    whole = total(t * k)
    assert np.abs(whole).max() > 0
    assert np.abs(total(t * k - 16) - whole).max() <= 1e-2 * np.abs(whole).max()


@needs_libtpu
def test_priced_for_tpu7x():
    """A 1K half-chunk: the grouped device gathers a 16th of the rows on the SparseCores. A
    B = 1 decode step: its kernels' bytes bound every chosen expert's on the one device, 16x
    the by-feature device's slices of them."""
    args = argparse.Namespace(model="glm-5.2", tokens=1024, decode_batch=1, shards=16,
                              group_counts=[1, 16], capacity_factor=1.25)
    by_feature, by_expert, step_by_feature, step_by_expert = moe_layouts.priced(args)
    assert by_feature["rows"] == 8192 and by_expert["rows"] == 768
    assert 0 < by_expert["sparsecore_gb"] < by_feature["sparsecore_gb"] / 8
    for row in (by_feature, by_expert, step_by_feature, step_by_expert):
        assert 0 < row["priced_ms"] <= row["with_unpriced_ms"]
    assert step_by_feature["rows"] == step_by_expert["rows"] == 8
    assert step_by_expert["kernel_gb"] > 12 * step_by_feature["kernel_gb"]
