"""The compiler's view of a kernel's cost: every `pallas_call` passes `cost_estimate(cost(...))`,
through `call_options`, with the VMEM limit taken from the same figures.

XLA cannot see inside a Mosaic kernel, so without an estimate its cost analysis of a step counts
a kernel as nothing and its time estimate leaves the kernels out. Each kernel's `cost()` already
gives the HBM bytes and flops of one call (upper bounds where the work is data-dependent); this
turns them into the `pl.CostEstimate` Pallas attaches to the custom call.
"""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cp_runtime.kernels.packing import interpret_params
from cp_runtime.kernels.vmem import vmem_limit_bytes

__all__ = ["call_options", "cost_estimate", "FP8_MXU_SUFFIX", "VPU_SUFFIX"]

# A kernel whose matmuls multiply fp8 by fp8 carries this at the end of its name: its estimate's
# flops run at the MXU's fp8 rate, which the compiler's figures read from the name
# (cp_runtime.aot.hlo, `Instruction.fp8_mxu`).
FP8_MXU_SUFFIX = "_fp8"
# A kernel whose work is the vector unit's, not the MXU's (kernels/page_top_k.py), carries this
# instead: its estimate's flops count VPU element operations, priced at the VPU's rate
# (cp_runtime.aot.roofline, `DeviceRates.vpu_ops`), not the MXU's.
VPU_SUFFIX = "_vpu"


def cost_estimate(figures: dict) -> pl.CostEstimate:
    """pl.CostEstimate from a kernel's cost() dict (`flops`, `bytes`, optional
    `transcendentals`; `vpu`: the flops are VPU operations, VPU_SUFFIX)."""
    return pl.CostEstimate(flops=int(figures["flops"]),
                           transcendentals=int(figures.get("transcendentals", 0)),
                           bytes_accessed=int(figures["bytes"]))


def call_options(name: str, figures: dict, semantics: tuple[str, ...], interpret, *,
                 fp8_mxu: bool = False) -> dict:
    """The keywords every kernel's `pallas_call` takes: the grid's dimension semantics and a
    VMEM limit from its cost() figures (`vmem_bytes`), their cost estimate, interpret mode
    (packing.interpret_params) and the kernel's name (with FP8_MXU_SUFFIX where `fp8_mxu`:
    its flops are fp8 x fp8 products; with VPU_SUFFIX where the figures say `vpu`: they are
    VPU operations)."""
    return dict(compiler_params=pltpu.CompilerParams(
                    dimension_semantics=semantics,
                    vmem_limit_bytes=vmem_limit_bytes(figures["vmem_bytes"])),
                cost_estimate=cost_estimate(figures), interpret=interpret_params(interpret),
                name=name + (FP8_MXU_SUFFIX if fp8_mxu else "")
                + (VPU_SUFFIX if figures.get("vpu") else ""))
