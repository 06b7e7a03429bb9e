"""Put the model's weights on the `cp` mesh, whole on every device or split
(cp_runtime.weight_layout), reading one device's block at a time.

A block source reads a range of one tensor (model layout, unpadded) without the rest: in-memory
weights (`ArrayBlocks`) or a checkpoint's memory-mapped files (cp_runtime.checkpoint's
`CheckpointBlocks`). Placement asks it only for the blocks of this process's devices and copies
each to its device before reading the next, so a process holds at most one block on the host
beyond what its devices keep.
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cp_runtime.config import ModelConfig
from cp_runtime.weight_layout import padded_shape, split_of
from cp_runtime.weights import Params

__all__ = ["BlockSource", "ArrayBlocks", "param_specs", "place_weights",
           "weight_bytes_per_device"]


class BlockSource(Protocol):
    """shapes: {name: unpadded model-layout shape}; read(name, axis, lo, hi): the tensor's
    elements lo..hi along `axis` (the whole tensor when axis is None), as a host array."""

    shapes: dict[str, tuple[int, ...]]

    def read(self, name: str, axis: int | None, lo: int, hi: int) -> np.ndarray: ...


class ArrayBlocks:
    """Blocks of weights already in memory (model layout)."""

    def __init__(self, params: Params):
        self.params = params
        self.shapes = {k: tuple(v.shape) for k, v in params.items()}

    def read(self, name: str, axis: int | None, lo: int, hi: int) -> np.ndarray:
        x = np.asarray(self.params[name])
        return x if axis is None else np.take(x, np.arange(lo, hi), axis=axis)


def _split(name: str, shape: tuple[int, ...], model: ModelConfig, mode: str):
    return split_of(name, shape, model) if mode == "sharded" else None


def param_specs(shapes: dict[str, tuple[int, ...]], model: ModelConfig, mode: str,
                axis_name: str) -> dict[str, PartitionSpec]:
    """Each tensor's PartitionSpec over the mesh axis `axis_name` in weight mode `mode`."""
    specs = {}
    for name, shape in shapes.items():
        split = _split(name, shape, model, mode)
        if split is None:
            specs[name] = PartitionSpec()
        else:
            specs[name] = PartitionSpec(*[axis_name if i == split.axis else None
                                          for i in range(len(shape))])
    return specs


def _padded_block(source: BlockSource, name: str, axis: int, lo: int, hi: int,
                  real: int) -> np.ndarray:
    """Elements lo..hi of `axis`, those at or past `real` (padding) zero."""
    block = source.read(name, axis, min(lo, real), min(hi, real))
    pad = [(0, 0)] * block.ndim
    pad[axis] = (0, (hi - lo) - block.shape[axis])
    return np.pad(block, pad) if pad[axis][1] else block


def place_weights(source: BlockSource, model: ModelConfig, mesh: Mesh, mode: str,
                  axis_name: str, dtype=None) -> Params:
    """Global arrays on `mesh` for every tensor of `source`, replicated or split by `mode`;
    this process reads only its devices' blocks (every block once: a replicated tensor is read
    once and copied to each device). `dtype` casts each block as it is read."""
    specs = param_specs(source.shapes, model, mode, axis_name)
    placed = {}
    for name, shape in source.shapes.items():
        split = _split(name, shape, model, mode)
        global_shape = shape if split is None else padded_shape(name, shape, model,
                                                                mesh.shape[axis_name])
        sharding = NamedSharding(mesh, specs[name])
        indices = sharding.addressable_devices_indices_map(global_shape)
        whole = None
        arrays = []
        for device, index in indices.items():
            if split is None:
                whole = source.read(name, None, 0, 0) if whole is None else whole
                block = whole
            else:
                sl = index[split.axis]
                block = _padded_block(source, name, split.axis, sl.start or 0,
                                      sl.stop if sl.stop is not None else global_shape[split.axis],
                                      shape[split.axis])
            # The copy is asynchronous and holds the host block until done: wait for it, so one
            # block at a time is in flight. (A CPU "device" may keep an aligned host block as
            # its own buffer: there the device's memory is host memory.)
            arrays.append(jax.device_put(block if dtype is None else block.astype(dtype),
                                         device).block_until_ready())
            del block
        placed[name] = jax.make_array_from_single_device_arrays(global_shape, sharding, arrays)
    return placed


def weight_bytes_per_device(params: Params) -> dict[int, int]:
    """{device id: bytes of weights it holds} over this process's devices."""
    out: dict[int, int] = {}
    for x in params.values():
        for shard in x.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out
