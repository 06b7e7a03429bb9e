"""The collectives the model needs when its weights are split over a mesh axis
(cp_runtime.weights.layout), as one object the model's functions take.

`WeightShards()` (no axis) is every device holding every weight, or no mesh at all (the dense
oracle): each method is then the identity, so one model code path serves both modes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["WeightShards"]


@dataclasses.dataclass(frozen=True)
class WeightShards:
    """axis: the mesh axis the weights are split over, or None (weights whole on each device)."""

    axis: str | None = None

    @property
    def split(self) -> bool:
        return self.axis is not None

    def gather(self, x: jax.Array, axis: int, size: int) -> jax.Array:
        """This device's part of a split axis of x -> the whole axis, its padding cut to `size`."""
        if self.axis is None:
            return x
        axis %= x.ndim
        full = lax.all_gather(x, self.axis, axis=axis, tiled=True)
        return lax.slice_in_dim(full, 0, size, axis=axis)

    def psum(self, x: jax.Array) -> jax.Array:
        """Sum the devices' partial results (row-parallel matmuls, expert outputs)."""
        return x if self.axis is None else lax.psum(x, self.axis)

    def first(self, local: int) -> jax.Array | int:
        """Index of this device's first part when each device holds `local` parts."""
        return 0 if self.axis is None else lax.axis_index(self.axis) * local

    def own(self, x: jax.Array, axis: int, local: int) -> jax.Array:
        """This device's `local` parts of an axis every device holds whole (zero-padded to a
        multiple of the device count first, as the weights are)."""
        if self.axis is None:
            return x
        axis %= x.ndim
        total = local * lax.axis_size(self.axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, total - x.shape[axis])
        return lax.dynamic_slice_in_dim(jnp.pad(x, pad), self.first(local), local, axis=axis)
