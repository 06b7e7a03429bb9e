"""Capacity arithmetic: the single source of the bytes-per-token figure, and what fits per device.

    bytes_per_token = n_layers * D_lat_pad * bytes(latent dtype)
                    + n_full_indexer_layers * D_idx * bytes(indexer dtype)

GLM-5.2 (78 layers, 21 indexers, 640 + 128 dims): bf16 105,216 B, fp8 55,296 B, ratio 1.90x.
The scheduler's admission and the pool's sizing both call `bytes_per_token`.

Per device of a deployment (`deployment_report`):

    HBM = weights (this device's shard, `weight_bytes_per_device`) + reserve + KV cache

The KV cache is sharded by position over every device (context parallelism), so the tokens that
fit are (sum over devices of the KV bytes) // bytes_per_token.

The weights per device are the arrays the runtime places (cp_runtime.weights.format's
`device_tensors`, the same function the executor and `cp-runtime compile` use): split over the
same devices as the cache in `weights = "sharded"` mode (cp_runtime.weights.sharding: attention
projections by heads, dense MLPs and routed experts column/row parallel, embedding
and lm head by vocabulary, the other projections by output features; norms and biases whole on
every device; a split that does not divide is padded, as the runtime pads it), or whole on each
device in "replicated" mode; "auto" picks as the runtime does.

Weight dtypes (`cp-runtime capacity --weight-dtype`; "auto" is the model's own, fp8 for
GLM-5.2 and DeepSeek-V3.2): fp8 matmul weights 1 byte per value plus an f32 scale per block
(embedding, lm head, router gate and indexer weights_proj bf16), or every matmul weight bf16;
norms and biases f32 in both (cp_runtime.weights.format).

Reserve: ACTIVATION_RESERVE_FRACTION (10%) of each device's HBM is kept for activations, XLA
scratch and the step's temporaries (a round figure, not a measurement); `reserve_gib` overrides.

`slice_report` is what `cp-runtime capacity` and `cp-runtime bench capacity` both report: a
known topology (DEFAULT_TOPOLOGY unless a custom slice is given) through `deployment_report`, or,
with a fixed weight share per device, `capacity_report`.
"""

from __future__ import annotations

import dataclasses
import math

from cp_runtime.config import ModelConfig
from cp_runtime.dtypes import dtype_bytes, indexer_cache_dtype, latent_cache_dtype
from cp_runtime.weights.format import (WEIGHT_DTYPES, bytes_per_device, device_tensors,
                                       resolve_weight_dtype, resolve_weight_mode)

__all__ = ["ACTIVATION_RESERVE_FRACTION", "DEFAULT_TOPOLOGY", "GIB", "TOPOLOGIES", "WEIGHT_DTYPES",
           "CapacityReport", "Topology", "bytes_per_token", "capacity_report", "deployment_report",
           "slice_report", "weight_bytes_per_device"]

GIB = 1 << 30
ACTIVATION_RESERVE_FRACTION = 0.10


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice of accelerators: `devices` JAX devices of `hbm_gib` each."""

    name: str
    devices: int
    hbm_gib: float
    chips: int
    hosts: int
    shape: str


# TPU v7x (Ironwood): a chip has two TensorCores, each a JAX device with 96 GiB of HBM (192 GiB
# per chip); a host holds 4 chips = 8 devices.
TOPOLOGIES = {
    "tpu7x-8": Topology("tpu7x-8", devices=8, hbm_gib=96.0, chips=4, hosts=1, shape="2x2x1"),
    "tpu7x-16": Topology("tpu7x-16", devices=16, hbm_gib=96.0, chips=8, hosts=2, shape="2x2x2"),
    "tpu7x-32": Topology("tpu7x-32", devices=32, hbm_gib=96.0, chips=16, hosts=4, shape="2x2x4"),
}
DEFAULT_TOPOLOGY = "tpu7x-16"


def bytes_per_token(model: ModelConfig, kv_cache_dtype: str, latent_memory: str = "device"
                    ) -> int:
    """Cache bytes one token occupies across all layers (latent + indexer), one copy, in the
    devices' memory: the indexer's alone where the latent cache is held in host memory
    (`latent_memory` "host"; `host_bytes_per_token`)."""
    indexer = model.num_full_layers * model.index_head_dim * dtype_bytes(
        indexer_cache_dtype(kv_cache_dtype))
    if latent_memory == "host":
        return indexer
    return host_bytes_per_token(model, kv_cache_dtype) + indexer


def host_bytes_per_token(model: ModelConfig, kv_cache_dtype: str) -> int:
    """The latent cache's bytes of one token across all layers: what host memory holds of it
    where the latent cache lives there (its words take the values' bytes)."""
    return model.num_hidden_layers * model.latent_dim * dtype_bytes(
        latent_cache_dtype(kv_cache_dtype))


# -- weights per device ---------------------------------------------------------------------
def weight_bytes_per_device(model: ModelConfig, devices: int, weight_dtype: str = "auto",
                            weights: str = "sharded") -> int:
    """Weight bytes on each of `devices` devices, block scales included, as the runtime holds
    them (cp_runtime.weights.format: dtypes and scales; cp_runtime.weights.sharding: the split,
    padded where it does not divide) in mode `weights` ("replicated" or "sharded")."""
    from cp_runtime.weights.params import model_shapes       # weights imports jax; keep this light

    if devices <= 0:
        raise ValueError(f"{devices=} must be positive")
    dtype = resolve_weight_dtype(weight_dtype, model)
    return bytes_per_device(device_tensors(model_shapes(model), model, weights, dtype, devices))


# -- reports --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CapacityReport:
    model: str
    kv_cache_dtype: str
    bytes_per_token_bf16: int
    bytes_per_token: int
    ratio_vs_bf16: float
    ratio_vs_bf16_2dp: str
    devices: int
    hbm_gib_per_device: float
    weights_gib_per_device: float
    cache_gib_total: float
    tokens_that_fit: int
    tokens_that_fit_bf16: int
    # Deployment detail (deployment_report); the defaults describe a bare capacity_report.
    topology: str | None = None
    weight_dtype: str | None = None
    weights: str | None = None            # the weight mode: replicated or sharded
    weight_bytes_per_device: int | None = None
    reserve_gib_per_device: float = 0.0
    kv_gib_per_device: float = 0.0
    weights_fit: bool = True          # weights + reserve <= HBM (else no KV fits at all)
    bytes_per_token_fp8: int = 0
    tokens_that_fit_fp8: int = 0
    # With the latent cache in host memory (RuntimeConfig.latent_memory "host"): the devices
    # hold the indexer's bytes of a token, the hosts its latent bytes.
    device_bytes_per_token_host_latent: int = 0
    tokens_that_fit_host_latent: int = 0
    host_bytes_per_token: int = 0


def capacity_report(model: ModelConfig, kv_cache_dtype: str, *, devices: int, hbm_gib: float,
                    weights_gib: float, reserve_gib: float = 0.0, **detail) -> CapacityReport:
    """How many tokens fit in `devices` devices of `hbm_gib` each, after `weights_gib` and
    `reserve_gib` each. `detail`: CapacityReport's deployment fields to record."""
    if devices <= 0:
        raise ValueError(f"{devices=} must be positive")
    for label, x in (("hbm_gib", hbm_gib), ("weights_gib", weights_gib),
                     ("reserve_gib", reserve_gib)):
        if not math.isfinite(x) or x < 0 or (label == "hbm_gib" and x == 0):
            raise ValueError(f"{label}={x} must be finite and "
                             + ("positive" if label == "hbm_gib" else "non-negative"))
    kv_gib = max(hbm_gib - weights_gib - reserve_gib, 0.0)
    cache_bytes = int(kv_gib * GIB) * devices
    bpt, bpt_bf16 = bytes_per_token(model, kv_cache_dtype), bytes_per_token(model, "bf16")
    bpt_fp8 = bytes_per_token(model, "fp8_e4m3")
    bpt_device = bytes_per_token(model, kv_cache_dtype, "host")
    return CapacityReport(
        model=model.name,
        kv_cache_dtype=kv_cache_dtype,
        bytes_per_token_bf16=bpt_bf16,
        bytes_per_token=bpt,
        ratio_vs_bf16=round(bpt_bf16 / bpt, 4),
        ratio_vs_bf16_2dp=f"{bpt_bf16 / bpt:.2f}",
        devices=devices,
        hbm_gib_per_device=hbm_gib,
        weights_gib_per_device=weights_gib,
        cache_gib_total=kv_gib * devices,
        tokens_that_fit=cache_bytes // bpt,
        tokens_that_fit_bf16=cache_bytes // bpt_bf16,
        reserve_gib_per_device=reserve_gib,
        kv_gib_per_device=kv_gib,
        weights_fit=weights_gib + reserve_gib <= hbm_gib,
        bytes_per_token_fp8=bpt_fp8,
        tokens_that_fit_fp8=cache_bytes // bpt_fp8,
        device_bytes_per_token_host_latent=bpt_device,
        tokens_that_fit_host_latent=cache_bytes // bpt_device,
        host_bytes_per_token=host_bytes_per_token(model, kv_cache_dtype),
        **detail,
    )


def deployment_report(model: ModelConfig, kv_cache_dtype: str, *, devices: int, hbm_gib: float,
                      weight_dtype: str = "auto", weights: str = "auto",
                      reserve_gib: float | None = None,
                      topology: str | None = None) -> CapacityReport:
    """capacity_report with the weights computed from the config (`weight_bytes_per_device`,
    the mode "auto" resolved for `hbm_gib` devices as the runtime resolves it) and the reserve
    ACTIVATION_RESERVE_FRACTION of HBM unless `reserve_gib` is given."""
    weight_dtype = resolve_weight_dtype(weight_dtype, model)
    weights = resolve_weight_mode(weights, model, weight_dtype, int(hbm_gib * GIB))
    weight_bytes = weight_bytes_per_device(model, devices, weight_dtype, weights)
    if reserve_gib is None:
        reserve_gib = ACTIVATION_RESERVE_FRACTION * hbm_gib
    return capacity_report(model, kv_cache_dtype, devices=devices, hbm_gib=hbm_gib,
                           weights_gib=weight_bytes / GIB, reserve_gib=reserve_gib,
                           topology=topology, weight_dtype=weight_dtype, weights=weights,
                           weight_bytes_per_device=weight_bytes)


def slice_report(model: ModelConfig, kv_cache_dtype: str, *, topology: str | None = None,
                 devices: int | None = None, hbm_gib: float | None = None,
                 weight_dtype: str = "auto", weights: str = "auto",
                 reserve_gib: float | None = None,
                 weights_gib: float | None = None) -> CapacityReport:
    """The capacity of a slice: `topology` (DEFAULT_TOPOLOGY when neither it nor a custom
    slice is given), or a custom slice of `devices` devices of `hbm_gib` each (both or neither;
    not with `topology`). deployment_report computes the weights; a fixed `weights_gib` per
    device replaces them (capacity_report, no reserve unless `reserve_gib`)."""
    if (devices is None) != (hbm_gib is None):
        raise ValueError("devices and hbm_gib go together")
    if topology is not None and devices is not None:
        raise ValueError("give a topology, or devices with hbm_gib, not both")
    topo = None if devices is not None else TOPOLOGIES[topology or DEFAULT_TOPOLOGY]
    if topo is not None:
        devices, hbm_gib = topo.devices, topo.hbm_gib
    name = topo and topo.name
    if weights_gib is not None:
        return capacity_report(model, kv_cache_dtype, devices=devices, hbm_gib=hbm_gib,
                               weights_gib=weights_gib, reserve_gib=reserve_gib or 0.0,
                               topology=name)
    return deployment_report(model, kv_cache_dtype, devices=devices, hbm_gib=hbm_gib,
                             weight_dtype=weight_dtype, weights=weights,
                             reserve_gib=reserve_gib, topology=name)
