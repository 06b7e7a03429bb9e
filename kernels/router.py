"""A MoE layer's routing in one Pallas TPU kernel: the router matmul, the sigmoid scores, the
group limit and the top k with their weights. Twin of `reference.router`.

Why. A decode step's routing is a few hundred values a token, but XLA:TPU ran it as a dozen
ops (the gate's matvec as a convolution, the bias, a top-k, the weights' gather and
normalisation, a select or two), each priced at about a microsecond in the compiler's figures:
~14 us in each of GLM-5.2's 75 MoE layers against ~1 us of work (the gate's 3 MB read). Here
it is one call with everything in VMEM.

Numerics are `reference.router`'s: the logits of the bf16 matmul (f32 sums) rounded to bf16,
sigmoid scores in f32. The top k is taken k times over the experts' lanes: the largest value,
and of its equals the lowest expert (`lax.top_k`'s order), is recorded and set to -inf. The
group limit scores each group by its best and second best (the best removed once, so a tie
counts twice, as `top_k(., 2)` does) and keeps topk_group groups the same way. The choices
come out in ascending expert order, the order the experts' grouped matmul visits them in (a
B = 1 step's rows then need no sort).

Blocks: x [T, hidden] f32, gate bf16[E, hidden], bias f32[1, E], all whole in VMEM (a grid
of one step); outputs chosen i32[T, k] and weights f32[T, k].
Per call:
    flops = 2 T hidden E;  transcendentals = T E
    bytes = T hidden 4 + E hidden 2 + E 4 + T k 8
VMEM: twice each block (`cost`, tile-padded).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from cp_runtime.kernels.costs import call_options
from cp_runtime.kernels.vmem import VMEM_BUDGET_BYTES, tiled_bytes

__all__ = ["route", "cost", "supports"]


def cost(num_rows: int, gate_shape: tuple[int, int], k: int) -> dict:
    """HBM bytes, flops, transcendentals and VMEM bytes of one call (module docstring)."""
    e, hidden = gate_shape
    vmem = 2 * (tiled_bytes((num_rows, hidden), 4) + tiled_bytes(gate_shape, 2)
                + tiled_bytes((1, e), 4) + 2 * tiled_bytes((num_rows, k), 4))
    return {"flops": 2 * num_rows * hidden * e, "transcendentals": num_rows * e,
            "bytes": num_rows * hidden * 4 + e * hidden * 2 + e * 4 + num_rows * k * 8,
            "vmem_bytes": vmem}


def supports(num_rows: int, gate_shape: tuple[int, int], gate_dtype, k: int) -> bool:
    """Whether the kernel takes a step of `num_rows` rows: a bf16 gate, and every block in
    VMEM at once."""
    return (gate_dtype == jnp.bfloat16
            and cost(num_rows, gate_shape, k)["vmem_bytes"] <= VMEM_BUDGET_BYTES)


def _first_largest(values: jax.Array, lane: jax.Array) -> jax.Array:
    """The lane of each row's largest value, the lowest of equals: i32[T, 1]."""
    top = jnp.max(values, axis=-1, keepdims=True)
    return jnp.min(jnp.where(values == top, lane, values.shape[-1]), axis=-1, keepdims=True)


def _limit_groups(biased: jax.Array, lane: jax.Array, n_group: int,
                  topk_group: int) -> jax.Array:
    """`reference._limit_groups` on lanes: biased f32[T, E], groups of E / n_group lanes."""
    size = biased.shape[-1] // n_group
    group = lane // size
    score = jnp.zeros_like(biased)               # each lane holds its group's score
    for g in range(n_group):
        inside = jnp.where(group == g, biased, -jnp.inf)
        best = jnp.max(inside, axis=-1, keepdims=True)
        if size > 1:
            second = jnp.where(lane == _first_largest(inside, lane), -jnp.inf, inside)
            best = best + jnp.max(second, axis=-1, keepdims=True)
        score = jnp.where(group == g, best, score)
    kept = jnp.zeros(biased.shape, jnp.bool_)
    for _ in range(topk_group):                  # the lowest lane of a group's best: its group
        chosen = _first_largest(score, lane) // size
        kept = kept | (group == chosen)
        score = jnp.where(group == chosen, -jnp.inf, score)
    return jnp.where(kept, biased, -jnp.inf)


def _kernel(x_ref,          # [T, hidden] f32
            gate_ref,       # [E, hidden] bf16
            bias_ref,       # [1, E] f32
            chosen_ref,     # [T, k] i32
            weights_ref,    # [T, k] f32
            *, n_group: int, topk_group: int, norm: bool, scale: float):
    logits = jax.lax.dot_general(x_ref[...].astype(jnp.bfloat16), gate_ref[...],
                                 (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    scores = jax.nn.sigmoid(logits.astype(jnp.bfloat16).astype(jnp.float32))     # [T, E]
    lane = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    biased = scores + bias_ref[...]
    if n_group > 1:
        biased = _limit_groups(biased, lane, n_group, topk_group)
    k = chosen_ref.shape[-1]
    slot = jax.lax.broadcasted_iota(jnp.int32, chosen_ref.shape, 1)
    chosen = jnp.zeros(chosen_ref.shape, jnp.int32)
    weights = jnp.zeros(weights_ref.shape, jnp.float32)
    for j in range(k):
        expert = _first_largest(biased, lane)                                      # [T, 1]
        hit = lane == expert
        chosen = jnp.where(slot == j, expert, chosen)
        weights = jnp.where(slot == j, jnp.sum(jnp.where(hit, scores, 0.0), axis=-1,
                                                     keepdims=True), weights)
        biased = jnp.where(hit, -jnp.inf, biased)
    if norm:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    chosen, weights = _by_expert(chosen, weights * scale, slot)
    chosen_ref[...] = chosen
    weights_ref[...] = weights


def _by_expert(chosen: jax.Array, weights: jax.Array, slot: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """chosen i32[T, k] (distinct in a row) and their weights, each row in ascending expert
    order."""
    left, ordered, ordered_weights = chosen, chosen, weights
    for j in range(chosen.shape[-1]):
        low = jnp.min(left, axis=-1, keepdims=True)                                # [T, 1]
        at = left == low
        picked = jnp.sum(jnp.where(at, weights, 0.0), axis=-1, keepdims=True)
        ordered = jnp.where(slot == j, low, ordered)
        ordered_weights = jnp.where(slot == j, picked, ordered_weights)
        left = jnp.where(at, jnp.iinfo(jnp.int32).max, left)
    return ordered, ordered_weights


@functools.partial(jax.jit, static_argnames=("k", "n_group", "topk_group", "norm", "scale",
                                             "interpret"))
def route(x: jax.Array, gate: jax.Array, bias: jax.Array, *, k: int, n_group: int,
          topk_group: int, norm: bool, scale: float, interpret: bool = False
          ) -> tuple[jax.Array, jax.Array]:
    """Pallas twin of `reference.router`.

    x:       f[T, hidden]
    gate:    bf16[E, hidden]
    bias:    f32[E]
    returns: (chosen i32[T, k], weights f32[T, k]), each token's in ascending expert order
    """
    t, hidden = x.shape
    e = gate.shape[0]
    if gate.shape[1] != hidden or bias.shape != (e,) or e % n_group or k > e:
        raise ValueError(f"input {x.shape}, gate {gate.shape}, bias {bias.shape}, k={k} and "
                         f"n_group={n_group} do not fit together")
    whole = lambda i: (0, 0)  # noqa: E731 (every block is its whole array)
    return pl.pallas_call(
        functools.partial(_kernel, n_group=n_group, topk_group=topk_group, norm=norm,
                          scale=scale),
        grid=(1,),
        in_specs=[pl.BlockSpec((t, hidden), whole), pl.BlockSpec((e, hidden), whole),
                  pl.BlockSpec((1, e), whole)],
        out_specs=[pl.BlockSpec((t, k), whole), pl.BlockSpec((t, k), whole)],
        out_shape=[jax.ShapeDtypeStruct((t, k), jnp.int32),
                   jax.ShapeDtypeStruct((t, k), jnp.float32)],
        **call_options("route", cost(t, gate.shape, k), ("arbitrary",), interpret),
    )(x.astype(jnp.float32), gate, bias.astype(jnp.float32).reshape(1, e))
