"""Loading a sharded checkpoint onto split weights: each device's block is read from the files
alone (the right values, fp8 blocks dequantised), and the host never holds much more than one
block at a time."""

import math
import tracemalloc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from test_checkpoint import HF_CONFIG, write_checkpoint
from cp_runtime.checkpoint import CheckpointBlocks
from cp_runtime.pool import CP_AXIS
from cp_runtime.weight_layout import local_shape, padded_shape
from cp_runtime.weight_placement import place_weights, weight_bytes_per_device
from cp_runtime.weights import model_layout

S = 16
# Wider than test_checkpoint's model, so the blocks dwarf the loader's own small allocations.
WIDE = HF_CONFIG | {"hidden_size": 256, "vocab_size": 4096, "intermediate_size": 512,
                    "n_routed_experts": 16, "moe_intermediate_size": 64,
                    "num_attention_heads": 16, "index_n_heads": 16, "num_hidden_layers": 6}


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("wide") / "wide-v32"
    cfg, expected = write_checkpoint(d, WIDE, seed=5)
    return d, cfg, model_layout(expected, cfg)


def _mesh():
    return jax.make_mesh((S,), (CP_AXIS,), devices=jax.devices()[:S])


def test_each_device_gets_its_block_of_the_checkpoint(wide_ckpt):
    d, cfg, expected = wide_ckpt
    placed = place_weights(CheckpointBlocks(d, cfg), cfg, _mesh(), "sharded", CP_AXIS)
    for name, want in expected.items():
        want = np.asarray(want)
        got = np.asarray(placed[name])
        assert got.shape == padded_shape(name, want.shape, cfg, S), name
        index = tuple(slice(0, n) for n in want.shape)
        np.testing.assert_array_equal(got[index], want, err_msg=name)
        assert np.count_nonzero(got) == np.count_nonzero(want), name      # padding is zero
    per_device = weight_bytes_per_device(placed)
    assert set(per_device.values()) == {sum(4 * math.prod(local_shape(n, x.shape, cfg, S))
                                            for n, x in expected.items())}


def test_loading_peaks_near_one_block_not_the_checkpoint(wide_ckpt):
    """tracemalloc sees every numpy buffer the loader makes (read, dequantise, pad, cast). A CPU
    device keeps some blocks (the aligned ones) as its own buffers rather than copying them, so
    what the devices hold at the end is counted too; the loader's own cost is the peak beyond
    that, and neither comes near the checkpoint."""
    d, cfg, expected = wide_ckpt
    blocks = CheckpointBlocks(d, cfg)
    mesh = _mesh()
    total = sum(4 * x.size for x in expected.values())
    largest = max(4 * math.prod(local_shape(n, x.shape, cfg, S)) for n, x in expected.items())
    tracemalloc.start()
    try:
        placed = place_weights(blocks, cfg, mesh, "sharded", CP_AXIS)
        jax.block_until_ready(placed)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mib = 2 ** 20
    report = (f"peak {peak / mib:.2f} MiB, of which devices keep {kept / mib:.2f} MiB: loader "
              f"{(peak - kept) / mib:.2f} MiB; largest block {largest / mib:.2f} MiB, model "
              f"{total / mib:.2f} MiB (f32)")
    print(report)
    assert peak - kept < 4 * largest, report
    assert peak < total / 4, report
    assert all(isinstance(x.sharding, NamedSharding) for x in placed.values())
