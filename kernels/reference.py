"""XLA references of the per-shard hot paths. Each Pallas kernel in this package has the same
signature and is tested against the function here.

Notation: `P` physical pages per shard plus one sentinel (so cache arrays have `P + 1` pages),
`ps` page size, `D` cached row width, `B` sequences, `Q` queries per sequence, `N` pages attended
per query, `M` local pages per sequence on this shard. A position of -1 marks a padding query.

All four functions are pure: the cache write returns the updated cache (donated and updated in
place by XLA under jit; the Pallas kernel aliases input and output).

`cache_dtype`: the dtype of the cached values, whatever the cache array's storage form (the
same-width unsigned integers of a CPU pool, or the values themselves; see storage.py); None
means the cache array's own dtype.

Token masks (`sel_masks` of the sparse attention, every implementation alike). Token-level DSA
selection gives each query its selected tokens grouped by page: an entry names a page and
carries a bitmask of the page's tokens, `W = cdiv(ps, 32)` int32 words. Token i of entry n's
page (the key at position `sel_pages[b, q, n] * ps + i`) is a key of query (b, q) through
entry n only if bit i % 32 of word i // 32 is set (bit 31 is the sign bit; the words are read
as uint32 and shifted logically), on top of slot >= 0 and position <= q_pos. A key reachable
through two entries counts twice, as a page listed twice does without masks. An entry whose
words are all zero names nothing (`live_slots`). `sel_masks=None` is page mode: every token of
an entry's page.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.kernels.storage import cdiv, from_storage, saturating_cast, to_storage

__all__ = [
    "NEG_INF",
    "write_kv",
    "indexer_page_scores",
    "sparse_attention",
    "check_attention_args",
    "MASK_BITS",
    "mask_words",
    "token_bits",
    "live_slots",
    "dequantize",
    "grouped_matmul",
    "project_output",
    "scaled_linear",
    "shared_expert",
    "merge_values",
    "absorb_queries",
    "route_topk",
    "router",
    "by_expert",
]

NEG_INF = -jnp.inf


def write_kv(cache: jax.Array, new: jax.Array, slots: jax.Array, offsets: jax.Array, *,
             cache_dtype=None, max_tiles: int | None = None) -> jax.Array:
    """Write rows into a paged cache. The single cast to the cache dtype happens here.

    cache:   T[P + 1, ps, D]  one shard's cache of one layer
    new:     f[N, D]          rows to write (any float dtype)
    slots:   i32[N]           physical page of each row (the sentinel P for rows to discard)
    offsets: i32[N]           offset of each row inside its page
    max_tiles: the Pallas kernel's bound on distinct tiles (kernels/cache_write.py); unused here
    returns: T[P + 1, ps, D]
    """
    del max_tiles
    if new.ndim != 2 or new.shape[-1] != cache.shape[-1]:
        raise ValueError(f"new rows {new.shape} do not match cache rows {cache.shape}")
    rows = (saturating_cast(new, cache.dtype) if cache_dtype is None
            else to_storage(new, cache_dtype, cache.dtype))
    if rows.shape[0] == 1:
        # XLA turns a one-row scatter into a dynamic-update-slice, which it then performs on a
        # copy of the whole buffer (measured on CPU: 3 buffer copies). A second, discarded row
        # for the sentinel page keeps it a true in-place scatter.
        sentinel = cache.shape[0] - 1
        rows = jnp.concatenate([rows, rows])
        slots = jnp.concatenate([slots, jnp.full((1,), sentinel, slots.dtype)])
        offsets = jnp.concatenate([offsets, offsets])
    return cache.at[slots, offsets].set(rows, mode="promise_in_bounds")


@functools.partial(jax.jit, static_argnames=("num_shards", "key_block_pages", "cache_dtype"))
def indexer_page_scores(q: jax.Array, w: jax.Array, k_cache: jax.Array, local_pages: jax.Array,
                        q_pos: jax.Array, shard: jax.Array, rotation: jax.Array | None = None, *,
                        num_shards: int, key_block_pages: int, cache_dtype=None) -> jax.Array:
    """DSA indexer page scores of one shard's pages, blocked over keys.

        I(t, s)  = sum_h w_h(t) * ReLU(q_h(t) . k(s))
        P(t, p)  = max_{s in page p, s <= t} I(t, s)        (-inf when no such s)

    q:           f[B, Q, Hi, Di]   indexer queries (after RoPE and Hadamard)
    w:           f[B, Q, Hi]       per-head weights (already scaled)
    k_cache:     T[P + 1, ps, Di]  this shard's indexer key cache
    local_pages: i32[B, M]         slot of the sequence's j-th page on this shard
                                   (logical page j * num_shards + shard)
    q_pos:       i32[B, Q]         query positions (-1 = padding)
    shard:       i32[]             this shard's index on the cp axis
    rotation:    i32[B]            each sequence's rotation (cp_runtime.cache.layout): local page j
                                   holds logical page j * num_shards + shard - rotation, none
                                   when that is negative (its keys are masked); None = zeros
    returns:     f32[B, Q, M]      page scores; memory is bounded by key_block_pages, never
                                   [Q, Hi, all keys]
    """
    b, m = local_pages.shape
    ps = k_cache.shape[1]
    value_dtype = k_cache.dtype if cache_dtype is None else cache_dtype
    nb = min(key_block_pages, m)
    num_blocks = -(-m // nb)
    pad = num_blocks * nb - m
    # Pad the page axis with the sentinel; padded pages sit past any query so they mask out.
    pages = jnp.pad(local_pages, ((0, 0), (0, pad)), constant_values=k_cache.shape[0] - 1)
    pages = pages.reshape(b, num_blocks, nb).transpose(1, 0, 2)  # [blocks, B, nb]
    qf = q.astype(jnp.float32)
    wf = w.astype(jnp.float32)
    offsets = jnp.arange(ps, dtype=jnp.int32)
    rotation = jnp.zeros((b,), jnp.int32) if rotation is None else rotation.astype(jnp.int32)

    def block(carry, xs):
        blk_pages, blk_index = xs                                     # [B, nb], []
        keys = from_storage(k_cache[blk_pages], value_dtype).astype(jnp.float32)  # [B,nb,ps,Di]
        logits = jnp.einsum("bqhd,bnsd->bqhns", qf, keys)             # [B, Q, Hi, nb, ps]
        scores = jnp.einsum("bqhns,bqh->bqns", jax.nn.relu(logits), wf)  # [B, Q, nb, ps]
        local = blk_index * nb + jnp.arange(nb, dtype=jnp.int32)      # [nb]
        page = local[None, :] * num_shards + shard - rotation[:, None]  # [B, nb] logical
        key_pos = (page * ps)[..., None] + offsets                    # [B, nb, ps]
        q_col = q_pos[:, :, None, None]                               # [B, Q, 1, 1]
        visible = (key_pos[:, None] <= q_col) & (key_pos[:, None] >= 0)  # [B, Q, nb, ps]
        return carry, jnp.where(visible, scores, NEG_INF).max(axis=-1)  # [B, Q, nb]

    _, out = lax.scan(block, None, (pages, jnp.arange(num_blocks, dtype=jnp.int32)))
    # [blocks, B, Q, nb] -> [B, Q, blocks * nb] -> [B, Q, M]
    out = out.transpose(1, 2, 0, 3).reshape(b, q.shape[1], num_blocks * nb)
    return out[:, :, :m]


MASK_BITS = 32     # tokens per mask word


def mask_words(page_size: int) -> int:
    """W: the int32 words of one entry's token mask."""
    return cdiv(page_size, MASK_BITS)


def token_bits(sel_masks: jax.Array, page_size: int) -> jax.Array:
    """sel_masks i32[..., W] -> bool[..., ps]: token i's bit, bit i % 32 of word i // 32 (read
    unsigned, so bit 31 is a token like any other)."""
    words = lax.bitcast_convert_type(sel_masks, jnp.uint32)
    word_of_token = jnp.repeat(words, MASK_BITS, axis=-1)[..., :page_size]   # [..., ps]
    shift = jnp.arange(page_size, dtype=jnp.uint32) % MASK_BITS
    return ((word_of_token >> shift) & 1) != 0


def live_slots(sel_slots: jax.Array, sel_masks: jax.Array | None) -> jax.Array:
    """sel_slots i32[B, Q, N] with -1 where the entry's mask i32[B, Q, N, W] is all zero (such
    an entry names no key; dropping it keeps unions and DMA lists to pages some query reads);
    sel_slots itself in page mode (sel_masks None)."""
    if sel_masks is None:
        return sel_slots
    return jnp.where((sel_masks != 0).any(axis=-1), sel_slots, -1)


def check_attention_args(q: jax.Array, kv_cache: jax.Array, sel_slots: jax.Array,
                         sel_pages: jax.Array, q_pos: jax.Array, value_dim: int,
                         sel_masks: jax.Array | None = None) -> None:
    """Trace-time shape checks shared by the reference and the kernels."""
    b, nq, _, d = q.shape
    if kv_cache.ndim != 3 or kv_cache.shape[-1] != d:
        raise ValueError(f"kv cache {kv_cache.shape} must be [P + 1, ps, {d}]")
    if sel_slots.shape != sel_pages.shape or sel_slots.shape[:2] != (b, nq):
        raise ValueError(f"sel_slots {sel_slots.shape} / sel_pages {sel_pages.shape} must be "
                         f"[{b}, {nq}, N]")
    if q_pos.shape != (b, nq):
        raise ValueError(f"q_pos {q_pos.shape} must be [{b}, {nq}]")
    if not 0 < value_dim <= d:
        raise ValueError(f"{value_dim=} must be in (0, {d}]")
    if sel_masks is not None:
        want = (*sel_slots.shape, mask_words(kv_cache.shape[1]))
        if sel_masks.shape != want or sel_masks.dtype != jnp.int32:
            raise ValueError(f"sel_masks {sel_masks.dtype}{list(sel_masks.shape)} must be "
                             f"int32{list(want)}")


@functools.partial(jax.jit, static_argnames=("value_dim", "scale", "query_block", "cache_dtype"))
def sparse_attention(q: jax.Array, kv_cache: jax.Array, sel_slots: jax.Array,
                     sel_pages: jax.Array, q_pos: jax.Array, *, value_dim: int, scale: float,
                     query_block: int = 64, cache_dtype=None,
                     sel_masks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA attention of each query over the pages (or tokens) selected for it on this
    shard.

    q:         f[B, Q, H, D]     queries in the cached layout `[q_lat | q_pe]` (padded)
    kv_cache:  T[P + 1, ps, D]   this shard's latent cache `[c | k_pe]`
    sel_slots: i32[B, Q, N]      local slot of each selected page, -1 where this shard does not
                                 own it (or the entry is unused)
    sel_pages: i32[B, Q, N]      logical page index of each entry (token s of page p sits at
                                 position p * ps + s); only read where sel_slots >= 0
    q_pos:     i32[B, Q]         query positions (-1 = padding); keys at positions <= q_pos attend
    sel_masks: i32[B, Q, N, W]   token mask of each entry (module docstring), or None: every
                                 token of the page
    returns:   o f32[B, Q, H, value_dim] (the softmax-weighted `c`), lse f32[B, Q, H]
               (natural log; o = 0 and lse = -inf where no key is visible)

    The KV block is upcast to the query dtype before the score dot; probabilities stay f32.
    Queries are processed `query_block` at a time so memory stays bounded. The softmax runs
    over every entry's keys side by side, so a key two entries reach counts twice: this is the
    definition the kernels follow.
    """
    check_attention_args(q, kv_cache, sel_slots, sel_pages, q_pos, value_dim, sel_masks)
    b, nq, h, d = q.shape
    ps = kv_cache.shape[1]
    value_dtype = kv_cache.dtype if cache_dtype is None else cache_dtype
    qb = min(query_block, nq)
    num_blocks = -(-nq // qb)
    pad = num_blocks * qb - nq

    def blocks(x, fill):  # [B, Q, ...] -> [blocks, B, qb, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(b, num_blocks, qb, *x.shape[2:]), 1, 0)

    offsets = jnp.arange(ps, dtype=jnp.int32)

    def block(carry, xs):
        # [B, qb, H, D], [B, qb, N] x2, [B, qb] and, with masks, [B, qb, N, W]
        qq, slots, pages, pos, *masks = xs
        kv = from_storage(kv_cache[jnp.maximum(slots, 0)], value_dtype)  # [B, qb, N, ps, D]
        kv = kv.astype(qq.dtype)
        key_pos = pages[..., None] * ps + offsets                # [B, qb, N, ps]
        visible = (slots[..., None] >= 0) & (key_pos <= pos[..., None, None])
        if masks:
            visible &= token_bits(masks[0], ps)
        kv = jnp.where(visible[..., None], kv, 0)               # unused slots may hold garbage
        s = jnp.einsum("bqhd,bqnsd->bqhns", qq, kv,
                       preferred_element_type=jnp.float32) * scale  # [B, qb, H, N, ps]
        s = jnp.where(visible[:, :, None], s, NEG_INF)
        s = s.reshape(*s.shape[:3], -1)                          # [B, qb, H, N * ps]
        m = jnp.max(s, axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m_safe)
        denom = p.sum(axis=-1)                                   # [B, qb, H]
        v = kv[..., :value_dim].astype(jnp.float32).reshape(*kv.shape[:2], -1, value_dim)
        o = jnp.einsum("bqhk,bqkv->bqhv", p, v) / jnp.where(denom > 0, denom, 1.0)[..., None]
        lse = jnp.where(denom > 0, jnp.log(jnp.where(denom > 0, denom, 1.0)) + m_safe[..., 0],
                        NEG_INF)
        return carry, (o, lse)

    xs = (blocks(q, 0), blocks(sel_slots, -1), blocks(sel_pages, 0), blocks(q_pos, -1))
    if sel_masks is not None:
        xs += (blocks(sel_masks, 0),)
    _, (o, lse) = lax.scan(block, None, xs)
    o = jnp.moveaxis(o, 0, 1).reshape(b, num_blocks * qb, h, value_dim)[:, :nq]
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, num_blocks * qb, h)[:, :nq]
    return o, lse


def dequantize(w: jax.Array, scales: jax.Array) -> jax.Array:
    """A block-scaled weight's values in f32: w f8[..., a, b] (or any float), scales
    f32[..., a / ga, b / gb] -> f32[..., a, b], each value times its ga x gb block's scale."""
    *lead, a, b = w.shape
    ga, gb = a // scales.shape[-2], b // scales.shape[-1]
    runs = w.astype(jnp.float32).reshape(*lead, a // ga, ga, b // gb, gb)
    return (runs * scales[..., :, None, :, None]).reshape(w.shape)


def grouped_matmul(rows: jax.Array, w: jax.Array, scales: jax.Array,
                   group_sizes: jax.Array, *, up: tuple[jax.Array, jax.Array] | None = None,
                   row_scales: jax.Array | None = None,
                   row_weights: jax.Array | None = None) -> jax.Array:
    """Rows sorted by group through their group's block-scaled weight, in f32: a ragged dot
    over the dequantised weights (an f32 copy of every group's weight, never one per row).

    rows:        f[N, K]            cast to bf16 (the kernel's input)
    w:           f8[E, K, M]        (or any float dtype)
    scales:      f32[E, K/ga, M/gb] one scale per ga x gb block of w
    group_sizes: i32[E]             rows of each group in order; rows past their sum give zeros
    up:          (w_up, scales_up) shaped as (w, scales), or None: the gated product
                 silu(rows . w) * (rows . w_up)
    row_scales:  f32[N, 1] or None: rows f8[N, K] stand for rows * row_scales
    row_weights: f32[N, 1] or None: each row's result times its weight
    returns:     f32[N, M]          out[r] = rows[r] @ (w[g] * scales[g] per block), g = r's group
    """
    x = rows.astype(jnp.bfloat16).astype(jnp.float32)
    if row_scales is not None:
        x = x * row_scales
    past = jnp.arange(rows.shape[0]) >= group_sizes.sum()

    def through(weight, weight_scales):
        out = lax.ragged_dot(x, dequantize(weight, weight_scales), group_sizes,
                             precision=lax.Precision.HIGHEST)
        return jnp.where(past[:, None], 0.0, out)

    out = through(w, scales) if up is None else jax.nn.silu(through(w, scales)) * through(*up)
    return out if row_weights is None else out * row_weights


def project_output(o_lat: jax.Array, kv_b: jax.Array, kv_b_scales: jax.Array,
                 o_proj: jax.Array, o_proj_scales: jax.Array, *, nope: int) -> jax.Array:
    """MLA's output of every head of R rows in hidden space: each head's latent output through
    its W_uv (kv_b's last v rows of the head; bf16 inputs, f32 sums, rounded to bf16), the
    heads side by side through o_proj (`scaled_linear`).

    o_lat:  f[R, H, Dv];  kv_b: f8[H (nope + v), Dv] with scales;  o_proj: f8[hidden, H v]
    with scales;  returns f32[R, hidden]
    """
    rows, heads, dv = o_lat.shape
    w_uv = dequantize(kv_b, kv_b_scales).astype(jnp.bfloat16).reshape(heads, -1, dv)[:, nope:]
    o = jnp.einsum("rhc,hvc->rhv", o_lat.astype(jnp.bfloat16).astype(jnp.float32),
                   w_uv.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return scaled_linear(o.astype(jnp.bfloat16).reshape(rows, -1), o_proj, o_proj_scales)


def scaled_linear(x: jax.Array, w: jax.Array, scales: jax.Array) -> jax.Array:
    """x through a block-scaled weight in the checkpoints' [out, in] layout, as the model's
    `weight()` dequantises it: each value times its block's scale, rounded to bf16; the
    matmul of bf16 inputs in f32.

    x:       f[..., K]          cast to bf16 (the kernel's input)
    w:       f8[N, K]           (or any float dtype)
    scales:  f32[N/ga, K/gb]    one scale per ga x gb block of w
    returns: f32[..., N]
    """
    dequantised = dequantize(w, scales).astype(jnp.bfloat16)
    return jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16).astype(jnp.float32),
                      dequantised.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def shared_expert(values: jax.Array, row_scales: jax.Array, routed: jax.Array,
                  gate: jax.Array, gate_scales: jax.Array, up: jax.Array, up_scales: jax.Array,
                  down: jax.Array, down_scales: jax.Array) -> jax.Array:
    """routed + down(silu(x gate^T) * (x up^T)), x = values * row_scales, in f32 with the
    kernel's roundings: each weight dequantised and rounded to bf16 (as `weight()`), the gated
    product rounded to bf16 (the down matmul's input), the sum rounded to bf16.

    values: f8[T, K], row_scales f32[T, 1]; routed: bf16[T, N]; gate, up: f8[I, K] and down
    f8[N, I] with their block scales -> bf16[T, N]
    """
    def weight(w, s):
        return dequantize(w, s).astype(jnp.bfloat16).astype(jnp.float32)

    hp = lax.Precision.HIGHEST
    x = values.astype(jnp.float32)
    g = jnp.dot(x, weight(gate, gate_scales).T, precision=hp) * row_scales
    u = jnp.dot(x, weight(up, up_scales).T, precision=hp) * row_scales
    gated = (jax.nn.silu(g) * u).astype(jnp.bfloat16).astype(jnp.float32)
    down_sum = jnp.dot(gated, weight(down, down_scales).T, precision=hp)
    return (routed.astype(jnp.float32) + down_sum).astype(jnp.bfloat16)


def merge_values(received: jax.Array, w: jax.Array, scales: jax.Array, nope: int) -> jax.Array:
    """The exact merge of every shard's partials of a device's heads, each head's result
    through its W_uv as `weight()` dequantises it (bf16 values, bf16 input, f32 sums).

    received: f32[S, H', R, Dv + 1]   partials [o | lse] from each of S shards
    w:        f8[H'(nope + v), Dv]    kv_b of the H' heads: per head W_uk (nope rows), W_uv (v)
    scales:   f32[H'(nope + v)/ga, Dv/gb]
    returns:  f32[R, H' v]            heads side by side; a head no shard saw gives zeros
    """
    o, lse = received[..., :-1], received[..., -1:]
    top = lse.max(0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.exp(lse - top)
    total = e.sum(0)
    merged = (e * o).sum(0) / jnp.where(total > 0, total, 1.0)          # [H', R, Dv]
    heads, rows, dv = merged.shape
    kv_b = dequantize(w, scales).astype(jnp.bfloat16).astype(jnp.float32)
    w_uv = kv_b.reshape(heads, -1, dv)[:, nope:]                          # [H', v, Dv]
    out = jnp.einsum("hrc,hvc->rhv", merged.astype(jnp.bfloat16).astype(jnp.float32), w_uv,
                     precision=lax.Precision.HIGHEST)
    return out.reshape(rows, -1)


def absorb_queries(q: jax.Array, w: jax.Array, scales: jax.Array, nope: int) -> jax.Array:
    """q_nope . W_uk per head, W_uk as `weight()` dequantises it (bf16 values and inputs, f32
    sums).

    q:       f32[H', R, Dq]          queries of H' heads, q_nope in the first nope lanes
    w:       f8[H'(nope + v), Dv]    kv_b of the H' heads: per head W_uk (nope rows), W_uv (v)
    scales:  f32[H'(nope + v)/ga, Dv/gb]
    returns: f32[H', R, Dv]
    """
    heads = q.shape[0]
    kv_b = dequantize(w, scales).astype(jnp.bfloat16).astype(jnp.float32)
    w_uk = kv_b.reshape(heads, -1, kv_b.shape[-1])[:, :nope]               # [H', nope, Dv]
    q_nope = q[..., :nope].astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.einsum("hrn,hnc->hrc", q_nope, w_uk, precision=lax.Precision.HIGHEST)


def _limit_groups(biased: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """biased f32[..., E] with the experts outside the topk_group best of n_group groups set
    to -inf. A group's score is the sum of its two best biased scores (its best one if a group
    holds a single expert). -inf, not 0, fills the dropped groups: biased scores can be
    negative."""
    g = biased.reshape(*biased.shape[:-1], n_group, -1)                      # [..., G, E/G]
    best = lax.top_k(g, min(2, g.shape[-1]))[0].sum(-1)                      # [..., G]
    _, keep = lax.top_k(best, topk_group)                                    # [..., topk_group]
    kept = jax.nn.one_hot(keep, n_group, dtype=jnp.bool_).any(-2)           # [..., G]
    return jnp.where(kept[..., None], g, NEG_INF).reshape(biased.shape)


def route_topk(logits: jax.Array, bias: jax.Array, *, k: int, n_group: int, topk_group: int,
               norm: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's noaux_tc routing: sigmoid scores s, biased b = s + bias (the bias picks,
    never weighs); groups limit the choice (n_group > 1); the top k of b, lowest expert first
    among equals (`lax.top_k`); their weights s, normalised when `norm`, times `scale`.

    logits:  f32[..., E]    the router's
    bias:    f32[E]         the correction bias
    returns: (chosen i32[..., k], weights f32[..., k])
    """
    scores = jax.nn.sigmoid(logits)
    biased = scores + bias
    if n_group > 1:
        biased = _limit_groups(biased, n_group, topk_group)
    _, chosen = lax.top_k(biased, k)
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdims=True)
    return chosen, weights * scale


def router(x: jax.Array, gate: jax.Array, bias: jax.Array, **routing
           ) -> tuple[jax.Array, jax.Array]:
    """x through the router gate, then `route_topk(logits, bias, **routing)`, each token's
    choices in ascending expert order (`by_expert`). The logits are the bf16 matmul's, as the
    model's `linear` computes them: bf16 inputs, f32 sums, the result rounded to bf16.

    x:       f[T, hidden]
    gate:    bf16[E, hidden]
    bias:    f32[E]
    returns: (chosen i32[T, k], weights f32[T, k])
    """
    logits = jnp.einsum("th,eh->te", x.astype(jnp.bfloat16).astype(jnp.float32),
                        gate.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return by_expert(*route_topk(logits.astype(jnp.bfloat16).astype(jnp.float32), bias,
                                 **routing))


def by_expert(chosen: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each token's chosen experts i32[..., k] and weights f32[..., k] in ascending expert
    order."""
    order = jnp.argsort(chosen, axis=-1)
    return (jnp.take_along_axis(chosen, order, axis=-1),
            jnp.take_along_axis(weights, order, axis=-1))
