"""The collectives the model needs when its weights are split over a mesh axis
(cp_runtime.weights.layout), as one object the model's functions take.

`WeightShards()` (no axis) is every device holding every weight, or no mesh at all (the dense
oracle): each method is then the identity, so one model code path serves both modes.

`wire_dtype` "bf16" sends the activations that only feed matmuls and the residual stream across
the interconnect in bf16 (`join`, and `gather(..., wire=True)`): half the bytes of f32, at the
price of rounding the joined partial sums to bf16 (2^-9 relative), as bf16 serving does. What
feeds the page selection, the cache or the sampler (the indexer's inputs, the latent rows, the
lm head's logits, the embedding) always crosses in f32.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["WeightShards", "WIRE_DTYPES", "FUSED_GATHER_MAX_ROWS"]

WIRE_DTYPES = ("f32", "bf16")

# The most rows `gather_heads` joins into one all-gather (a decode step's batch).
FUSED_GATHER_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class WeightShards:
    """axis: the mesh axis the weights are split over, or None (weights whole on each device)."""

    axis: str | None = None
    wire_dtype: str = "f32"          # "f32" or "bf16": see the module docstring

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype={self.wire_dtype!r} is not one of {WIRE_DTYPES}")

    @property
    def split(self) -> bool:
        return self.axis is not None

    def _on_wire(self, x: jax.Array, collective) -> jax.Array:
        """collective(x), in bf16 on the wire when wire_dtype says so (f32 x, f32 result)."""
        if self.wire_dtype == "bf16" and x.dtype == jnp.float32:
            return collective(x.astype(jnp.bfloat16)).astype(jnp.float32)
        return collective(x)

    def gather(self, x: jax.Array, axis: int, size: int, *, wire: bool = False) -> jax.Array:
        """This device's part of a split axis of x -> the whole axis, its padding cut to `size`;
        wire: in wire_dtype (activations that only feed matmuls)."""
        if self.axis is None:
            return x
        axis %= x.ndim

        def all_gather(v):
            return lax.all_gather(v, self.axis, axis=axis, tiled=True)

        full = self._on_wire(x, all_gather) if wire else all_gather(x)
        return lax.slice_in_dim(full, 0, size, axis=axis)

    def gather_heads(self, wired: jax.Array, wired_heads: int, exact: jax.Array,
                     exact_heads: int) -> tuple[jax.Array, jax.Array]:
        """`gather(wired, -2, wired_heads, wire=True)` and `gather(exact, -2, exact_heads)`
        of wired f32[..., h, D] and exact f32[..., g, E] (this device's heads of each): a
        decode step's q heads and its indexer's q heads. With at most FUSED_GATHER_MAX_ROWS
        rows, one all-gather of both in f32 (wired then unrounded: its bytes are a few KB,
        and one collective's latency weighs more than them and than the passes a bf16 wire
        would take to carry exact's f32 bits whole); with more, one gather each."""
        if self.axis is None:
            return wired, exact
        lead = wired.shape[:-2]
        if math.prod(lead) > FUSED_GATHER_MAX_ROWS:
            return (self.gather(wired, -2, wired_heads, wire=True),
                    self.gather(exact, -2, exact_heads))
        joined = jnp.concatenate([wired.reshape(*lead, -1), exact.reshape(*lead, -1)], -1)
        every = lax.all_gather(joined, self.axis, axis=joined.ndim - 1)   # [..., S, width]
        split = wired.shape[-2] * wired.shape[-1]
        heads = every[..., :split].reshape(*lead, -1, wired.shape[-1])
        rest = every[..., split:].reshape(*lead, -1, exact.shape[-1])
        return heads[..., :wired_heads, :], rest[..., :exact_heads, :]

    def psum(self, x: jax.Array) -> jax.Array:
        """Sum the devices' partial results exactly as computed (f32 stays f32)."""
        return x if self.axis is None else lax.psum(x, self.axis)

    def join(self, x: jax.Array) -> jax.Array:
        """Sum the devices' partial outputs of a row-parallel matmul or of their experts, in
        wire_dtype on the wire."""
        if self.axis is None:
            return x
        return self._on_wire(x, lambda v: lax.psum(v, self.axis))

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
