"""Capacity arithmetic: the single source of the bytes-per-token figure.

    bytes_per_token = n_layers * D_lat_pad * bytes(latent dtype)
                    + n_full_indexer_layers * D_idx * bytes(indexer dtype)

GLM-5.2 (78 layers, 21 indexers, 640 + 128 dims): bf16 105,216 B, fp8 55,296 B, ratio 1.90x.
The scheduler's admission and the pool's sizing both call `bytes_per_token`.
"""

from __future__ import annotations

import dataclasses

from cp_runtime.config import ModelConfig
from cp_runtime.dtypes import dtype_bytes, indexer_cache_dtype, latent_cache_dtype

__all__ = ["bytes_per_token", "CapacityReport", "capacity_report", "GIB"]

GIB = 1 << 30


def bytes_per_token(model: ModelConfig, kv_cache_dtype: str) -> int:
    """Cache bytes one token occupies across all layers (latent + indexer), one copy."""
    latent = model.num_hidden_layers * model.latent_dim * dtype_bytes(
        latent_cache_dtype(kv_cache_dtype))
    indexer = model.num_full_layers * model.index_head_dim * dtype_bytes(
        indexer_cache_dtype(kv_cache_dtype))
    return latent + indexer


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


def capacity_report(model: ModelConfig, kv_cache_dtype: str, *, devices: int, hbm_gib: float,
                    weights_gib: float) -> CapacityReport:
    """How many tokens fit in `devices` devices of `hbm_gib` each, after `weights_gib` each."""
    if devices <= 0:
        raise ValueError(f"{devices=} must be positive")
    if weights_gib < 0 or hbm_gib <= 0:
        raise ValueError(f"{hbm_gib=} must be positive and {weights_gib=} non-negative")
    free_gib = max(hbm_gib - weights_gib, 0.0)
    cache_bytes = int(free_gib * GIB) * devices
    bpt, bpt_bf16 = bytes_per_token(model, kv_cache_dtype), bytes_per_token(model, "bf16")
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
        cache_gib_total=free_gib * devices,
        tokens_that_fit=cache_bytes // bpt,
        tokens_that_fit_bf16=cache_bytes // bpt_bf16,
    )
