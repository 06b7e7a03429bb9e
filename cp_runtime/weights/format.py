"""How each weight is stored on the devices: its dtype, its block scales, its shape per device.
The one rule that placement, the step's partition specs, the compiled programs' arguments and
the capacity arithmetic all read. Pure Python and numpy (no JAX): capacity imports it.

Weight dtypes (`--weight-dtype`; "auto" = the model's own, `ModelConfig.weight_dtype`):

    fp8   as the public GLM-5 / DeepSeek-V3.2 checkpoints store them: every matmul weight
          f8_e4m3 with an f32 scale per block (`X.weight_scale_inv` beside `X.weight`), except
          the embedding, lm head, router gate and indexer weights_proj, which stay bf16;
    bf16  every matmul weight bf16;
    f32   every weight f32 (the exact reference the tests compare against).

In every dtype the 1-D tensors (norms, biases) are f32: they are small, and counted.

Block scales on a device: a checkpoint block is [bo, bi] (128 x 128 in the public checkpoints;
a routed-expert stack [E, in, out] is transposed, so its block is [bi, bo]). A device's part of
a split weight may start inside a checkpoint block (kv_a_proj's 576 rows over 16 devices: 36
each), so on the device each axis is cut into runs of g = gcd(this device's extent, block)
values, one scale per run: a run never crosses a block, every device's part starts on a run,
and g = block wherever the parts are whole blocks. The scale of a weight of local shape
[..., a, b] is [..., a / ga, b / gb], split over the devices as the weight is.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from cp_runtime.config import MODEL_WEIGHT_DTYPES, ModelConfig, RuntimeConfig
from cp_runtime.weights.sharding import (EXPERT_STACKS, ExpertGroups, grouped_experts, local_shape,
                                       padded_shape, split_of)

__all__ = ["WEIGHT_DTYPES", "STORED_DTYPES", "FP8_BLOCK", "SCALE_SUFFIX",
           "REPLICATE_MAX_FRACTION", "DeviceTensor", "bytes_per_device", "device_tensors",
           "model_bytes", "resolve_runtime_weights", "resolve_weight_dtype",
           "resolve_weight_mode", "scale_runs", "stored_dtype"]

WEIGHT_DTYPES = ("auto", *MODEL_WEIGHT_DTYPES)
# What a stored tensor is, as numpy dtypes (ml_dtypes stands in for those numpy lacks).
STORED_DTYPES = {"fp8": np.dtype(ml_dtypes.float8_e4m3fn), "bf16": np.dtype(ml_dtypes.bfloat16),
                 "f32": np.dtype(np.float32)}
FP8_BLOCK = (128, 128)            # [out, in] values per scale in the public fp8 checkpoints
SCALE_SUFFIX = "_scale_inv"       # the checkpoints' name for a weight's block scales
# 2-D weights the fp8 checkpoints keep in bf16.
_BF16_IN_FP8 = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight",
                "weights_proj.weight")
_F32_ALWAYS = ("e_score_correction_bias",)


def resolve_weight_dtype(weight_dtype: str, model: ModelConfig) -> str:
    """A concrete dtype ("fp8", "bf16" or "f32") for a `--weight-dtype` name."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight_dtype!r} is not one of {WEIGHT_DTYPES}")
    return model.weight_dtype if weight_dtype == "auto" else weight_dtype


def stored_dtype(name: str, shape: tuple[int, ...], weight_dtype: str) -> str:
    """The dtype tensor `name` (model layout) is held in under a concrete `weight_dtype`."""
    if weight_dtype == "f32" or len(shape) < 2 or name.endswith(_F32_ALWAYS):
        return "f32"
    if weight_dtype == "fp8" and not name.endswith(_BF16_IN_FP8):
        return "fp8"
    return "bf16"


def _block_of(name: str, block: tuple[int, int]) -> tuple[int, int]:
    """The checkpoint block [out, in] as it lies on the model-layout tensor's last two axes."""
    return (block[1], block[0]) if name.endswith(EXPERT_STACKS) else tuple(block)


def scale_runs(name: str, local: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """(ga, gb): values per scale along the last two axes of a device's part `local`."""
    bo, bi = _block_of(name, block)
    return math.gcd(local[-2], bo), math.gcd(local[-1], bi)


@dataclasses.dataclass(frozen=True)
class DeviceTensor:
    """One array the devices hold: `shape` global (split axis padded), `local` per device,
    split over the devices along `split_axis` (None: whole on each). A weight's block scales
    are a DeviceTensor of their own, `scales` naming the weight. `experts`: a routed-expert
    stack in expert groups (device-major, split along axis 0), or None."""

    name: str
    shape: tuple[int, ...]
    local: tuple[int, ...]
    dtype: str
    split_axis: int | None
    scales: str | None = None
    experts: ExpertGroups | None = None

    @property
    def nbytes_per_device(self) -> int:
        return math.prod(self.local) * STORED_DTYPES[self.dtype].itemsize


def _with_runs(shape: tuple[int, ...], runs: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-2] // runs[0], shape[-1] // runs[1])


def _placed(name: str, shape: tuple[int, ...], model: ModelConfig, mode: str, shards: int,
            expert_groups: int) -> tuple[tuple[int, ...], tuple[int, ...], int | None,
                                         ExpertGroups | None]:
    """(global shape, device's shape, split axis, expert groups) of tensor `name`."""
    if mode != "sharded":
        return shape, shape, None, None
    grouped = grouped_experts(name, shape, shards, expert_groups)
    if grouped is not None:
        return grouped.full, grouped.local, 0, grouped
    split = split_of(name, shape, model)
    if split is None:
        return shape, shape, None, None
    return (padded_shape(name, shape, model, shards), local_shape(name, shape, model, shards),
            split.axis, None)


def device_tensors(shapes: dict[str, tuple[int, ...]], model: ModelConfig, mode: str,
                   weight_dtype: str, shards: int, block: tuple[int, int] = FP8_BLOCK,
                   expert_groups: int = 1) -> dict[str, DeviceTensor]:
    """Every array the devices hold for model-layout tensors `shapes` in weight mode `mode`
    ("replicated" or "sharded") and concrete `weight_dtype`: each weight, and after each fp8
    weight its scales (`name + SCALE_SUFFIX`). `block`: the checkpoint's scale block.
    `expert_groups` (sharded): the routed experts' groups (cp_runtime.weights.sharding)."""
    if mode not in ("replicated", "sharded") or weight_dtype not in MODEL_WEIGHT_DTYPES:
        raise ValueError(f"weights {mode!r} in {weight_dtype!r}: resolve 'auto' first "
                         "(resolve_runtime_weights)")
    out = {}
    for name, shape in shapes.items():
        full, local, axis, grouped = _placed(name, shape, model, mode, shards, expert_groups)
        dtype = stored_dtype(name, shape, weight_dtype)
        out[name] = DeviceTensor(name, full, local, dtype, axis, experts=grouped)
        if dtype == "fp8":
            runs = scale_runs(name, local, block)
            out[name + SCALE_SUFFIX] = DeviceTensor(
                name + SCALE_SUFFIX, _with_runs(full, runs), _with_runs(local, runs), "f32",
                axis, scales=name, experts=grouped)
    return out


def bytes_per_device(tensors: dict[str, DeviceTensor]) -> int:
    """Bytes one device holds of `tensors` (every device holds as much: splits are padded)."""
    return sum(t.nbytes_per_device for t in tensors.values())


# "auto" weights replicate a model whose weights take at most this share of one device's memory.
REPLICATE_MAX_FRACTION = 0.25


def model_bytes(model: ModelConfig, weight_dtype: str) -> int:
    """Bytes of the whole model under a concrete `weight_dtype` (what one device holds when
    the weights are replicated)."""
    from cp_runtime.weights.params import model_shapes       # weights imports jax; keep this light
    return bytes_per_device(device_tensors(model_shapes(model), model, "replicated",
                                           weight_dtype, shards=1))


def resolve_weight_mode(mode: str, model: ModelConfig, weight_dtype: str,
                        device_bytes: int) -> str:
    """"replicated" or "sharded" for a `--weights` mode: "auto" shards when the whole model in
    `weight_dtype` (concrete) takes more than REPLICATE_MAX_FRACTION of `device_bytes`."""
    if mode != "auto":
        return mode
    whole = model_bytes(model, weight_dtype)
    return "sharded" if whole > REPLICATE_MAX_FRACTION * device_bytes else "replicated"


def resolve_runtime_weights(runtime: RuntimeConfig, model: ModelConfig,
                            device_bytes: int) -> RuntimeConfig:
    """`runtime` with a concrete weight dtype and mode for `model` on devices of
    `device_bytes` each (raises ConfigError when the mode "auto" picks clashes with the merge)."""
    dtype = resolve_weight_dtype(runtime.weight_dtype, model)
    mode = resolve_weight_mode(runtime.weights, model, dtype, device_bytes)
    return dataclasses.replace(runtime, weight_dtype=dtype, weights=mode)
