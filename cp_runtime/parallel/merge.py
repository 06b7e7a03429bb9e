"""Exact merge of per-shard attention partials (o_r, lse_r) over the `cp` axis.

    lse = logsumexp_r lse_r;     o = sum_r exp(lse_r - lse) * o_r

in the latent space (before W_uv). A shard that saw no key gives o_r = 0, lse_r = -inf and
contributes nothing; a query no shard saw gets o = 0, lse = -inf (no NaN).

The merged output then goes through W_uv and o_proj (`project`,
cp_runtime.model.mla.mla_output).
`combine` chooses where the shards' partials meet, by runtime field `merge`:
  gather_psum:   all-gather the lse (small), rescale locally, psum the latent outputs; every
                 shard then holds every head merged.
  all_to_all:    pack [o | lse] and all-to-all over the token axis so each shard merges 1/S of
                 the tokens, then all-gather the merged rows (every head everywhere too).
  head_scatter:  (weights sharded) all-gather the lse, rescale, then reduce-scatter over heads:
                 each shard gets only its own heads merged, projects them through its W_uv and
                 o_proj columns, and a psum in hidden space joins the heads.
  head_exchange: (weights sharded) as head_scatter, but one all-to-all over heads carries each
                 shard's packed [o | lse] of a head block, in f32, to that block's shard, which
                 merges them (with W_uv, in one kernel on a TPU: kernels/latent_heads.py): one
                 collective before the psum, not two.
  hidden_psum:   (weights replicated) rescale, project each shard's partial through W_uv and
                 o_proj, and psum in hidden space: the partial output is linear in o_r.
  all_gather:    all-gather the packed partials [o | lse] and merge on every shard: one
                 collective (then a hidden-space psum if the weights are split), the most bytes.
                 The gather runs as runtime field `gathers` says: flat, staged (groups of
                 shards gather and merge, then the groups' merges meet) or, on CPU with every
                 shard in one process, the in-process gather (cp_runtime.parallel.collectives).
  auto:          all_gather while a shard's packed partials are at most GATHER_MAX_BYTES (a
                 decode step: a collective's latency costs more than its bytes), else
                 head_exchange with sharded weights (head_scatter past EXCHANGE_MAX_BYTES
                 when the wire is bf16) and hidden_psum with replicated ones.
`cp-runtime bench merge` measures the bytes each moves per token and times them in one run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.parallel.collectives import gather_reduce

__all__ = ["merge_stacked", "merge_gather_psum", "merge_all_to_all", "merge_all_gather",
           "merge_to_own_heads", "exchange_heads", "merge_received",
           "merge_by_head_exchange", "MERGES", "GATHER_MAX_BYTES", "EXCHANGE_MAX_BYTES", "combine",
           "resolve_merge"]

# Largest packed partial [o | lse] per shard that `auto` all-gathers: small enough that the
# gather's bytes cost less than the collective it saves (0.34 ms each at S = 16 on the
# development CPU). Measured there (`bench merge`, S = 16): GLM-5.2's decode at B = 8, 1 MiB
# a shard, took 189 ms all-gathered against 3.4 ms with hidden_psum; the small model's 264 B
# saves a collective per layer.
GATHER_MAX_BYTES = 32 << 10
# Largest packed partial per shard that `auto` exchanges (head_exchange) when the wire is bf16.
# The exchange moves them in f32, head_scatter in bf16 plus the lse: about half the packed
# bytes more for one collective fewer. At TPU7x's 300 GB/s one way a collective's assumed
# 10 us is ~3 MB, which half of 6 MiB is: a decode step's partials (GLM-5.2 at B = 32: 4.2 MB)
# are exchanged, a prefill chunk's (1 GB at 8K rows) reduce-scattered.
EXCHANGE_MAX_BYTES = 6 << 20


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


def _pack(o: jax.Array, lse: jax.Array) -> jax.Array:
    """o f32[..., Dv], lse f32[...] -> f32[..., Dv + 1]: one array, so one collective."""
    return jnp.concatenate([o, lse[..., None]], axis=-1)


def _merge_packed(every: jax.Array) -> jax.Array:
    """Packed partials stacked on axis 0, f32[G, ..., Dv + 1] -> their merge, packed."""
    return _pack(*merge_stacked(every[..., :-1], every[..., -1]))


def merge_all_gather(o: jax.Array, lse: jax.Array, axis_name: str, gathers: str = "flat"
                     ) -> tuple[jax.Array, jax.Array]:
    """Same result as `merge_gather_psum` (up to rounding), by an all-gather of the packed
    [o | lse] and a merge: one collective (flat or in-process), or with `gathers` staged
    (cp_runtime.parallel.collectives: S = 16, groups of 4, then the 4 groups' merges) one per
    stage."""
    merged = gather_reduce(_pack(o, lse), axis_name, _merge_packed, gathers)
    return merged[..., :-1], merged[..., -1]


MERGES = {"gather_psum": merge_gather_psum, "all_to_all": merge_all_to_all,
          "all_gather": merge_all_gather}


def _my_weight(lse: jax.Array, axis_name: str) -> jax.Array:
    """exp(lse_r - lse) f32[...] of this shard's partial (the lse are all-gathered)."""
    w, _ = _weights(lax.all_gather(lse, axis_name), 0)
    return w[lax.axis_index(axis_name)]


def merge_to_own_heads(o: jax.Array, lse: jax.Array, axis_name: str,
                       wire_dtype: str = "f32") -> jax.Array:
    """o f32[..., H, Dv], lse f32[..., H] of this shard -> merged o f32[..., H', Dv] of this
    shard's own heads (H' = ceil(H / S); heads zero-padded to a multiple of S, as the weights
    are), by one reduce-scatter over the head axis, of the rescaled outputs in `wire_dtype`
    (the lse, which the weights come from, always in f32)."""
    num_shards = lax.axis_size(axis_name)
    rescaled = _my_weight(lse, axis_name)[..., None] * o
    pad = -o.shape[-2] % num_shards
    rescaled = jnp.pad(rescaled, [(0, 0)] * (o.ndim - 2) + [(0, pad), (0, 0)])
    wire = jnp.bfloat16 if wire_dtype == "bf16" else rescaled.dtype
    return lax.psum_scatter(rescaled.astype(wire), axis_name, scatter_dimension=o.ndim - 2,
                            tiled=True).astype(o.dtype)


def exchange_heads(o: jax.Array, lse: jax.Array, axis_name: str) -> jax.Array:
    """This shard's partials o f32[..., H, Dv], lse f32[..., H] -> received f32[S, H', ...,
    Dv + 1]: from every shard (axis 0) its packed [o | lse] of this shard's own heads
    (H' = ceil(H / S), heads padded to a multiple of S as the weights are, with o = 0 and
    lse = -inf, which merge to nothing). One all-to-all over the head axis, in f32: the lse
    must arrive exact, and a decode step's partials are a few hundred KB."""
    num_shards = lax.axis_size(axis_name)
    pad = -o.shape[-2] % num_shards
    lead = o.ndim - 2
    o = jnp.pad(o, [(0, 0)] * lead + [(0, pad), (0, 0)])
    lse = jnp.pad(lse, [(0, 0)] * lead + [(0, pad)], constant_values=-jnp.inf)
    packed = _pack(o, lse)                                               # [..., Hp, C]
    heads_here = packed.shape[-2] // num_shards
    # [..., Hp, C] -> [S, H', ..., C]: head block j goes to shard j; after the all-to-all
    # axis 0 indexes the shard the partials came from. Heads before rows, so a head's
    # partials are one contiguous block (kernels/latent_heads.py reads them so).
    blocks = packed.reshape(*packed.shape[:-2], num_shards, heads_here, packed.shape[-1])
    blocks = jnp.moveaxis(blocks, (-3, -2), (0, 1))
    return lax.all_to_all(blocks, axis_name, split_axis=0, concat_axis=0, tiled=True)


def merge_received(received: jax.Array) -> jax.Array:
    """`exchange_heads`' result f32[S, H', ..., Dv + 1] -> merged o f32[..., H', Dv]."""
    merged, _ = merge_stacked(received[..., :-1], received[..., -1])     # [H', ..., Dv]
    return jnp.moveaxis(merged, 0, -2)


def merge_by_head_exchange(o: jax.Array, lse: jax.Array, axis_name: str) -> jax.Array:
    """o f32[..., H, Dv], lse f32[..., H] of this shard -> merged o f32[..., H', Dv] of this
    shard's own heads: `exchange_heads`, then the exact merge of what arrived. One collective
    where `merge_to_own_heads` needs two (the lse's all-gather, then the reduce-scatter)."""
    return merge_received(exchange_heads(o, lse, axis_name))


def resolve_merge(merge: str, split: bool, packed_bytes: int, wire_dtype: str = "f32") -> str:
    """The variant `merge` names for weights split or not, partials of `packed_bytes` (f32)
    per shard and the wire dtype ('auto' picks by all three)."""
    if merge != "auto":
        return merge
    if packed_bytes <= GATHER_MAX_BYTES:
        return "all_gather"
    if not split:
        return "hidden_psum"
    if wire_dtype == "bf16" and packed_bytes > EXCHANGE_MAX_BYTES:
        return "head_scatter"
    return "head_exchange"


def combine(merge: str, o: jax.Array, lse: jax.Array, project, axis_name: str,
            ws, gathers: str = "auto") -> jax.Array:
    """This shard's partials o f32[..., H, Dv], lse f32[..., H] -> the attention output
    f[..., hidden], complete on every shard. `project` maps latent outputs of the heads whose
    weights this shard holds to hidden space (a partial sum when the weights are split, `ws`).
    gathers: how all_gather's gather runs (runtime field `gathers`,
    cp_runtime.parallel.collectives)."""
    merge = resolve_merge(merge, ws.split, (o.size + lse.size) * 4, ws.wire_dtype)
    if merge == "hidden_psum":
        if ws.split:
            raise ValueError("merge 'hidden_psum' needs every head's W_uv and o_proj on each "
                             "shard (weights = 'replicated')")
        return lax.psum(project(_my_weight(lse, axis_name)[..., None] * o), axis_name)
    if merge == "head_scatter":
        if not ws.split:
            raise ValueError("merge 'head_scatter' needs weights split by head "
                             "(weights = 'sharded')")
        return ws.join(project(merge_to_own_heads(o, lse, axis_name, ws.wire_dtype)))
    if merge == "head_exchange":
        if not ws.split:
            raise ValueError("merge 'head_exchange' needs weights split by head "
                             "(weights = 'sharded')")
        received = exchange_heads(o, lse, axis_name)
        # A projection that takes the exchanged partials itself (mla.OutputProjection)
        # merges them in the same pass as W_uv; a plain callable gets them merged.
        of_received = getattr(project, "of_exchanged", None)
        if of_received is not None:
            return ws.join(of_received(received))
        return ws.join(project(merge_received(received)))
    if merge == "all_gather":
        merged, _ = merge_all_gather(o, lse, axis_name, gathers)     # every head, everywhere
    else:
        merged, _ = MERGES[merge](o, lse, axis_name)
    if not ws.split:
        return project(merged)
    heads_here = -(-o.shape[-2] // lax.axis_size(axis_name))
    return ws.join(project(ws.own(merged, -2, heads_here)))
