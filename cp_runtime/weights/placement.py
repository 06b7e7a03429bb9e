"""Put the model's weights on the `cp` mesh, whole on every device or split
(cp_runtime.weights.sharding), in their stored dtype (cp_runtime.weights.format), reading one
device's block at a time.

A block source reads a range of one tensor (model layout, unpadded) without the rest: in-memory
weights (`ArrayBlocks`) or a checkpoint's memory-mapped files (cp_runtime.weights.checkpoint's
`CheckpointBlocks`). Placement asks it only for the blocks of this process's devices and copies
each to its device before reading the next, so a process holds at most one block on the host
beyond what its devices keep.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cp_runtime.weights.format import (FP8_BLOCK, SCALE_SUFFIX, STORED_DTYPES, DeviceTensor,
                                       scale_runs)
from cp_runtime.weights.fp8_blocks import HostBlock, to_stored
from cp_runtime.weights.params import Params

__all__ = ["BlockSource", "ArrayBlocks", "device_memory_bytes", "param_specs", "param_structs",
           "place_weights", "weight_bytes_per_device"]


class BlockSource(Protocol):
    """shapes: {name: unpadded model-layout shape}; block: the [out, in] values per fp8 scale
    of its fp8 tensors; read(name, axis, lo, hi, experts): the tensor's elements lo..hi along
    `axis` (the whole tensor when axis is None), of a routed-expert stack's experts
    experts[0]..experts[1] only when `experts` is given, as stored
    (cp_runtime.weights.fp8_blocks.HostBlock)."""

    shapes: dict[str, tuple[int, ...]]
    block: tuple[int, int]

    def read(self, name: str, axis: int | None, lo: int, hi: int,
             experts: tuple[int, int] | None = None) -> HostBlock: ...


class ArrayBlocks:
    """Blocks of weights already in memory (model layout, no scales: any float dtype)."""

    block = FP8_BLOCK

    def __init__(self, params: Params):
        self.params = params
        self.shapes = {k: tuple(v.shape) for k, v in params.items()}

    def read(self, name: str, axis: int | None, lo: int, hi: int,
             experts: tuple[int, int] | None = None) -> HostBlock:
        x = np.asarray(self.params[name])
        if experts is not None:
            x = x[experts[0]:experts[1]]
        return HostBlock(x if axis is None else np.take(x, np.arange(lo, hi), axis=axis))


def param_specs(tensors: dict[str, DeviceTensor], axis_name: str) -> dict[str, PartitionSpec]:
    """Each device tensor's PartitionSpec over the mesh axis `axis_name`."""
    return {name: PartitionSpec(*[axis_name if i == t.split_axis else None
                                  for i in range(len(t.shape))])
            for name, t in tensors.items()}


def param_structs(tensors: dict[str, DeviceTensor], mesh: Mesh
                  ) -> dict[str, jax.ShapeDtypeStruct]:
    """`tensors` as ShapeDtypeStructs placed on `mesh` (its one axis): the weight arguments
    of a program lowered without the weights (to compile it ahead of them)."""
    axis_name, = mesh.axis_names
    specs = param_specs(tensors, axis_name)
    return {name: jax.ShapeDtypeStruct(t.shape, STORED_DTYPES[t.dtype],
                                       sharding=NamedSharding(mesh, specs[name]))
            for name, t in tensors.items()}


def _padded_block(source: BlockSource, name: str, axis: int, lo: int, hi: int,
                  real: int) -> HostBlock:
    """Elements lo..hi of `axis`, those at or past `real` (padding) zero."""
    block = source.read(name, axis, min(lo, real), min(hi, real))
    pad = [(0, 0)] * block.values.ndim
    pad[axis] = (0, (hi - lo) - block.values.shape[axis])
    if not pad[axis][1]:
        return block
    return dataclasses.replace(block, values=np.pad(block.values, pad))


def _grouped_block(source: BlockSource, t: DeviceTensor, real: tuple[int, ...], device: int
                   ) -> HostBlock:
    """Device `device`'s experts and features of a routed-expert stack in expert groups,
    zero-padded past the model's experts and features."""
    groups, axis = t.experts, t.experts.inner_axis
    (e_lo, e_hi), (f_lo, f_hi) = groups.experts(device), groups.features(device)
    if e_lo >= real[0] or f_lo >= real[axis]:           # all padding: zero experts
        return HostBlock(np.zeros(t.local, np.float32))
    block = source.read(t.name, axis, f_lo, min(f_hi, real[axis]),
                        experts=(e_lo, min(e_hi, real[0])))
    pad = [(0, want - got) for want, got in zip(t.local, block.values.shape)]
    if not any(after for _, after in pad):
        return block
    scales = block.scales
    if scales is not None:            # one scale table an expert: the zero experts' any
        scales = np.pad(scales, [pad[0]] + [(0, 0)] * (scales.ndim - 1), constant_values=1)
    return dataclasses.replace(block, values=np.pad(block.values, pad), scales=scales)


def _device_block(source: BlockSource, t: DeviceTensor, real: tuple[int, ...], index: tuple
                   ) -> HostBlock:
    """The source's part of tensor `t` that device slice `index` holds, zero-padded."""
    if t.split_axis is None:
        return source.read(t.name, None, 0, 0)
    if t.experts is not None:
        return _grouped_block(source, t, real, (index[0].start or 0) // t.local[0])
    sl = index[t.split_axis]
    return _padded_block(source, t.name, t.split_axis, sl.start or 0,
                         sl.stop if sl.stop is not None else t.shape[t.split_axis],
                         real[t.split_axis])


def _put(x: np.ndarray, device) -> jax.Array:
    # The copy is asynchronous and holds the host block until done: wait for it, so one block
    # at a time is in flight. (A CPU "device" may keep an aligned host block as its own
    # buffer: there the device's memory is host memory.)
    return jax.device_put(x, device).block_until_ready()


def place_weights(source: BlockSource, tensors: dict[str, DeviceTensor], mesh: Mesh,
                  axis_name: str) -> Params:
    """Global arrays on `mesh` for every tensor of `source` as `tensors` (from
    cp_runtime.weights.format.device_tensors) hold it: split, dtype and scales. This process
    reads only its devices' blocks, each once (a replicated tensor is read once and copied to each
    device), and turns each into its stored dtype as it is read (fp8 values stay as they
    are, their scales re-gridded)."""
    specs = param_specs(tensors, axis_name)
    placed = {}
    for name, real in source.shapes.items():
        t = tensors[name]
        scale = tensors.get(name + SCALE_SUFFIX)
        sharding = NamedSharding(mesh, specs[name])
        scale_sharding = None if scale is None else NamedSharding(mesh, specs[scale.name])
        values, scales, last = [], [], None
        for device, index in sharding.addressable_devices_indices_map(t.shape).items():
            if last is None or t.split_axis is not None:
                block = _device_block(source, t, real, index)
                runs = None if scale is None else scale_runs(name, t.local, source.block)
                last = to_stored(block, t.dtype, runs)
                del block
            values.append(_put(last[0], device))
            if scale is not None:
                scales.append(_put(last[1], device))
        placed[name] = jax.make_array_from_single_device_arrays(t.shape, sharding, values)
        if scale is not None:
            placed[scale.name] = jax.make_array_from_single_device_arrays(
                scale.shape, scale_sharding, scales)
    return placed


def device_memory_bytes() -> int:
    """Memory of one of this process's devices: what the runtime reports, or on CPU (whose
    devices share the host's memory and report none) the host's memory over its devices."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // jax.local_device_count()


def weight_bytes_per_device(params: Params) -> dict[int, int]:
    """{device id: bytes of weights it holds} over this process's devices."""
    out: dict[int, int] = {}
    for x in params.values():
        for shard in x.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out
