"""One device's routed experts when the experts lie in groups (runtime field `expert_groups`):
the (token, expert) pairs of its group's experts, run in passes of a fixed number of rows.

Layout (cp_runtime.weights.sharding): g groups of E / g whole experts, each group's experts split
by inner feature over its S / g devices. Every device has every token's rows (as with one
group), runs only the pairs whose expert is its group's, and the S partial sums are joined as
before: a token's sum takes each of its experts' features from that expert's group.

Why: in one group every device runs all T k pairs of a chunk through 1/S of each expert's
features; in g groups, about T k / g pairs through g/S of each. The flops are the same, the
rows each device gathers and reads g times fewer (docs/notes/2026-12-07-expert-groups.md
measures it). A decode step pays
instead: its few pairs may all fall in one group, whose devices then read g times the
features of each.

Passes. The shapes are static and how many pairs a group gets is not: a pass takes
`rows_per_pass` of the group's pairs (sorted by expert), an even share with 25% to spare for a
prefill chunk, every pair for a step of few. The first pass always runs; a while loop runs
more only while pairs remain, so the sum is exact whatever the routing (a group every token
chose takes T k / rows_per_pass passes). The TPU compiler's cost figures count the first pass
(the loop's body is not priced: it runs only when routing is that uneven).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.kernels import expert_matmul

__all__ = ["CAPACITY_FACTOR", "PASS_ROW_TILE", "RunFn", "rows_per_pass", "routed_in_group"]

# A pass's rows: this times the group's even share of the pairs (T k / g), in whole tiles of
# PASS_ROW_TILE rows (the expert kernel's largest row tile), at most all T k.
CAPACITY_FACTOR = 1.25
PASS_ROW_TILE = expert_matmul.ROW_TILE

# run(token i32[C], routing f32[C, 1], sizes i32[E_g], beside) -> (y f[C, hidden], beside):
# rows of tokens `token`, sorted by expert (`sizes` rows each of the device's E_g experts,
# the rows past them zero), through their experts, each row's output times its routing weight.
RunFn = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def rows_per_pass(pairs: int, groups: int, factor: float = CAPACITY_FACTOR) -> int:
    """Rows of one pass of a device whose group expects pairs / groups of `pairs` pairs:
    `factor` times that, in whole tiles, at most `pairs`."""
    share = factor * pairs / groups
    return min(pairs, math.ceil(share / PASS_ROW_TILE) * PASS_ROW_TILE)


def _group_first(local: jax.Array, key: jax.Array, presorted: bool) -> jax.Array:
    """The pairs' order with the group's first, by expert, and the others after them. One
    token's choices in ascending order (`presorted`) hold the group's as one run: rotated to
    the front, with no sort (XLA:TPU runs a sort as ops of its own, a MoE layer each)."""
    if presorted:
        below = jnp.sum(local < 0)
        return (jnp.arange(local.shape[0]) + below) % local.shape[0]
    return jnp.argsort(key, stable=True)


def routed_in_group(chosen: jax.Array, weights: jax.Array, first: jax.Array | int,
                    num_experts: int, run: RunFn, out: jax.Array, beside: Any = (),
                    capacity: int | None = None, presorted: bool = False
                    ) -> tuple[jax.Array, Any]:
    """chosen i32[T, k] (the model's expert ids), weights f32[T, k]; this device holds experts
    first .. first + num_experts. Adds into out f[T, hidden] each token's outputs from those
    of its experts (`run`) -> (out, beside), beside tied to the first pass's rows (as `run`
    ties it). capacity: rows a pass (`rows_per_pass`); None, every pair in one pass.
    presorted: T = 1 and its choices in ascending expert order."""
    t, k = chosen.shape
    local = chosen.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < num_experts), local, num_experts)  # others last
    order = _group_first(local, key, presorted and t == 1)
    counts = jnp.zeros((num_experts,), jnp.int32).at[key].add(1, mode="drop")
    ends = jnp.cumsum(counts)
    starts, total = ends - counts, ends[-1]
    c = t * k if capacity is None else capacity
    padded = jnp.pad(order, (0, c))                    # a pass may read past the last pair
    flat_weights = weights.reshape(-1)

    def one_pass(lo, out, beside):
        pair = lax.dynamic_slice_in_dim(padded, lo, c)
        sizes = jnp.maximum(jnp.minimum(ends, lo + c) - jnp.maximum(starts, lo), 0)
        live = lo + jnp.arange(c) < total
        token = pair // k
        routing = jnp.where(live, flat_weights[pair], 0)[:, None]
        y, beside = run(token, routing, sizes, beside)
        # A pass's rows past the group's pairs add nowhere (index T is dropped).
        return out.at[jnp.where(live, token, t)].add(y.astype(out.dtype), mode="drop"), beside

    out, beside = one_pass(0, out, beside)
    if c < t * k:
        def more(carry):
            return carry[0] < total

        def next_pass(carry):
            lo, acc = carry
            return lo + c, one_pass(lo, acc, ())[0]

        out = lax.while_loop(more, next_pass, (jnp.int32(c), out))[1]
    return out, beside
