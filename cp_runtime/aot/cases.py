"""The step programs a long-context deployment runs, compiled for a TPU slice and priced per phase
at the whole model's size: `cp-runtime compile --matrix`.

    decode  D B=b   the decode step of b rows whose page tables cover D tokens
    prefill @o      a prefill chunk whose queries start at offset o (its page table covers
                    o + chunk tokens, as the engine's would), with its last query's logits

Each case compiles the model cut to its first layers (by default the fewest holding every kind
of layer: dense or MoE MLP, full or shared indexer), reads the figures per layer and phase from
the compiled module (cp_runtime.aot.phases), scales them to the whole model kind by kind, and
prices each phase (cp_runtime.aot.roofline: the compiler's cycles at its own clock, kernels at
their roofline, collectives at ICI rate), beside its floor.

A whole prefill of N tokens is the sum of its N / chunk chunk steps, each read off the line
through the chunks compiled at offsets from 0 to N - chunk (a chunk's cost grows with the
context it sees: the indexer's keys, the page table; the attention kernel's bound grows with the
pages until a query block's selections could fill it, about 128K tokens into a GLM-5.2 prompt,
and stays flat after, which is why the default cases hold a chunk at 120K).

Measured with it: the notes docs/notes/README.md lists from 2026-12-02 on, each change to the step
programs before and after.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cp_runtime.aot.deploy import CompilePlan, compile_plan
from cp_runtime.aot.phases import PhaseFigures, layers_covering_kinds, model_figures
from cp_runtime.aot.programs import cut_model
from cp_runtime.aot.roofline import TPU7X_DEVICE, DeviceRates, compiler_clock_hz, phase_time
from cp_runtime.aot.topology import compile_only_devices
from cp_runtime.config import load_model_config

__all__ = ["PREFILL_PROGRAM", "PhaseCase", "case_matrix", "run_case", "run_exchanges",
           "run_matrix", "prefill_seconds", "size_label", "priced"]


# The chunk with its last query's logits, not the "fill" chunk most steps run: in a fill chunk
# nothing reads the last layer's output, so XLA drops that layer's attention and MLP, and a cut
# model's last layer would stand for its kind with only its cache write. The logits of one row
# add the lm head of one token.
PREFILL_PROGRAM = "prefill_logits"


def size_label(tokens: int) -> str:
    """1048576 -> '1M', 131072 -> '128K', 1000 -> '1000'."""
    for shift, unit in ((20, "M"), (10, "K")):
        if tokens and tokens % (1 << shift) == 0:
            return f"{tokens >> shift}{unit}"
    return str(tokens)


@dataclasses.dataclass(frozen=True)
class PhaseCase:
    """One program to compile: decode (`batch` rows) or a prefill chunk at `offset`; its page
    tables cover `context` tokens."""

    program: str
    context: int
    batch: int = 1
    offset: int = 0

    @property
    def name(self) -> str:
        tier = " (HBM tier)" if self.program.endswith("_in_hbm") else ""
        if self.program.startswith("decode"):
            return f"decode {size_label(self.context)} B={self.batch}{tier}"
        return f"prefill @{size_label(self.offset)}{tier}"


def case_matrix(*, chunk: int, contexts=(128 << 10, 1 << 20), batches=(1, 8, 32),
                prefill_lengths=(128 << 10, 1 << 20)) -> list[PhaseCase]:
    """Decode at each context and batch; prefill chunks at offsets 0 and N - chunk of each
    prefill length N, and N/2 of the longest (offsets shared between lengths compiled once)."""
    cases = [PhaseCase("decode", c, b) for c in contexts for b in batches]
    longest = max(prefill_lengths)
    offsets = sorted({o for n in prefill_lengths for o in (0, n - chunk)} | {longest // 2})
    return cases + [PhaseCase(PREFILL_PROGRAM, o + chunk, 1, o) for o in offsets]


def _layer_keys(rows: list[dict]) -> dict[tuple, PhaseFigures]:
    fields = {f.name for f in dataclasses.fields(PhaseFigures)}
    return {(r["layer"], r["phase"]): PhaseFigures(**{k: v for k, v in r.items() if k in fields})
            for r in rows}


def run_case(case: PhaseCase, *, model: str, layers: int | None, chunk: int,
             page_size: int, kv_cache_dtype: str, topology: str, clock_hz: float,
             pages_per_shard: int | None = None, attention: str = "auto",
             residual: str = "auto", row_attention: str = "auto",
             tpu_schedule: str = "overlap", chunk_halves: str = "auto",
             expert_groups: int = 1, prefill_expert_groups: int = 1,
             latent_memory: str = "device", latent_device_pages: int = 0,
             selection: str = "token", rates: DeviceRates = TPU7X_DEVICE) -> dict:
    """Compile one case and price its phases at the whole model's size (module docstring)."""
    full = load_model_config(model)
    layers = layers or layers_covering_kinds(full)
    plan = CompilePlan(model=model, topology=topology, layers=layers,
                       kv_cache_dtype=kv_cache_dtype, page_size=page_size, chunk_size=chunk,
                       max_batch=case.batch, context=case.context, programs=(case.program,),
                       pages_per_shard=pages_per_shard, attention=attention,
                       residual=residual, row_attention=row_attention,
                       tpu_schedule=tpu_schedule, chunk_halves=chunk_halves,
                       expert_groups=expert_groups,
                       prefill_expert_groups=prefill_expert_groups,
                       latent_memory=latent_memory, latent_device_pages=latent_device_pages,
                       selection=selection)
    result = compile_plan(plan)
    program = result["programs"][0]
    out = {"case": case.name, **dataclasses.asdict(case), "layers_compiled": layers,
           "layers_of_model": full.num_hidden_layers, "compiled": program["compiled"],
           "compile_s": program["compile_s"], "error": program["error"],
           "temp_bytes": program["temp_bytes"], "peak_bytes": program["peak_bytes"],
           "host_argument_bytes": program["host_argument_bytes"]}
    if not program["compiled"]:
        return out
    scaled = model_figures(_layer_keys(program["layer_phases"]), cut_model(full, layers), full)
    return {**out, **priced(scaled, clock_hz, rates)}


def run_exchanges(*, model: str, topology: str, groups: int, clock_hz: float,
                  rates: DeviceRates = TPU7X_DEVICE) -> dict:
    """The routed experts' exchange into `groups` groups before a prompt ("experts_to_groups")
    and back after it ("experts_to_one"; cp_runtime.weights.regroup): one MoE layer's program
    compiled, priced as a step's phases are, and times the model's MoE layers -> {program:
    {seconds, with_unpriced_s (the whole model's), peak_bytes (one layer's program)}}.
    Nothing runs beside an exchange, so its overlapped time is its serial time."""
    full = load_model_config(model)
    moe_layers = [i for i in range(full.num_hidden_layers) if full.is_moe_layer(i)]
    plan = CompilePlan(model=model, topology=topology, layers=moe_layers[0] + 1,
                       prefill_expert_groups=groups,
                       programs=("experts_to_groups", "experts_to_one"))
    out = {}
    for program in compile_plan(plan)["programs"]:
        if not program["compiled"]:
            raise RuntimeError(f"{program['name']} did not compile: {program['error']}")
        layer = priced({name: PhaseFigures(**f) for name, f in program["phases"].items()},
                       clock_hz, rates)
        out[program["name"]] = {"seconds": layer["seconds"] * len(moe_layers),
                                "with_unpriced_s": layer["with_unpriced_s"] * len(moe_layers),
                                "peak_bytes": program["peak_bytes"]}
    return out


def priced(phases: dict[str, PhaseFigures], clock_hz: float,
           rates: DeviceRates = TPU7X_DEVICE) -> dict:
    """{phases: each phase's figures with its estimate and floor (cp_runtime.aot.roofline),
    attention: the layout the program ran, seconds, overlapped_s, with_unpriced_s, floor_s:
    their sums}."""
    out = {name: {**dataclasses.asdict(f), **phase_time(f, rates, clock_hz).as_dict()}
           for name, f in phases.items()}
    return {"phases": out,
            "attention": "gather_kv" if out["kv_gather"]["instructions"] else "gather_q",
            "seconds": sum(p["seconds"] for p in out.values()),
            "overlapped_s": sum(p["overlapped_s"] for p in out.values()),
            "with_unpriced_s": sum(p["with_unpriced_s"] for p in out.values()),
            "floor_s": sum(p["floor_s"] for p in out.values())}


def run_matrix(cases: list[PhaseCase], *, model: str, layers: int | None = None,
               chunk: int = 8192, page_size: int = 64, kv_cache_dtype: str = "fp8_e4m3",
               topology: str = "tpu7x-16", pages_per_shard: int | None = None,
               attention: str = "auto", residual: str = "auto", row_attention: str = "auto",
               tpu_schedule: str = "overlap", chunk_halves: str = "auto",
               expert_groups: int = 1, prefill_expert_groups: int = 1,
               latent_memory: str = "device", latent_device_pages: int = 0,
               selection: str = "token", progress=None, on_case=None) -> dict:
    """Every case of `cases`, compiled and priced; with the compiler's clock. The pool is the
    one capacity sizes for the slice unless `pages_per_shard` is given. `progress(name)` is
    called before each case's compile, `on_case(row)` with each case's row as it finishes."""
    device = compile_only_devices(topology)[0]
    clock = compiler_clock_hz(device)
    rows = []
    for case in cases:
        if progress is not None:
            progress(f"{model}: {case.name}")
        rows.append(run_case(case, model=model, layers=layers, chunk=chunk,
                             page_size=page_size, kv_cache_dtype=kv_cache_dtype,
                             topology=topology, clock_hz=clock,
                             pages_per_shard=pages_per_shard, attention=attention,
                             residual=residual, row_attention=row_attention,
                             tpu_schedule=tpu_schedule, chunk_halves=chunk_halves,
                             expert_groups=expert_groups,
                             prefill_expert_groups=prefill_expert_groups,
                             latent_memory=latent_memory,
                             latent_device_pages=latent_device_pages,
                             selection=selection))
        if on_case is not None:
            on_case(rows[-1])
    return {"model": model, "topology": topology, "chunk_size": chunk, "page_size": page_size,
            "kv_cache_dtype": kv_cache_dtype, "attention": attention,
            "residual": residual, "row_attention": row_attention,
            "tpu_schedule": tpu_schedule, "chunk_halves": chunk_halves,
            "expert_groups": expert_groups, "prefill_expert_groups": prefill_expert_groups,
            "latent_memory": latent_memory, "latent_device_pages": latent_device_pages,
            "selection": selection, "clock_hz": clock,
            "rates": dataclasses.asdict(TPU7X_DEVICE), "cases": rows}


def prefill_seconds(rows: list[dict], length: int, chunk: int, key: str = "seconds"
                    ) -> float | None:
    """A whole `length`-token prefill from its compiled chunks' `key` ("seconds",
    "overlapped_s" or "with_unpriced_s"; module docstring); None when the chunks at 0 and
    length - chunk are not among `rows`."""
    at = {r["offset"]: r[key] for r in rows
          if r["program"] == PREFILL_PROGRAM and r.get(key) is not None}
    last = length - chunk
    if 0 not in at or last not in at:
        return None
    known = sorted(o for o in at if o <= last)
    offsets = np.arange(length // chunk) * chunk
    return float(np.interp(offsets, known, [at[o] for o in known]).sum())
