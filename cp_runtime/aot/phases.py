"""A compiled program's figures per step phase and per layer, read from the module XLA:TPU made.

Every instruction carries its op_name: the `jax.named_scope` path it was traced under, which
holds the layer (`layer7`, cp_runtime.model.scopes.layer_scope) and the phase
(cp_runtime.model.scopes). An instruction belongs to the innermost phase in its op_name (one
under none is "other") and to the layer named there (None outside the layer stack: embedding,
lm head, sampling). An entry instruction XLA made without an op_name (a multi-output fusion,
an inserted copy), or named by a layer's weight alone (a relayout copy of it), belongs where
its nearest named consumer, else producer, does. Summed per (layer, phase), from the entry
computation (cp_runtime.aot.hlo says how each figure is read):

    instructions     entry instructions
    cycles           the TPU compiler's estimated cycles (XLA's own fusions; none on Mosaic
                     calls and collectives)
    xla_bytes        HBM bytes the entry's XLA instructions read and write
    mxu_flops        flops of XLA's convolutions and dots (inside fusions too);
    mxu_flops_f8       of which with both operands fp8 (the fp8 MXU rate)
    kernels          Mosaic calls: our Pallas kernels and XLA's ragged dots
    kernel_flops     their flops and HBM bytes, from the cost estimate each carries
    kernel_flops_f8    of which in kernels whose matmuls are fp8 x fp8 (`Instruction.fp8_mxu`)
    kernel_vpu_ops   the VPU operations of kernels whose work is the vector unit's
                     (`Instruction.vpu`), not counted in kernel_flops
    kernel_bytes
    unpriced         work XLA:TPU gives no price and that is no kernel or collective: sorts,
                     rewritten scatters, SparseCore gathers and relayouts (`hlo.Instruction.
                     unpriced`), priced at nothing: a gap in every estimate, counted so it shows
    unpriced_bytes   HBM bytes they move at the least: each result written and as much read
    sparsecore_bytes   of which the SparseCore calls'
    unpriced_waits   seconds the TensorCore waits on the ICI and the SparseCores (charged to
                     what it waits on) in the replay of `windows` with the unpriced work run
                     at its least bytes at the HBM rate: sorts and rewritten scatters on the
                     TensorCore, the SparseCore calls beside it, one after another (a hand
                     model where the compiler gives no time; roofline's `with_unpriced_s`)
    collectives      all-gather / all-reduce / reduce-scatter / all-to-all / collective-permute
                     instructions anywhere in the module (XLA:TPU runs them asynchronously,
                     on the SparseCores; a start and its done count once)
    collective_bytes the bytes they produce per device (their result arrays)
    ici_bytes        the bytes each device sends for them (ring algorithms, cp_runtime.aot.hlo.
                     ici_bytes)
    windows          per collective the entry starts (a `<collective>-start`, a `call-start`
                     of the SparseCore computation holding one, or a synchronous collective):
                     [weight, its ICI bytes, its collectives, the seconds of it hidden]. The
                     schedule is the module's order, replayed (`_timeline`): the TensorCore
                     runs the entry's instructions one after another (XLA's cycles at the
                     compiler's clock, a Mosaic call at its roofline), one ICI moves the
                     collectives one after another in the order they start, and a done waits
                     for its collective; a collective's time is hidden but for the waits while
                     it moves. So collectives in flight together share the work beside them,
                     and work after a collective's done hides none of it.

`model_figures` scales the figures of a model cut to its first layers (cp_runtime.aot.programs.
cut_model) to the whole model: each layer of the whole model counts as the mean of the cut's
layers of its kind (dense or MoE MLP, full or shared indexer), the rest once.

What this cannot give: the time of a Mosaic call or of a real collective (cp_runtime.aot.
roofline prices those from their bytes and flops), and whether a collective and the work beside
it slow each other on the chip (both may use HBM).
"""

from __future__ import annotations

import dataclasses
import re

from cp_runtime.aot import hlo
from cp_runtime.aot.roofline import (TPU7X_DEVICE, DeviceRates, collective_seconds,
                                     kernel_seconds)
from cp_runtime.config import ModelConfig
from cp_runtime.model.scopes import PHASES

__all__ = ["COLLECTIVES", "PhaseFigures", "layer_figures", "phase_figures", "layer_kind",
           "layers_covering_kinds", "model_figures", "sum_figures"]

COLLECTIVES = hlo.COLLECTIVES
# `layer<i>` as a scope of the op_name; inside a computation XLA:TPU moved to the SparseCores
# the names lose their `jit(step)/shard_map/` head and begin with it.
_LAYER = re.compile(r"(?:^|/)layer(\d+)(?:/|$)")
# A copy XLA makes of a layer's weight (a relayout before a kernel) is named by the parameter
# alone, `params['model.layers.3.mlp...']`: no scope, but the layer's own.
_LAYER_WEIGHT = re.compile(r"^params\[\\?'model\.layers\.\d+\.")

Key = tuple  # (layer or None, phase)


@dataclasses.dataclass
class PhaseFigures:
    """One phase's sums (the module docstring says what each is); floats once scaled."""

    instructions: float = 0
    cycles: float = 0
    xla_bytes: float = 0
    mxu_flops: float = 0
    mxu_flops_f8: float = 0
    kernels: float = 0
    kernel_flops: float = 0
    kernel_flops_f8: float = 0
    kernel_vpu_ops: float = 0
    kernel_bytes: float = 0
    unpriced: float = 0
    unpriced_bytes: float = 0
    sparsecore_bytes: float = 0
    unpriced_waits: float = 0
    collectives: float = 0
    collective_bytes: float = 0
    ici_bytes: float = 0
    windows: list = dataclasses.field(default_factory=list)

    def add(self, other: "PhaseFigures", times: float = 1) -> None:
        for f in dataclasses.fields(self):
            if f.name != "windows":
                setattr(self, f.name, getattr(self, f.name) + times * getattr(other, f.name))
        self.windows = self.windows + [[times * w[0], *w[1:]] for w in other.windows]


def _key(op_name: str) -> Key:
    parts = op_name.split("/")
    layer = _LAYER.search(op_name)
    return (int(layer.group(1)) if layer else None,
            next((p for p in reversed(parts) if p in PHASES), "other"))


def _keys(module: hlo.Module) -> dict[str, Key]:
    """(layer, phase) of each entry instruction. One that XLA left without an op_name (a
    multi-output fusion it formed, a copy it inserted), or named by a layer's weight alone (a
    copy of it in another layout), takes the key of the nearest instruction downstream whose
    op_name names a layer or phase (what consumes it is what it was made for; a bare
    `reshape.722` says nothing), else upstream, else (None, "other")."""
    entry = module.computations[module.entry]
    users = module.users(module.entry)
    named = {i.name: _key(i.op_name) for i in entry
             if i.op_name and not _LAYER_WEIGHT.search(i.op_name)}
    telling = {name: key for name, key in named.items() if key != (None, "other")}

    def search(start: hlo.Instruction, step) -> Key | None:
        seen, frontier = {start.name}, [start]
        for _ in range(8):
            frontier = [n for i in frontier for n in step(i) if n.name not in seen]
            seen.update(n.name for n in frontier)
            found = next((telling[n.name] for n in frontier if n.name in telling), None)
            if found is not None or not frontier:
                return found
        return None

    def downstream(i):
        return users.get(i.name, [])

    def upstream(i):
        return [module.by_name[o] for o in i.operands if o in module.by_name]

    return {i.name: named.get(i.name) or search(i, downstream) or search(i, upstream)
            or (None, "other") for i in entry}


def _entry_callers(module: hlo.Module) -> dict[str, hlo.Instruction]:
    """The entry instruction under which each called computation runs. XLA:TPU offloads a
    collective to the SparseCores as an async call of a computation holding it, and the
    collective it moved there may carry no op_name: its phase is its caller's."""
    callers = module.callers()
    home = {i.name: name for name, body in module.computations.items() for i in body}
    out = {}
    for computation in module.computations:
        caller = callers.get(computation)
        for _ in range(16):                          # nesting depth; XLA's is a few levels
            if caller is None or home[caller.name] == module.entry:
                break
            caller = callers.get(home[caller.name])
        if caller is not None:
            out[computation] = caller
    return out


def layer_figures(hlo_text: str, clock_hz: float,
                  rates: DeviceRates = TPU7X_DEVICE) -> dict[Key, PhaseFigures]:
    """Figures per (layer, phase) of the compiled module `hlo_text` (`compiled.as_text()`);
    `windows` timed at `rates` and the compiler's `clock_hz` (roofline.compiler_clock_hz)."""
    module = hlo.parse_module(hlo_text)
    keys = _keys(module)
    out: dict[Key, PhaseFigures] = {}

    def at(ins: hlo.Instruction) -> PhaseFigures:
        key = keys.get(ins.name) or _key(ins.op_name)
        return out.setdefault(key, PhaseFigures())

    for ins in module.computations[module.entry]:
        f = at(ins)
        f.instructions += 1
        f.cycles += ins.cycles
        f.xla_bytes += hlo.hbm_bytes(ins, module)
        flops = hlo.matmul_flops(ins, module)
        f.mxu_flops += sum(flops.values())
        f.mxu_flops_f8 += flops.get("f8", 0)
        if ins.is_kernel:
            f.kernels += 1
            kernel_flops, kernel_bytes = ins.kernel_cost
            if ins.vpu:
                f.kernel_vpu_ops += kernel_flops
            else:
                f.kernel_flops += kernel_flops
                f.kernel_flops_f8 += kernel_flops if ins.fp8_mxu else 0
            f.kernel_bytes += kernel_bytes
        if ins.unpriced and not _collectives_run_by(module, ins):
            f.unpriced += 1
            f.unpriced_bytes += 2 * ins.result_bytes
            if ins.op == "call-start":
                f.sparsecore_bytes += 2 * ins.result_bytes
    caller_in_entry = _entry_callers(module)

    def named(computation: str, ins: hlo.Instruction) -> hlo.Instruction:
        """The instruction whose key a collective takes: its own; else that of the first
        instruction of its reduction whose name tells a phase (XLA:TPU left a reduce-scatter
        it moved to the SparseCores unnamed, and named its reduction's parameters); else its
        caller's."""
        if ins.op_name:
            return ins
        region = next((i for called in hlo.called_computations(ins)
                       for i in module.computations.get(called, ())
                       if i.op_name and _key(i.op_name)[1] != "other"), None)
        if region is not None:
            return region
        caller = caller_in_entry.get(computation)
        return ins if caller is None else caller

    for computation, instructions in module.computations.items():
        for ins in instructions:
            if ins.op.removesuffix("-start") in COLLECTIVES:
                f = at(named(computation, ins))
                produced, sent = hlo.ici_bytes(ins)
                f.collectives += 1
                f.collective_bytes += produced
                f.ici_bytes += sent
    for window in _timeline(module, rates, clock_hz):
        computation, first = window["collectives"][0]
        at(named(computation, first)).windows.append(window["figures"])
    for span in _timeline(module, rates, clock_hz, unpriced=True):
        computation, first = span["collectives"][0]
        at(named(computation, first)).unpriced_waits += span["exposed"]
    return out


def _collectives_run_by(module: hlo.Module, start: hlo.Instruction) -> list[tuple]:
    """(computation, collective) pairs an entry async start runs: itself, or those of the
    computations a `call-start` calls (the SparseCores' offloaded collectives)."""
    if start.op.removesuffix("-start") in COLLECTIVES:
        return [(module.entry, start)]
    if start.op != "call-start":
        return []
    found, seen, pending = [], set(), list(hlo.called_computations(start))
    while pending:
        computation = pending.pop()
        if computation in seen or computation not in module.computations:
            continue
        seen.add(computation)
        for ins in module.computations[computation]:
            if ins.op.removesuffix("-start") in COLLECTIVES:
                found.append((computation, ins))
            pending.extend(hlo.called_computations(ins))
    return found


class _Fifo:
    """One resource that runs its spans one after another in the order they start (the ICI's
    collectives, or the SparseCores' calls); waits on it are charged to its spans."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.free = 0.0
        self.first_busy = 0

    def start(self, clock: float, seconds: float, **fields) -> dict:
        begin = max(clock, self.free)
        self.free = begin + seconds
        span = {**fields, "seconds": seconds, "begin": begin, "end": self.free, "exposed": 0.0}
        self.spans.append(span)
        return span

    def wait(self, clock: float, end: float) -> float:
        """The TensorCore waits from `clock` to `end`: the wait is charged to the spans this
        resource is moving meanwhile; returns the new clock."""
        while self.first_busy < len(self.spans) and self.spans[self.first_busy]["end"] <= clock:
            self.first_busy += 1
        for span in self.spans[self.first_busy:]:
            if span["begin"] >= end:
                break
            span["exposed"] += max(0.0, min(end, span["end"]) - max(clock, span["begin"]))
        return max(clock, end)


def _timeline(module: hlo.Module, rates: DeviceRates, clock_hz: float,
              unpriced: bool = False) -> list[dict]:
    """Each collective the entry starts, with the seconds of it the schedule hides (module
    docstring, `windows`): the entry runs in order on the TensorCore (XLA's cycles at
    `clock_hz`, a kernel at its roofline), the collectives on one ICI in the order they start
    (`roofline.collective_seconds`); a done waits for its collective, and the time it waits
    is charged to whichever collectives the ICI is moving meanwhile.

    With `unpriced`, the work XLA:TPU gives no price runs too, at its least bytes
    (`Instruction.unpriced`, the result written and as much read) at the HBM rate: sorts and
    rewritten scatters on the TensorCore, the calls it moved to the SparseCores on a second
    resource of their own, beside the TensorCore and the ICI (`unpriced_waits`). Spans then
    include those calls; each span's "exposed" is the time the TensorCore waited on it."""
    entry = module.computations[module.entry]
    awaited = {name for ins in entry if ins.op.endswith("-done") for name in ins.operands}
    ici, sparsecore = _Fifo(), _Fifo()
    by_start: dict[str, tuple[_Fifo, dict]] = {}
    clock = 0.0
    for ins in entry:
        collectives = _collectives_run_by(module, ins)
        offloaded = unpriced and not collectives and ins.unpriced and ins.op == "call-start"
        if collectives or offloaded:
            fifo = ici if collectives else sparsecore
            seconds = (sum(collective_seconds(hlo.ici_bytes(c)[1], 1, rates)
                           for _, c in collectives) if collectives
                       else 2 * ins.result_bytes / rates.hbm_bytes_per_s)
            # A SparseCore call's span names the call where a collective's names those it runs.
            span = fifo.start(clock, seconds, collectives=collectives or [(module.entry, ins)])
            by_start[ins.name] = (fifo, span)
            if ins.name not in awaited:               # synchronous: the TensorCore waits
                clock = fifo.wait(clock, span["end"])
            continue
        if ins.op.endswith("-done"):
            for fifo, span in [by_start[o] for o in ins.operands if o in by_start]:
                clock = fifo.wait(clock, span["end"])
        clock += ins.cycles / clock_hz + (kernel_seconds(*ins.kernel_cost, rates, ins.fp8_mxu,
                                                         ins.vpu) if ins.is_kernel else 0.0)
        if unpriced and ins.unpriced:
            clock += 2 * ins.result_bytes / rates.hbm_bytes_per_s
    if unpriced:
        return ici.spans + sparsecore.spans
    return [{"collectives": span["collectives"], "figures": [
        1, sum(hlo.ici_bytes(c)[1] for _, c in span["collectives"]), len(span["collectives"]),
        span["seconds"] - span["exposed"]]} for span in ici.spans]


def sum_figures(by_key: dict[Key, PhaseFigures]) -> dict[str, PhaseFigures]:
    """Per phase (PHASES order, then "other"), over every layer; zeros where nothing ran."""
    out = {name: PhaseFigures() for name in (*PHASES, "other")}
    for (_, name), f in by_key.items():
        out[name].add(f)
    return out


def phase_figures(hlo_text: str, clock_hz: float,
                  rates: DeviceRates = TPU7X_DEVICE) -> dict[str, PhaseFigures]:
    """Figures per phase of the compiled module `hlo_text`, summed over its layers."""
    return sum_figures(layer_figures(hlo_text, clock_hz, rates))


def layer_kind(model: ModelConfig, layer: int) -> tuple[str, str]:
    """(MLP kind, indexer kind) of a layer: ('moe' | 'dense', 'full' | 'shared')."""
    return ("moe" if model.is_moe_layer(layer) else "dense", model.indexer_types[layer])


def model_figures(by_key: dict[Key, PhaseFigures], cut: ModelConfig, full: ModelConfig
                  ) -> dict[str, PhaseFigures]:
    """Per-phase figures of the whole model `full` from those of `cut` (its first layers):
    each of full's layers counts as the mean of cut's layers of the same kind. Raises
    ValueError when the cut lacks a kind the whole model has."""
    kinds_cut: dict[tuple, list[int]] = {}
    for layer in range(cut.num_hidden_layers):
        kinds_cut.setdefault(layer_kind(cut, layer), []).append(layer)
    counts: dict[tuple, int] = {}
    for layer in range(full.num_hidden_layers):
        kind = layer_kind(full, layer)
        counts[kind] = counts.get(kind, 0) + 1
    missing = sorted(set(counts) - set(kinds_cut))
    if missing:
        raise ValueError(f"{cut.num_hidden_layers} layers of {full.name} have no layer of kind "
                         f"{missing}; cut it to at least {layers_covering_kinds(full)} layers")
    out = {name: PhaseFigures() for name in (*PHASES, "other")}
    for (layer, name), f in by_key.items():
        if layer is None:
            out[name].add(f)
            continue
        kind = layer_kind(cut, layer)
        out[name].add(f, counts.get(kind, 0) / len(kinds_cut[kind]))
    return out


def layers_covering_kinds(model: ModelConfig) -> int:
    """The fewest first layers holding a layer of every kind the model has."""
    kinds = {layer_kind(model, layer) for layer in range(model.num_hidden_layers)}
    seen = set()
    for layer in range(model.num_hidden_layers):
        seen.add(layer_kind(model, layer))
        if seen == kinds:
            return layer + 1
    return model.num_hidden_layers
