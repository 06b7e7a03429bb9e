"""`cp-runtime compile`: compile every program of a deployment for a TPU slice, from shapes.

A `CompilePlan` names the model (optionally cut to its first layers at full width), the slice,
the pool and the step sizes; `compile_plan` builds the executor's programs (cp_runtime.aot.
programs) on the slice's compile-only devices, compiles each with backend `pallas`, and returns
one JSON-ready dict: the programs' figures plus the pool's and the weights' bytes per device,
beside the capacity rule's figure for the same weights.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh

from cp_runtime.aot.programs import cut_model, executor_programs, pool_structs, weight_tensors
from cp_runtime.aot.report import compile_program, per_device_bytes
from cp_runtime.aot.topology import compile_only_devices, topology
from cp_runtime.cache.capacity import GIB, deployment_report
from cp_runtime.cache.pool import CP_AXIS
from cp_runtime.config import RuntimeConfig, load_model_config
from cp_runtime.engine.executor import pool_spec_for
from cp_runtime.weights.format import resolve_runtime_weights
from cp_runtime.weights.placement import param_structs

__all__ = ["CompilePlan", "compile_plan", "pool_pages_for"]


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    model: str
    topology: str = "tpu7x-16"
    layers: int | None = None
    kv_cache_dtype: str = "fp8_e4m3"
    page_size: int = 64
    pages_per_shard: int | None = None     # None: what capacity gives for this model and slice
    chunk_size: int = 1024
    max_batch: int = 8
    weights: str = "auto"                  # "auto": as the executor picks for the slice's HBM
    weight_dtype: str = "auto"             # "auto": the model's own (fp8 for the big ones)
    context: int = 1 << 20                 # tokens of the session the step programs serve
    backend: str = "pallas"
    attention: str = "auto"                # RuntimeConfig.attention: gather_q, gather_kv, auto
    residual: str = "auto"                 # RuntimeConfig.residual: auto, replicated
    row_attention: str = "auto"            # RuntimeConfig.row_attention: auto, heads, rows,
                                           # weights
    tpu_schedule: str = "overlap"          # RuntimeConfig.tpu_schedule: overlap, xla
    chunk_halves: str = "auto"             # RuntimeConfig.chunk_halves: auto, on, off
    expert_groups: int = 1                 # RuntimeConfig.expert_groups
    prefill_expert_groups: int = 1         # RuntimeConfig.prefill_expert_groups
    latent_memory: str = "device"          # RuntimeConfig.latent_memory: device, host
    latent_device_pages: int = 0           # RuntimeConfig.latent_device_pages
    selection: str = "page"                # RuntimeConfig.selection: token, page
    programs: tuple[str, ...] | None = None   # None: all of them


def pool_pages_for(model, plan: CompilePlan, weights: str, weight_dtype: str) -> int:
    """Pages per shard of the capacity-sized pool: the tokens `cp-runtime capacity` says fit
    after this model's weights (in mode `weights` and `weight_dtype`) and the reserve, spread
    over the shards."""
    topo = topology(plan.topology)
    report = deployment_report(model, plan.kv_cache_dtype, devices=topo.devices,
                               hbm_gib=topo.hbm_gib, weight_dtype=weight_dtype,
                               weights=weights, topology=topo.name)
    pages = report.tokens_that_fit // (topo.devices * plan.page_size)
    if pages < 1:
        raise ValueError(f"no cache fits: {model.name}'s weights and the reserve take all of "
                         f"{topo.hbm_gib:g} GiB per device; give --pages-per-shard")
    return pages


def compile_plan(plan: CompilePlan, progress=None) -> dict:
    """Compile the plan's programs; `progress(name)` is called before each. A cut model's
    weights take the mode "auto" picks for the whole model: the cut stands in for it."""
    topo = topology(plan.topology)
    full = load_model_config(plan.model)
    model = cut_model(full, plan.layers)
    runtime = RuntimeConfig(model=model.name, kv_cache_dtype=plan.kv_cache_dtype,
                            page_size=plan.page_size, num_shards=topo.devices,
                            chunk_size=plan.chunk_size, max_batch=plan.max_batch,
                            backend=plan.backend, weights=plan.weights,
                            weight_dtype=plan.weight_dtype, attention=plan.attention,
                            residual=plan.residual, row_attention=plan.row_attention,
                            tpu_schedule=plan.tpu_schedule, chunk_halves=plan.chunk_halves,
                            expert_groups=plan.expert_groups,
                            prefill_expert_groups=plan.prefill_expert_groups,
                            latent_memory=plan.latent_memory, selection=plan.selection)
    runtime = resolve_runtime_weights(runtime, full, int(topo.hbm_gib * GIB))
    pages = plan.pages_per_shard or pool_pages_for(model, plan, runtime.weights,
                                                   runtime.weight_dtype)
    runtime = dataclasses.replace(runtime, pages_per_shard=pages,
                                  latent_device_pages=plan.latent_device_pages)
    devices = compile_only_devices(plan.topology)
    mesh = Mesh(np.array(devices), (CP_AXIS,))
    programs = executor_programs(model, runtime, mesh, context=plan.context)
    if plan.programs is not None:
        unknown = set(plan.programs) - {p.name for p in programs}
        if unknown:
            raise ValueError(f"unknown programs {sorted(unknown)}; choices: "
                             f"{', '.join(p.name for p in programs)}")
        programs = [p for p in programs if p.name in plan.programs]
    rows = []
    for program in programs:
        if progress is not None:
            progress(program.name)
        rows.append(compile_program(program, devices[0]))
    spec = pool_spec_for(model, runtime)
    capacity = deployment_report(model, plan.kv_cache_dtype, devices=topo.devices,
                                 hbm_gib=topo.hbm_gib, weight_dtype=runtime.weight_dtype,
                                 weights=runtime.weights, topology=topo.name)
    return {
        "model": model.name,
        "layers": model.num_hidden_layers,
        "layers_of_model": full.num_hidden_layers,
        "topology": topo.name,
        "devices": topo.devices,
        "device_kind": devices[0].device_kind,
        "kv_cache_dtype": plan.kv_cache_dtype,
        "page_size": plan.page_size,
        "pages_per_shard": pages,
        "chunk_size": plan.chunk_size,
        "max_batch": plan.max_batch,
        "context": plan.context,
        "weights": runtime.weights,
        "weight_dtype": runtime.weight_dtype,
        "backend": plan.backend,
        "tpu_schedule": plan.tpu_schedule,
        "chunk_halves": plan.chunk_halves,
        "expert_groups": runtime.expert_groups,
        "prefill_expert_groups": runtime.prefill_expert_groups,
        "hbm_bytes_per_device": int(topo.hbm_gib * GIB),
        "latent_memory": runtime.latent_memory,
        "latent_device_pages": runtime.latent_device_pages,
        "selection": runtime.selection,
        "pool_bytes_per_device": per_device_bytes(pool_structs(spec, mesh), "device"),
        "pool_host_bytes_per_device": per_device_bytes(pool_structs(spec, mesh), "pinned_host"),
        "weight_bytes_per_device": per_device_bytes(
            param_structs(weight_tensors(model, runtime), mesh)),
        "capacity_weight_bytes_per_device": capacity.weight_bytes_per_device,
        "programs": rows,
    }
