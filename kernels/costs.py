"""The compiler's view of a kernel's cost: every `pallas_call` passes `cost_estimate(cost(...))`.

XLA cannot see inside a Mosaic kernel, so without an estimate its cost analysis of a step counts
a kernel as nothing and its time estimate leaves the kernels out. Each kernel's `cost()` already
gives the HBM bytes and flops of one call (upper bounds where the work is data-dependent); this
turns them into the `pl.CostEstimate` Pallas attaches to the custom call.
"""

from __future__ import annotations

from jax.experimental import pallas as pl

__all__ = ["cost_estimate"]


def cost_estimate(figures: dict) -> pl.CostEstimate:
    """pl.CostEstimate from a kernel's cost() dict (`flops`, `bytes`, optional
    `transcendentals`)."""
    return pl.CostEstimate(flops=int(figures["flops"]),
                           transcendentals=int(figures.get("transcendentals", 0)),
                           bytes_accessed=int(figures["bytes"]))
