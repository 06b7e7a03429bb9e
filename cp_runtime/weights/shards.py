"""The collectives the model needs when its weights are split over a mesh axis
(cp_runtime.weights.sharding), as one object the model's functions take.

`WeightShards()` (no axis) is every device holding every weight, or no mesh at all (the dense
oracle): each method is then the identity, so one model code path serves both modes.

`wire_dtype` "bf16" sends the activations that only feed matmuls and the residual stream across
the interconnect in bf16 (`join`, and `gather(..., wire=True)`): half the bytes of f32, at the
price of rounding the joined partial sums to bf16 (2^-9 relative), as bf16 serving does. What
feeds the page selection, the cache or the sampler (the indexer's inputs, the latent rows, the
lm head's logits, the embedding) always crosses in f32.

`rows_split` splits the residual stream by row as well (a long prefill chunk in the gather_kv
layout, cp_runtime.model.attention): each device keeps R / S of the step's R rows (flattened
[B, Q]; device s the s-th run), the row-parallel sums come back reduce-scattered into those
rows (`join_rows`, `psum_rows`: half an all-reduce's bytes), and what needs every row is
all-gathered (`gather_rows`). The norms and the per-row projections of the whole weights then
run once per row on the slice, not on every device. Attention runs on the rows as well: an
all-to-all trades each device's heads of every row for every head of its rows
(`heads_to_rows`), and another trades them back (`rows_to_heads`); or, `whole_heads`, each
device gathers the attention's head-split weights (`gather_weights`) and projects its own rows
through every head itself, where those weigh less than the rows' heads and sums.

`mlp_rows` "fp8" gathers the MLP's rows, where the rows are split, as e4m3 values with one f32
scale a row (cp_runtime.kernels.fp8_rows; `mlp.mlp_input`) rather than on the wire: the
experts' kernel reads the same fp8 rows.

`expert_groups` g > 1: the routed experts lie in g groups of whole experts, each group's split
by feature over S / g devices (cp_runtime.weights.sharding); `first_expert` says which experts
this device holds (cp_runtime.model.expert_groups): device d is in group d // (S / g), or, with
`groups_strided` (the experts regrouped for a prompt: cp_runtime.weights.regroup), in group
d mod g.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["WeightShards", "WIRE_DTYPES", "MLP_ROWS", "FUSED_GATHER_MAX_ROWS"]

WIRE_DTYPES = ("f32", "bf16")
MLP_ROWS = ("wire", "fp8")

# The most rows `gather_heads` joins into one all-gather (a decode step's batch).
FUSED_GATHER_MAX_ROWS = 64


@dataclasses.dataclass(frozen=True)
class WeightShards:
    """axis: the mesh axis the weights are split over, or None (weights whole on each device)."""

    axis: str | None = None
    wire_dtype: str = "f32"          # "f32" or "bf16": see the module docstring
    rows_split: bool = False         # the residual stream split by row: the module docstring
    whole_heads: bool = False        # split rows attend from the attention weights gathered
    mlp_rows: str = "wire"           # "wire" or "fp8": the MLP's split rows (module docstring)
    expert_groups: int = 1           # the routed experts' groups (module docstring)
    groups_strided: bool = False     # device d is in group d mod expert_groups (regrouped)

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype={self.wire_dtype!r} is not one of {WIRE_DTYPES}")
        if self.mlp_rows not in MLP_ROWS:
            raise ValueError(f"mlp_rows={self.mlp_rows!r} is not one of {MLP_ROWS}")
        if self.rows_split and self.axis is None:
            raise ValueError("rows_split needs an axis to split the rows over")
        if self.whole_heads and not self.rows_split:
            raise ValueError("whole_heads attends each device's own rows: it needs rows_split")
        if self.expert_groups < 1 or (self.expert_groups > 1 and self.axis is None):
            raise ValueError(f"expert_groups={self.expert_groups}: groups of experts need an "
                             "axis to split them over (and at least one group)")

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

    def _scatter_rows(self, x: jax.Array, wire: bool) -> jax.Array:
        """Reduce-scatter f[..., F] (rows flattened) into this device's rows f[R / S, F]."""
        flat = x.reshape(-1, x.shape[-1])

        def reduce_scatter(v):
            return lax.psum_scatter(v, self.axis, scatter_dimension=0, tiled=True)

        return self._on_wire(flat, reduce_scatter) if wire else reduce_scatter(flat)

    def psum_rows(self, x: jax.Array) -> jax.Array:
        """`psum`, into this device's rows where the rows are split."""
        return self._scatter_rows(x, wire=False) if self.rows_split else self.psum(x)

    def join_rows(self, x: jax.Array) -> jax.Array:
        """`join`, into this device's rows where the rows are split."""
        return self._scatter_rows(x, wire=True) if self.rows_split else self.join(x)

    def own_rows(self, x: jax.Array) -> jax.Array:
        """This device's rows x[R / S, ...] of x[B, Q, ...] (every device's alike) where the
        rows are split; else x."""
        if not self.rows_split:
            return x
        flat = x.reshape(-1, *x.shape[2:])
        local = flat.shape[0] // lax.axis_size(self.axis)
        return lax.dynamic_slice_in_dim(flat, self.first(local), local)

    def gather_rows(self, x: jax.Array, rows_shape: tuple[int, ...], *, wire: bool = False
                    ) -> jax.Array:
        """Every device's rows of x f[R / S, ...] as f[*rows_shape, ...] where the rows are
        split (wire: in wire_dtype); else x."""
        if not self.rows_split:
            return x

        def all_gather(v):
            return lax.all_gather(v, self.axis, axis=0, tiled=True)

        every = self._on_wire(x, all_gather) if wire else all_gather(x)
        return every.reshape(*rows_shape, *x.shape[1:])

    def gather_rows_of(self, arrays: dict[str, jax.Array], rows_shape: tuple[int, ...], *,
                       wired: tuple[str, ...] = ()) -> dict[str, jax.Array]:
        """`gather_rows` of each of f[R / S, F_i], in two all-gathers: those named in `wired`
        in wire_dtype, the others (f32, exact) joined along their last axis."""
        if not self.rows_split:
            return arrays
        out = {name: self.gather_rows(arrays[name], rows_shape, wire=True)
               for name in wired if name in arrays}
        exact = [name for name in arrays if name not in wired]
        widths = np.cumsum([arrays[name].shape[-1] for name in exact])[:-1]
        every = self.gather_rows(jnp.concatenate([arrays[name] for name in exact], -1),
                                 rows_shape)
        return out | dict(zip(exact, jnp.split(every, widths, axis=-1)))

    def heads_to_rows(self, x: jax.Array) -> jax.Array:
        """Every row's h heads here, f32[B, Q, h, D] -> this device's rows with every device's
        heads, [R / S, S h, D] in wire_dtype (one all-to-all; kept in bf16 after it, as the
        matmuls that read these heads round them to bf16 anyway)."""
        flat = x.reshape(-1, *x.shape[2:])
        return lax.all_to_all(self._wired(flat), self.axis, split_axis=0, concat_axis=1,
                              tiled=True)

    def rows_to_heads(self, x: jax.Array, rows_shape: tuple[int, ...]) -> jax.Array:
        """`heads_to_rows` reversed: f32[R / S, S h, V] -> [*rows_shape, h, V] in wire_dtype."""
        every = lax.all_to_all(self._wired(x), self.axis, split_axis=1, concat_axis=0,
                               tiled=True)
        return every.reshape(*rows_shape, *every.shape[1:])

    def gather_weights(self, p: dict[str, jax.Array], axes: dict[str, int],
                       scale_suffix: str) -> dict[str, jax.Array]:
        """p with each weight named in `axes` whole: all-gathered along its split axis, as
        held (fp8 values, and their block scales `name + scale_suffix` along the same axis:
        each device's scales cover its own slice, so theirs joined cover the whole)."""
        out = dict(p)
        for name, axis in axes.items():
            for key in (name, name + scale_suffix):
                if key in p:
                    out[key] = lax.all_gather(p[key], self.axis, axis=axis, tiled=True)
        return out

    def _wired(self, x: jax.Array) -> jax.Array:
        """x as it crosses the interconnect: rounded to bf16 where wire_dtype says so."""
        return x.astype(jnp.bfloat16) if self.wire_dtype == "bf16" else x

    def first(self, local: int) -> jax.Array | int:
        """Index of this device's first part when each device holds `local` parts."""
        return 0 if self.axis is None else lax.axis_index(self.axis) * local

    def first_expert(self, local: int) -> jax.Array | int:
        """The model's id of this device's first routed expert when each device holds `local`
        experts: 0 with one group (every device holds a slice of every expert), else its
        group's first (devices in groups of S / expert_groups, in order; regrouped,
        `groups_strided`, device d in group d mod expert_groups)."""
        if self.expert_groups == 1:
            return 0
        if self.groups_strided:
            return lax.axis_index(self.axis) % self.expert_groups * local
        per_group = lax.axis_size(self.axis) // self.expert_groups
        return lax.axis_index(self.axis) // per_group * local

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
