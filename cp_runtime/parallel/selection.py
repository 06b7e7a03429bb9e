"""DSA page selection: own page plus the top-K earlier pages, exact under context parallelism.

Order: score descending, then page index ascending, a total order, so ties are deterministic and
the order does not depend on how candidates are split across shards. Each shard ranks its own
pages and keeps K candidates; after an all-gather of the S * K candidates (on CPU, in stages of
groups, each ranked to K) every shard ranks them again and gets the same K pages a single device
would (the global top-K is contained in the union of the local top-Ks, and ranking by a total
order is associative).

Unused entries carry page -1 and score -inf.

On a TPU the ranks run in kernels/page_top_k (`_rank_by_kernel`): XLA:TPU lowers `lax.top_k` and
the two-key sort to a full sort of every query's candidates, which its cost model prices at
nothing and which ran about a hundred times slower than the kernel on a TPU v5e
(docs/notes/2026-12-06-selection-on-tpu.md, "The page selection's sorts, measured on a TPU").
Same pages, same order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from cp_runtime.cache.layout import global_page_jnp
from cp_runtime.kernels import page_top_k
from cp_runtime.kernels.page_top_k import MAX_ROUNDS
from cp_runtime.kernels.reference import mask_words
from cp_runtime.parallel.collectives import gather_reduce

__all__ = ["NO_PAGE", "rank_pages", "rank_rows", "rank_distinct_pages",
           "rank_gathered_pages", "rank_gathered_columns", "local_candidates",
           "global_top_pages", "halve_sorted_lists", "attended_pages", "earlier_pages_mask",
           "token_entries", "entries_per_query"]

NO_PAGE = -1
_LAST = jnp.iinfo(jnp.int32).max  # sorts after every real page


def rank_pages(scores: jax.Array, pages: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The first k of (scores, pages) under (score desc, page asc).

    scores: f32[..., C] (-inf = not a candidate);  pages: i32[..., C]
    returns f32[..., k], i32[..., k] with NO_PAGE where fewer than k candidates exist.
    """
    c = scores.shape[-1]
    if c < k:
        pad = [(0, 0)] * (scores.ndim - 1) + [(0, k - c)]
        scores = jnp.pad(scores, pad, constant_values=-jnp.inf)
        pages = jnp.pad(pages, pad, constant_values=NO_PAGE)
    valid = scores > -jnp.inf
    neg, page = lax.sort((jnp.where(valid, -scores, jnp.inf), jnp.where(valid, pages, _LAST)),
                         dimension=scores.ndim - 1, num_keys=2)
    top_scores, top_pages = -neg[..., :k], page[..., :k]
    return top_scores, jnp.where(top_pages == _LAST, NO_PAGE, top_pages)


def rank_rows(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k best positions along the last axis under (score desc, position asc).

    scores:  f32[..., C] (-inf = not a candidate)
    returns: f32[..., k], i32[..., k] with NO_PAGE where fewer than k candidates exist

    A partial selection (`lax.top_k`) instead of a full two-key sort (measured on CPU: 1024
    queries x 1024 pages, k = 4: 2.3 ms against 168 ms); on a TPU `_rank_by_kernel`.
    `lax.top_k` puts equal scores lower index first. Zeros are made +0.0 first, since the
    sort's order treats -0.0 and 0.0 as equal.
    """
    def by_top_k(scores):
        if scores.shape[-1] < k:
            pad = [(0, 0)] * (scores.ndim - 1) + [(0, k - scores.shape[-1])]
            scores = jnp.pad(scores, pad, constant_values=-jnp.inf)
        top_scores, index = lax.top_k(jnp.where(scores == 0, 0.0, scores), k)
        return top_scores, jnp.where(top_scores > -jnp.inf, index, NO_PAGE)

    return _on_tpu_by_kernel(scores, None, k, default=by_top_k)


def _on_tpu_by_kernel(scores: jax.Array, pages: jax.Array | None, k: int, *, default,
                      cpu=None, columns: bool = False) -> tuple[jax.Array, jax.Array]:
    """`_rank_by_kernel` on a TPU where the kernel takes the shape, `default` elsewhere (`cpu`
    on a CPU, where given); pages None: rank by position. Candidates lie on the last axis, or
    on the first with `columns` (`_rank_columns_by_kernel`)."""
    operands = (scores,) if pages is None else (scores, pages)
    branches = dict(cpu=cpu or default, default=default)
    c = scores.shape[0 if columns else -1]
    by_kernel = _rank_columns_by_kernel if columns else _rank_by_kernel
    if page_top_k.supports(c, scores.size // max(c, 1), k, has_pages=pages is not None):
        branches["tpu"] = lambda *ops: by_kernel(*ops, k=k)
    return lax.platform_dependent(*operands, **branches)


def _rank_columns_by_kernel(scores: jax.Array, pages: jax.Array | None = None, *, k: int,
                            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`rank_gathered_columns` (or by position, where pages is None) by kernels/page_top_k:
    f32/i32[C, ...] -> [k, ...]; the trailing axes are the kernel's query lanes as they lie."""
    c, *rest = scores.shape
    flat = lambda x: x.reshape(c, -1)                                     # noqa: E731
    top_scores, top = page_top_k.top_pages(flat(scores), None if pages is None else flat(pages),
                                           k=k, interpret=interpret)     # [k, N]
    return top_scores.reshape(k, *rest), top.reshape(k, *rest)


def _rank_by_kernel(scores: jax.Array, pages: jax.Array | None = None, *, k: int,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`rank_pages` of distinct pages by kernels/page_top_k, or `rank_rows` where pages is
    None: the candidates f32/i32[..., C] become columns [C, ...], one a query."""
    first = lambda x: jnp.moveaxis(x, -1, 0)                              # noqa: E731
    top_scores, top = _rank_columns_by_kernel(first(scores),
                                              None if pages is None else first(pages),
                                              k=k, interpret=interpret)
    return jnp.moveaxis(top_scores, 0, -1), jnp.moveaxis(top, 0, -1)


def rank_distinct_pages(scores: jax.Array, pages: jax.Array, k: int, axis: int = -1
                        ) -> tuple[jax.Array, jax.Array]:
    """`rank_pages` for candidates whose valid pages are distinct, in any order (the S * K
    gathered candidates): k rounds of "best score, then lowest page among its ties", O(k * C)
    elementwise work instead of a two-key sort (measured on CPU, 1024 queries: 64 candidates,
    k = 4: 0.5 ms against 7.2 ms; 512 candidates, k = 32: 6.0 against 72 ms). The candidates
    lie along `axis`, and so do the k results.
    """
    s = jnp.where(scores == 0, 0.0, scores)         # the sort's order: -0.0 ties with 0.0
    top_scores, top_pages = [], []
    for _ in range(k):
        best = s.max(axis=axis, keepdims=True)
        tied = (s == best) & (best > -jnp.inf)
        page = jnp.min(jnp.where(tied, pages, _LAST), axis=axis, keepdims=True)
        s = jnp.where(tied & (pages == page), -jnp.inf, s)
        top_scores.append(best)
        top_pages.append(jnp.where(best > -jnp.inf, page, NO_PAGE))
    return jnp.concatenate(top_scores, axis=axis), jnp.concatenate(top_pages, axis=axis)


def rank_gathered_pages(scores: jax.Array, pages: jax.Array, k: int
                        ) -> tuple[jax.Array, jax.Array]:
    """`rank_pages` for distinct candidates, by whichever form is cheaper where the program
    runs (all give the same k pages in the same order): on CPU `rank_distinct_pages`' k
    rounds, up to MAX_ROUNDS of them (unrolled, each a pass over every candidate: token
    selection's index_topk rounds over S * index_topk candidates ran a CPU test out of 24 GB);
    on a TPU the same rounds in VMEM (`_rank_by_kernel`; as XLA ops each round was a
    few small ops of ~1 us apiece, and the sort ran 2.6 ms on a TPU v5e for 512 candidates,
    k = 32, at 16,384 queries, against 0.51 ms for the kernel); elsewhere one two-key sort
    (`rank_pages`)."""
    rounds = functools.partial(rank_distinct_pages, k=k) if k <= MAX_ROUNDS else None
    return _on_tpu_by_kernel(scores, pages, k, cpu=rounds,
                             default=functools.partial(rank_pages, k=k))


def rank_gathered_columns(scores: jax.Array, pages: jax.Array, k: int
                          ) -> tuple[jax.Array, jax.Array]:
    """`rank_gathered_pages` of candidates on the first axis: f32/i32[C, ...] -> [k, ...].

    The gathered candidates' form on every platform (`global_top_pages`): with the queries on
    the trailing axes the TPU kernel takes them as they lie ([C, N] columns), and the arrays
    the gather and the halving move keep the queries on the 128-lane axis instead of k = 32
    candidates padded to 128 lanes.
    """
    last = lambda x: jnp.moveaxis(x, 0, -1)                               # noqa: E731
    first = lambda x: jnp.moveaxis(x, -1, 0)                              # noqa: E731

    def by_sort(scores, pages):
        return tuple(first(x) for x in rank_pages(last(scores), last(pages), k))

    rounds = (functools.partial(rank_distinct_pages, k=k, axis=0) if k <= MAX_ROUNDS
              else None)
    return _on_tpu_by_kernel(scores, pages, k, columns=True, default=by_sort, cpu=rounds)


def earlier_pages_mask(pages: jax.Array, q_pos: jax.Array, page_size: int) -> jax.Array:
    """Which pages[...] (broadcast against q_pos[..., None]) lie before the query's own page."""
    own = jnp.where(q_pos >= 0, q_pos // page_size, -1)
    return pages < own[..., None]


def local_candidates(page_scores: jax.Array, q_pos: jax.Array, shard: jax.Array,
                     rotation: jax.Array, *, num_shards: int, page_size: int, k: int
                     ) -> tuple[jax.Array, jax.Array]:
    """This shard's best k earlier pages per query.

    page_scores: f32[B, Q, M] scores of the shard's local pages (local j holds logical page
                 j * S + shard - rotation; none when negative)
    q_pos:       i32[B, Q]
    rotation:    i32[B]
    returns      f32[B, Q, k], i32[B, Q, k] (logical page indices)
    """
    m = page_scores.shape[-1]
    local = jnp.arange(m, dtype=jnp.int32)
    pages = global_page_jnp(local[None, :], shard, num_shards, rotation[:, None])   # [B, M]
    pages = pages[:, None, :]
    eligible = (pages >= 0) & earlier_pages_mask(pages, q_pos, page_size)
    # The pages ascend with the local index, so ranking by position is ranking by page.
    top_scores, rows = rank_rows(jnp.where(eligible, page_scores, -jnp.inf), k)
    top_pages = global_page_jnp(rows, shard, num_shards, rotation[:, None, None])
    return top_scores, jnp.where(rows == NO_PAGE, NO_PAGE, top_pages)


def global_top_pages(scores: jax.Array, pages: jax.Array, *, k: int, axis_name: str | None,
                     gathers: str = "auto") -> jax.Array:
    """Gather every shard's candidates f32/i32[B, Q, k] and rank them: i32[B, Q, k].

    Scores and pages travel as one array (pages bit-cast to f32 and back, exactly): one
    collective, not two, since on small steps a collective's latency, not its bytes, is the
    cost. The gather may run in stages (`gathers`, cp_runtime.parallel.collectives.gather_reduce),
    each group's candidates ranked to its top k before the next: the same pages, since the top k of
    the union is the top k of the groups' top ks. Each shard's list arrives ranked, so pairs of
    lists are first halved to their top k (`halve_sorted_lists`): half the candidates to rank.
    The lists travel and rank with the candidates first ([k, B, Q], `rank_gathered_columns`).
    On a TPU, for an even S gathered in one stage, the halving and the rank are one kernel
    (`_pairs_by_kernel`). With axis_name None (S = 1) the candidates are already global.
    """
    if axis_name is None:
        return rank_gathered_pages(scores, pages, k)[1]
    packed = _packed_columns(scores, pages)                                # [2, k, B, Q]

    def rank_gathered(every: jax.Array) -> jax.Array:        # [G, 2, k, B, Q] -> [2, k, B, Q]
        every = halve_sorted_lists(every)
        scores, pages = (every[:, i].reshape(-1, *every.shape[3:]) for i in (0, 1))  # [G*k, B, Q]
        top_scores, top_pages = rank_gathered_columns(
            scores, lax.bitcast_convert_type(pages, jnp.int32), k)
        return jnp.stack([top_scores, lax.bitcast_convert_type(top_pages, jnp.float32)])

    def in_xla(packed: jax.Array) -> jax.Array:
        ranked = gather_reduce(packed, axis_name, rank_gathered, gathers)
        return lax.bitcast_convert_type(ranked[1], jnp.int32)

    shards, queries = lax.axis_size(axis_name), packed[0, 0].size
    if shards % 2 == 0 and gathers != "staged" and page_top_k.supports_pairs(shards, queries, k):
        by_kernel = functools.partial(_pairs_by_kernel, axis_name=axis_name, k=k)
        top = lax.platform_dependent(packed, tpu=by_kernel, default=in_xla)
    else:
        top = in_xla(packed)
    return jnp.moveaxis(top, 0, -1)


def _packed_columns(scores: jax.Array, pages: jax.Array) -> jax.Array:
    """A shard's ranked list f32/i32[B, Q, k] as one array f32[2, k, B, Q]: scores, and pages
    bit-cast to f32 (exactly), the candidates first (`rank_gathered_columns`)."""
    first = lambda x: jnp.moveaxis(x, -1, 0)                              # noqa: E731
    return jnp.stack([first(scores.astype(jnp.float32)),
                      first(lax.bitcast_convert_type(pages.astype(jnp.int32), jnp.float32))])


def _pairs_by_kernel(packed: jax.Array, *, axis_name: str, k: int, interpret: bool = False
                     ) -> jax.Array:
    """`global_top_pages`' gather and rank on a TPU: packed f32[2, k, B, Q] (this shard's
    ranked list) -> pages i32[k, B, Q], the k best over every shard.

    One kernel halves the pairs of lists in VMEM and ranks what is left
    (kernels/page_top_k.top_pages_of_pairs); as XLA ops the halving's passes over the gathered
    lists cost more than the rank (0.15 ms a half-chunk at 16,384 queries, by the compiler's
    estimate). The odd shards send their lists worst first, which the kernel's halving reads
    (Mosaic lowers no reversal), a flip of k rows here before the gather.
    """
    odd = lax.axis_index(axis_name) % 2 == 1
    every = lax.all_gather(jnp.where(odd, jnp.flip(packed, axis=1), packed), axis_name)
    _, top = page_top_k.top_pages_of_pairs(every.reshape(*every.shape[:3], -1), k=k,
                                           interpret=interpret)
    return top.reshape(k, *packed.shape[2:])


def halve_sorted_lists(every: jax.Array) -> jax.Array:
    """[G, 2, k, ...] -> [G / 2, 2, k, ...] for even G: each pair of ranked lists (scores, and
    pages bit-cast to f32, best first under (score desc, page asc), along axis 2) cut to the k
    best of the two, as a set, in no useful order; odd G is left as it is.

    The top k of two ranked lists a and b are the better of a[i] and b[k - 1 - i] for each i
    (a followed by b reversed is V-shaped in the order, and a bitonic split of it keeps the
    better half): one elementwise pass instead of a rank over 2k.
    """
    if every.shape[0] % 2:
        return every
    a, b = every[0::2], jnp.flip(every[1::2], axis=2)
    a_pages, b_pages = (lax.bitcast_convert_type(x[:, 1], jnp.int32) for x in (a, b))
    a_first = (a[:, 0] > b[:, 0]) | ((a[:, 0] == b[:, 0]) & (a_pages < b_pages))
    return jnp.where(a_first[:, None], a, b)


def attended_pages(selected: jax.Array, q_pos: jax.Array, page_size: int) -> jax.Array:
    """selected i32[B, Q, K] -> i32[B, Q, K + 1]: the query's own page first, then the top-K."""
    own = jnp.where(q_pos >= 0, q_pos // page_size, NO_PAGE)
    return jnp.concatenate([own[..., None], selected], axis=-1)


def entries_per_query(index_topk: int, page_size: int, table_pages: int, selection: str) -> int:
    """N, the attention entries a query carries: page mode, its own page and index_topk /
    page_size earlier pages; token mode, the distinct pages of its index_topk tokens, at most
    one a token and at most the pages of its table (`table_pages`: every shard's together)."""
    if selection == "page":
        return index_topk // page_size + 1
    return max(1, min(index_topk, table_pages))


def token_entries(tokens: jax.Array, page_size: int, entries: int
                  ) -> tuple[jax.Array, jax.Array]:
    """A token selection as attention entries: the distinct pages its tokens lie on, each with
    the mask of its selected tokens (kernels/reference.sparse_attention's `sel_masks`).

    tokens:  i32[B, Q, K] logical positions, NO_PAGE where none, distinct within a query
    entries: N, how many entries to keep; at least the distinct pages any query can have
             (`entries_per_query`)
    returns: pages i32[B, Q, N] ascending, NO_PAGE past the query's last, and masks
             i32[B, Q, N, W] (`reference.mask_words`), bit i % 32 of word i // 32 set where
             token i of the page is selected (the words' bits as uint32, bit-cast)
    """
    b, q, k = tokens.shape
    w = mask_words(page_size)
    t = jnp.sort(jnp.where(tokens >= 0, tokens, _LAST), axis=-1)            # [B, Q, K]
    valid = t != _LAST
    page = jnp.where(valid, t // page_size, NO_PAGE)
    previous = jnp.concatenate([jnp.full((b, q, 1), NO_PAGE, page.dtype), page[..., :-1]], -1)
    first = valid & (page != previous)
    entry = jnp.cumsum(first, axis=-1, dtype=jnp.int32) - 1                 # [B, Q, K]
    row = jnp.arange(b * q, dtype=jnp.int32).reshape(b, q, 1)
    at = jnp.where(valid & (entry < entries), row * entries + entry, b * q * entries)
    offset = t % page_size
    bit = jnp.left_shift(jnp.uint32(1), (offset % 32).astype(jnp.uint32))
    # Each token's bit is distinct within its page, so adding them is or-ing them.
    masks = jnp.zeros((b * q * entries, w), jnp.uint32).at[at, offset // 32].add(
        jnp.where(valid, bit, 0), mode="drop")
    pages = jnp.full((b * q * entries,), NO_PAGE, jnp.int32).at[
        jnp.where(first, at, b * q * entries)].set(page, mode="drop")
    return (pages.reshape(b, q, entries),
            lax.bitcast_convert_type(masks, jnp.int32).reshape(b, q, entries, w))
