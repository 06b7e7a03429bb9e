"""`cp-runtime compile`: compile every program of a deployment for a TPU slice, from shapes.

A `CompilePlan` names the model (optionally cut to its first layers at full width), the slice,
the pool and the step sizes; `compile_plan` builds the executor's programs (cp_runtime.aot.
programs) on the slice's compile-only devices, compiles each with backend `pallas`, and returns
one JSON-ready dict: the programs' figures plus the pool's and the weights' bytes per device,
beside the capacity rule's figure for the same weights.

The pool (`CompilePlan.pages_per_shard`) is a number of pages a shard, or sized by a rule:

    "capacity" (None)  what `cp-runtime capacity` fits on the slice after the model's weights
                       and the activation reserve: the whole HBM. For a model cut to a few
                       layers the pool grows into the cut layers' room, so the cut's peak
                       stands in for the whole model's (the case matrix, cp_runtime.aot.cases)
    "sessions"         the pages `max_batch` sessions of `context` tokens take (what the
                       compiled programs can address at once), or capacity's pool where that
                       is smaller: what `cp-runtime compile` sizes without --pages-per-shard,
                       so that a toy or cut model gets a pool its size, not 86 GiB
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
from cp_runtime.kernels.storage import cdiv
from cp_runtime.weights.format import resolve_runtime_weights
from cp_runtime.weights.placement import param_structs

__all__ = ["POOL_RULES", "CompilePlan", "compile_plan", "pool_pages_for", "session_pages"]

POOL_RULES = ("capacity", "sessions")      # CompilePlan.pages_per_shard's named sizes


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    model: str
    topology: str = "tpu7x-16"
    layers: int | None = None
    kv_cache_dtype: str = "fp8_e4m3"
    page_size: int = 64
    pages_per_shard: int | str | None = None   # pages a shard, or a rule of POOL_RULES
                                               # (module docstring); None: "capacity"
    chunk_size: int = 1024
    max_batch: int = 8
    weights: str = "auto"                  # "auto": as the executor picks for the slice's HBM
    weight_dtype: str = "auto"             # "auto": the model's own (fp8 for the big ones)
    context: int = 1 << 20                 # tokens of the session the step programs serve
    backend: str = "pallas"
    attention: str = "auto"                # Strategy.attention: gather_q, gather_kv, auto
    residual: str = "auto"                 # Strategy.residual: auto, replicated
    row_attention: str = "auto"            # Strategy.row_attention: auto, heads, rows,
                                           # weights
    tpu_schedule: str = "overlap"          # Strategy.tpu_schedule: overlap, xla
    chunk_halves: str = "auto"             # Strategy.chunk_halves: auto, on, off
    expert_groups: int = 1                 # RuntimeConfig.expert_groups
    prefill_expert_groups: int = 1         # RuntimeConfig.prefill_expert_groups
    latent_memory: str = "device"          # RuntimeConfig.latent_memory: device, host
    latent_device_pages: int = 0           # RuntimeConfig.latent_device_pages
    selection: str = "token"               # RuntimeConfig.selection: token, page
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


def session_pages(plan: CompilePlan, devices: int) -> int:
    """Pages a shard that `plan.max_batch` sessions of `plan.context` tokens take: each its
    page table's share of the shard (the programs' table width, cp_runtime.aot.programs)."""
    return plan.max_batch * (cdiv(cdiv(plan.context, plan.page_size), devices) + 1)


def _pool_pages(plan: CompilePlan, model, runtime, devices: int) -> tuple[int, str, int | None]:
    """(pages a shard, the rule that sized them: "given", "capacity" or "sessions", the pages
    capacity's pool would have where it was computed)."""
    rule = "capacity" if plan.pages_per_shard is None else plan.pages_per_shard
    if isinstance(rule, int):
        return rule, "given", None
    if rule not in POOL_RULES:
        raise ValueError(f"pages_per_shard={rule!r}: a number of pages or one of "
                         f"{', '.join(POOL_RULES)}")
    capacity = pool_pages_for(model, plan, runtime.weights, runtime.weight_dtype)
    if rule == "capacity":
        return capacity, "capacity", capacity
    sessions = session_pages(plan, devices)
    return ((sessions, "sessions", capacity) if sessions <= capacity
            else (capacity, "capacity", capacity))


def compile_plan(plan: CompilePlan, progress=None, on_plan=None, on_row=None) -> dict:
    """Compile the plan's programs and return the module docstring's dict. Callbacks, each
    optional: `on_plan(result, names)` once the pool, weights and program names are known and
    before any compile (`result` without its "programs"), `progress(name)` before each
    program's compile, `on_row(row)` with each program's figures as it finishes. A cut model's
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
    pages, pool_rule, capacity_pages = _pool_pages(plan, model, runtime, topo.devices)
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
    spec = pool_spec_for(model, runtime)
    capacity = deployment_report(model, plan.kv_cache_dtype, devices=topo.devices,
                                 hbm_gib=topo.hbm_gib, weight_dtype=runtime.weight_dtype,
                                 weights=runtime.weights, topology=topo.name)
    result = {
        "model": model.name,
        "layers": model.num_hidden_layers,
        "layers_of_model": full.num_hidden_layers,
        "topology": topo.name,
        "devices": topo.devices,
        "device_kind": devices[0].device_kind,
        "kv_cache_dtype": plan.kv_cache_dtype,
        "page_size": plan.page_size,
        "pages_per_shard": pages,
        "pool_rule": pool_rule,
        "capacity_pages_per_shard": capacity_pages,
        "session_pages_per_shard": session_pages(plan, topo.devices),
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
    }
    if on_plan is not None:
        on_plan(result, [p.name for p in programs])
    rows = []
    for program in programs:
        if progress is not None:
            progress(program.name)
        rows.append(compile_program(program, devices[0]))
        if on_row is not None:
            on_row(rows[-1])
    return {**result, "programs": rows}
