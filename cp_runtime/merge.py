"""Exact merge of per-shard attention partials (o_r, lse_r) over the `cp` axis.

    lse = logsumexp_r lse_r;     o = sum_r exp(lse_r - lse) * o_r

in the latent space (before W_uv). A shard that saw no key gives o_r = 0, lse_r = -inf and
contributes nothing; a query no shard saw gets o = 0, lse = -inf (no NaN).

Two collective variants; `cp-runtime bench merge` times them in one run:
  gather_psum:  all-gather the lse (small), rescale locally, psum the outputs. The default:
                2.7x faster than all_to_all for decode (B=8, H=64, Dv=512) and 3.3x for a
                prefill block (Q=256, H=16), S = 16 virtual CPU devices on 2 cores.
  all_to_all:   pack [o | lse] and all-to-all over the token axis so each shard merges 1/S of the
                tokens, then all-gather the merged rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["merge_stacked", "merge_gather_psum", "merge_all_to_all", "MERGES"]


def _weights(lse_all: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Per-shard weights exp(lse_r - lse) and the merged lse; safe when all are -inf."""
    m = jnp.max(lse_all, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(lse_all - m)
    total = e.sum(axis=axis, keepdims=True)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + m, -jnp.inf)
    return e / jnp.where(total > 0, total, 1.0), jnp.squeeze(lse, axis)


def merge_stacked(o_all: jax.Array, lse_all: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge partials stacked on axis 0: o f32[S, ..., Dv], lse f32[S, ...] -> (o, lse)."""
    w, lse = _weights(lse_all, 0)
    return (w[..., None] * o_all).sum(0), lse


def merge_gather_psum(o: jax.Array, lse: jax.Array, axis_name: str
                      ) -> tuple[jax.Array, jax.Array]:
    """o f32[..., Dv], lse f32[...] of this shard -> merged (o, lse), replicated over the axis."""
    lse_all = lax.all_gather(lse, axis_name)                 # [S, ...]
    w, merged_lse = _weights(lse_all, 0)
    mine = w[lax.axis_index(axis_name)]
    return lax.psum(mine[..., None] * o, axis_name), merged_lse


def merge_all_to_all(o: jax.Array, lse: jax.Array, axis_name: str
                     ) -> tuple[jax.Array, jax.Array]:
    """Same result as `merge_gather_psum`, with one packed all-to-all and one all-gather."""
    num_shards = lax.axis_size(axis_name)
    lead, dv = o.shape[:-1], o.shape[-1]
    r = lse.size
    pad = -r % num_shards  # padding rows: o = 0, lse = -inf, so they merge to nothing
    rows = jnp.pad(o.reshape(r, dv), ((0, pad), (0, 0)))                   # [R', Dv]
    row_lse = jnp.pad(lse.reshape(r, 1), ((0, pad), (0, 0)), constant_values=-jnp.inf)
    packed = jnp.concatenate([rows, row_lse], axis=-1)                      # [R', Dv + 1]
    # [R', Dv+1] -> [S, R'/S, Dv+1]; after the all-to-all, axis 0 indexes the source shard.
    packed = packed.reshape(num_shards, -1, dv + 1)
    recv = lax.all_to_all(packed, axis_name, split_axis=0, concat_axis=0, tiled=True)
    o_mine, lse_mine = merge_stacked(recv[..., :dv], recv[..., dv])        # [R'/S, Dv], [R'/S]
    part = jnp.concatenate([o_mine, lse_mine[:, None]], axis=-1)
    full = lax.all_gather(part, axis_name, tiled=True)[:r]                  # [R, Dv + 1]
    return full[:, :dv].reshape(*lead, dv), full[:, dv].reshape(lead)


MERGES = {"gather_psum": merge_gather_psum, "all_to_all": merge_all_to_all}
