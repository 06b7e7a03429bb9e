"""Loading a sharded checkpoint onto split weights: each device's block is read from the files
alone (the right values: dequantised for f32, the stored fp8 values with re-gridded scales for
fp8), and the host never holds much more than one block at a time."""

import tracemalloc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from test_checkpoint import HF_CONFIG, write_checkpoint
from cp_runtime.cache.pool import CP_AXIS
from cp_runtime.weights.checkpoint import CheckpointBlocks
from cp_runtime.weights.format import SCALE_SUFFIX, STORED_DTYPES, bytes_per_device, device_tensors
from cp_runtime.weights.sharding import padded_shape
from cp_runtime.weights.params import model_layout
from cp_runtime.weights.placement import place_weights, weight_bytes_per_device

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


def _tensors(blocks, cfg, dtype):
    return device_tensors(blocks.shapes, cfg, "sharded", dtype, S, blocks.block)


def _dequantized(placed, name):
    """A placed weight in f32: fp8 values times their scales, run by run (the device's rule,
    cp_runtime.model.ops.weight, without the rounding to bf16)."""
    w = np.asarray(placed[name]).astype(np.float32)
    scale = placed.get(name + SCALE_SUFFIX)
    if scale is None:
        return w
    s = np.asarray(scale)
    ga, gb = w.shape[-2] // s.shape[-2], w.shape[-1] // s.shape[-1]
    return w * np.repeat(np.repeat(s, ga, axis=-2), gb, axis=-1)


@pytest.mark.parametrize("dtype", ["f32", "fp8"])
def test_each_device_gets_its_block_of_the_checkpoint(wide_ckpt, dtype):
    """f32: the dequantised values; fp8: the stored fp8 values themselves, whose scales give
    back the same f32 values exactly. Padding is zero either way."""
    d, cfg, expected = wide_ckpt
    blocks = CheckpointBlocks(d, cfg)
    tensors = _tensors(blocks, cfg, dtype)
    placed = place_weights(blocks, tensors, _mesh(), CP_AXIS)
    assert set(placed) == set(tensors)
    for name, want in expected.items():
        want = np.asarray(want)
        got = _dequantized(placed, name)
        assert got.shape == padded_shape(name, want.shape, cfg, S), name
        index = tuple(slice(0, n) for n in want.shape)
        np.testing.assert_array_equal(got[index], want, err_msg=name)
        assert np.count_nonzero(got) == np.count_nonzero(want), name      # padding is zero
        assert str(placed[name].dtype) == str(STORED_DTYPES[tensors[name].dtype]), name
    per_device = weight_bytes_per_device(placed)
    assert set(per_device.values()) == {bytes_per_device(tensors)}


def test_fp8_values_reach_the_devices_as_stored(wide_ckpt):
    d, cfg, _ = wide_ckpt
    blocks = CheckpointBlocks(d, cfg)
    placed = place_weights(blocks, _tensors(blocks, cfg, "fp8"), _mesh(), CP_AXIS)
    name = "model.layers.0.self_attn.q_b_proj.weight"
    stored = blocks.read(name, None, 0, 0).values
    assert stored.dtype == placed[name].dtype
    got = np.asarray(placed[name])[: stored.shape[0]]
    np.testing.assert_array_equal(got.view(np.uint8), stored.view(np.uint8))


@pytest.mark.parametrize("dtype", ["f32", "fp8"])
def test_loading_peaks_near_one_block_not_the_checkpoint(wide_ckpt, dtype):
    """tracemalloc sees every numpy buffer the loader makes (read, pad, re-grid or dequantise).
    A CPU device keeps some blocks (the aligned ones) as its own buffers rather than copying
    them, so what the devices hold at the end is counted too; the loader's own cost is the peak
    beyond that, and neither comes near the checkpoint. fp8 blocks are never widened."""
    d, cfg, expected = wide_ckpt
    blocks = CheckpointBlocks(d, cfg)
    tensors = _tensors(blocks, cfg, dtype)
    mesh = _mesh()
    total = sum(4 * x.size for x in expected.values())
    largest = max(t.nbytes_per_device for t in tensors.values())
    tracemalloc.start()
    try:
        placed = place_weights(blocks, tensors, mesh, CP_AXIS)
        jax.block_until_ready(placed)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mib = 2 ** 20
    report = (f"{dtype}: peak {peak / mib:.2f} MiB, of which devices keep {kept / mib:.2f} MiB: "
              f"loader {(peak - kept) / mib:.2f} MiB; largest block {largest / mib:.3f} MiB, "
              f"model {total / mib:.2f} MiB (f32)")
    print(report)
    assert peak - kept < 4 * largest, report
    assert peak < total / 4, report
    assert all(isinstance(x.sharding, NamedSharding) for x in placed.values())
