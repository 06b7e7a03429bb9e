"""A MoE layer's routed experts, given each token's choices: the (token, expert) pairs grouped
by expert through grouped matmuls, or every expert on every token from its fp8 blocks.

A MoE layer's experts are stacked (cp_runtime.weights.sharding): gate and up [E, hidden, inner],
down [E, inner, hidden]. Split weights hold a slice of every expert's inner features (gate and
up column parallel, down row parallel), so each device's sum is a partial one; in expert groups
a device holds its group's experts (cp_runtime.model.expert_groups). Which of these paths a
step takes is kernels/dispatch.py's choice (`ModelKernels.routed_experts`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from cp_runtime.kernels.fp8_rows import Fp8Rows
from cp_runtime.model import expert_groups
from cp_runtime.model.ops import weight
from cp_runtime.weights.format import SCALE_SUFFIX
from cp_runtime.weights.params import Params
from cp_runtime.weights.shards import WeightShards

__all__ = ["EXPERTS", "ExpertMatmulFn", "pairs_by_expert", "expert_rows", "every_expert"]

# A MoE layer's routed experts, stacked (cp_runtime.weights.sharding), by projection.
EXPERTS = "mlp.experts.{}_proj.weight"

# expert_matmul(rows f[N, in], w f8[E, in, out], scales f32[E, in/ga, out/gb], group_sizes
# i32[E], *, up=None, out_dtype=f32, row_scales=None, row_weights=None) -> out_dtype[N, out]:
# rows sorted by expert through their expert's block-scaled weights, read as fp8
# (cp_runtime.kernels.expert_matmul); with up=(w_up, scales_up), silu(rows . w) * (rows . w_up)
# from one pass over the rows; each row's result times its row weight. None: the XLA paths
# below.
ExpertMatmulFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _ragged(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """Rows x[N, in] in groups of `sizes` through the stack w[E, in, out] -> f32[N, out] (in
    W's dtype, widened, as `ops.matmul`)."""
    return jax.lax.ragged_dot(x.astype(w.dtype), w, sizes).astype(jnp.float32)


def pairs_by_expert(p: Params, x: jax.Array, chosen: jax.Array, weights: jax.Array,
                    expert_matmul: ExpertMatmulFn | None = None, by_expert: bool = False,
                    fp8: Fp8Rows | None = None, beside: Any = (),
                    ws: WeightShards = WeightShards()) -> tuple[jax.Array, Any]:
    """x f[T, hidden], chosen i32[T, k], weights f32[T, k] -> f[T, hidden] (bf16 through
    `expert_matmul`, else x's dtype): each token through its k experts, weighted. Split
    weights hold a slice of every expert's inner features, so this is the device's partial
    sum; the others add theirs.

    The T*k (token, expert) pairs are sorted by expert and grouped matmuls run each group
    through its expert: `expert_matmul` straight from the fp8 blocks (gate and up in one
    call, which reads the rows once), or `jax.lax.ragged_dot` over the weights in their dtype
    (bf16 dequantised, when block-scaled). The kernel's rows are gathered in bf16, its input
    dtype: the [T*k, hidden] arrays are the layer's largest (k rows a token). The down
    projection's outputs leave the kernel in bf16 and the scatter-add sums them in bf16, as
    vLLM's fused MoE keeps its per-expert outputs and their sum: f32 outputs were a
    [T*k, hidden] array written and read again every MoE layer, and bf16 outputs summed in
    f32 cost XLA:TPU a conversion pass of its own (docs/notes/2026-12-03-experts.md,
    "The experts' down products in bf16"). The sum stays bf16 until `mlp.mlp` adds the shared
    experts' f32 output. (Gathered back to token order and summed in f32 instead, XLA fused
    the gather into the sum, slower.) The routing weights scale the down projection's inputs
    ([T*k, inner]) rather than its outputs (XLA:TPU wrote and read those again in f32 for the
    product): the gated call multiplies each row's product by its weight and writes it in
    bf16, the down projection's input dtype (a pass of XLA's own before), and a
    scatter-add sums each token's k rows (a gather back to token order instead ran 2x
    slower in XLA:TPU's estimate). `by_expert`: each token's choices come in ascending
    expert order, so one token's are sorted already (XLA ran the sort as four ops). `fp8`:
    x's rows as `fp8_rows` (f8[T, hidden], f32[T, 1]), which the kernel's rows are gathered
    from instead, at half the bytes. Returns (the sum, beside), beside tied to the gated
    products (`mlp.routed_experts`). In expert groups (`ws.expert_groups`) the device runs
    only its group's pairs (cp_runtime.model.expert_groups)."""
    n_experts = p[EXPERTS.format("gate")].shape[0]
    run = expert_rows(p, x, expert_matmul, fp8)
    out = jnp.zeros(x.shape, x.dtype if expert_matmul is None else jnp.bfloat16)
    presorted = by_expert and chosen.shape[0] == 1
    if ws.expert_groups > 1:
        capacity = expert_groups.rows_per_pass(chosen.size, ws.expert_groups)
        return expert_groups.routed_in_group(chosen, weights, ws.first_expert(n_experts),
                                             n_experts, run, out, beside, capacity, presorted)
    flat = chosen.reshape(-1)                                    # [T*k]
    order = jnp.arange(flat.shape[0]) if presorted else jnp.argsort(flat, stable=True)
    token = order // chosen.shape[-1]                            # source token of each row
    sizes = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    y, beside = run(token, weights.reshape(-1)[order, None], sizes, beside)
    return out.at[token].add(y), beside


def expert_rows(p: Params, x: jax.Array, expert_matmul: ExpertMatmulFn | None,
                fp8: Fp8Rows | None) -> expert_groups.RunFn:
    """run(token i32[N], routing f32[N, 1], sizes i32[E], beside) -> (y [N, hidden], beside):
    rows x[token] (or fp8's), sorted by expert, through their experts' SwiGLU
    (`pairs_by_expert`), each row's down-projection input times its routing weight; beside
    tied to the gated products."""
    gate, up, down = (EXPERTS.format(proj) for proj in ("gate", "up", "down"))
    if expert_matmul is None:
        def xla(token, routing, sizes, beside):
            rows = x[token]                                      # [N, hidden]
            h = jax.nn.silu(_ragged(rows, weight(p, gate), sizes)) * _ragged(
                rows, weight(p, up), sizes)                      # [N, inner] f32
            h, beside = _tied(h, beside)
            return _ragged(h * routing, weight(p, down), sizes), beside  # down is linear
        return xla

    def blocks(key: str) -> tuple[jax.Array, jax.Array]:
        return p[key], p[key + SCALE_SUFFIX]

    def kernel(token, routing, sizes, beside):
        gated = functools.partial(expert_matmul, up=blocks(up), row_weights=routing,
                                  out_dtype=jnp.bfloat16)              # gate and up at once
        if fp8 is None:
            h = gated(x.astype(jnp.bfloat16)[token], *blocks(gate), sizes)
        else:
            h = gated(fp8.values[token], *blocks(gate), sizes, row_scales=fp8.scales[token])
        h, beside = _tied(h, beside)
        return expert_matmul(h, *blocks(down), sizes, out_dtype=jnp.bfloat16), beside
    return kernel


def _tied(h: jax.Array, beside: Any) -> tuple[jax.Array, Any]:
    """(h, beside) through one `lax.optimization_barrier`; as they are where beside holds no
    array (no barrier then between the gated products and the down projection)."""
    if not jax.tree_util.tree_leaves(beside):
        return h, beside
    return jax.lax.optimization_barrier((h, beside))


def _experts_from_blocks(x: jax.Array, w: jax.Array, s: jax.Array) -> jax.Array:
    """x f[T, in] (one input for every expert) or f[T, E, in] (one each), through every expert
    of w f8[E, in, out] with block scales s f32[E, in / gi, out / go] -> f32[T, E, out].

    Per input block k: x_k . w_k as a bf16 matmul (fp8 values are exact in bf16, and XLA reads
    the fp8 blocks straight into it; its result rounded to bf16, as `ops.matmul`'s), times its
    block's scale in f32, summed over the blocks:
    y[t, e, o] = sum_k s[e, k, o / go] sum_c x[t, k, c] w[e, k, c, o]."""
    e, a, b = w.shape
    gi, go = a // s.shape[-2], b // s.shape[-1]
    xb = x.astype(jnp.bfloat16).reshape(*x.shape[:-1], a // gi, gi)     # [T, (E,) K, gi]
    wb = w.reshape(e, a // gi, gi, b).astype(jnp.bfloat16)              # [E, K, gi, out]
    spec = "tkc,ekco->teko" if x.ndim == 2 else "tekc,ekco->teko"
    part = jnp.einsum(spec, xb, wb).astype(jnp.float32)                 # [T, E, K, out]
    part = part.reshape(*part.shape[:3], b // go, go) * s[None, :, :, :, None]
    return part.sum(2).reshape(x.shape[0], e, b)


def every_expert(p: Params, x: jax.Array, chosen: jax.Array, weights: jax.Array,
                 first: jax.Array | int = 0) -> jax.Array:
    """`pairs_by_expert`'s result for block-scaled experts and few tokens: every expert on
    every token from its fp8 blocks, each expert's weights read once, as fp8; each token's
    outputs weighted by its routing weight for that expert (zero where the token did not
    choose it, or where the expert is not one of the device's, first .. first + E)."""
    n_experts = p[EXPERTS.format("gate")].shape[0]
    gate = (jax.nn.one_hot(chosen - first, n_experts, dtype=weights.dtype)
            * weights[..., None]).sum(-2)                               # [T, E]

    def through(proj: str, h: jax.Array) -> jax.Array:
        key = EXPERTS.format(proj)
        return _experts_from_blocks(h, p[key], p[key + SCALE_SUFFIX])

    h = jax.nn.silu(through("gate", x)) * through("up", x)              # [T, E, inner]
    return (through("down", h) * gate[..., None]).sum(1)                # [T, hidden]
