"""A compiled program's figures per step phase, read from the text of the module XLA:TPU made.

Each instruction of the entry computation carries its op_name (the `jax.named_scope` path it was
traced under, cp_runtime.model.phases) and, for many of them (fusions), the TPU compiler's own
`estimated_cycles` in its backend config. Summed per phase (an instruction belongs to the
innermost phase in its op_name; one under none is "other"):

    instructions     how many of the entry computation's instructions
    cycles           the compiler's estimated cycles, summed (a Pallas kernel has none: Mosaic
                     attaches no cycle estimate to its custom call)
    kernels          Mosaic kernel calls (`tpu_custom_call`: our Pallas kernels, and any XLA
                     lowers to Mosaic itself)
    kernel_flops     their flops and HBM bytes, from the cost estimate each kernel passes
    kernel_bytes     (cp_runtime.kernels.costs), which the custom call carries
    collectives      all-gather / all-reduce / reduce-scatter / all-to-all / collective-permute
                     instructions anywhere in the module (XLA:TPU wraps them in async calls
                     from the entry computation; an async start and its done count once)
    collective_bytes bytes those collectives produce per device (their result arrays; an
                     async start's, the last of its result tuple)

What this cannot give: seconds (the cycles are the compiler's estimate, summed as if nothing
overlapped; the module's own time estimate is a negative placeholder for the step programs),
flops and HBM bytes of XLA's own fusions per phase (cost_analysis() gives only the module's
totals; the kernels' are their cost estimates), and the time of real collectives over ICI.
"""

from __future__ import annotations

import dataclasses
import math
import re

from cp_runtime.model.phases import PHASES

__all__ = ["COLLECTIVES", "PhaseFigures", "phase_figures"]

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (?P<shape>.+?) (?P<op>[a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[sufc]\d+|bf16|f8e\w+)\[(?P<dims>[\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_KERNEL_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)".*?"bytes_accessed":"(\d+)"')
_BITS = {"pred": 8, "bf16": 16}


@dataclasses.dataclass
class PhaseFigures:
    """One phase's sums (the module docstring says what each is)."""

    instructions: int = 0
    cycles: int = 0
    kernels: int = 0
    kernel_flops: int = 0
    kernel_bytes: int = 0
    collectives: int = 0
    collective_bytes: int = 0


def phase_figures(hlo_text: str) -> dict[str, PhaseFigures]:
    """Figures per phase (PHASES order, then "other") of the compiled module `hlo_text`
    (`compiled.as_text()`): every phase present, zeros where nothing ran under it."""
    figures = {name: PhaseFigures() for name in (*PHASES, "other")}
    entry = hlo_text.index("\nENTRY ")
    entry_end = hlo_text.find("\n}", entry)
    offset = 0
    for line in hlo_text.splitlines(keepends=True):
        in_entry = entry < offset < entry_end
        offset += len(line)
        found = _INSTRUCTION.match(line)
        if found is None:
            continue
        f = figures[_phase_of(line)]
        if in_entry:
            f.instructions += 1
            cycles = _CYCLES.search(line)
            f.cycles += int(cycles.group(1)) if cycles else 0
            _add_kernel(f, line)
        op = found.group("op")
        if op.removesuffix("-start") in COLLECTIVES:
            arrays = _ARRAY.findall(found.group("shape"))
            f.collectives += 1
            f.collective_bytes += _bytes(arrays[-1:] if op.endswith("-start") else arrays)
    return figures


def _add_kernel(f: PhaseFigures, line: str) -> None:
    if 'custom_call_target="tpu_custom_call"' not in line:
        return
    f.kernels += 1
    cost = _KERNEL_COST.search(line)
    if cost:
        f.kernel_flops += int(cost.group(1))
        f.kernel_bytes += int(cost.group(2))


def _phase_of(line: str) -> str:
    name = _OP_NAME.search(line)
    parts = name.group(1).split("/") if name else []
    return next((p for p in reversed(parts) if p in PHASES), "other")


def _bytes(arrays: list[tuple[str, str]]) -> int:
    total = 0
    for dtype, dims in arrays:
        bits = _BITS.get(dtype) or (8 if dtype.startswith("f8") else int(re.sub(r"\D", "", dtype)))
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total
