"""How often a narrower indexer key cache changes the DSA page selection, and what that does to
recall: the measurement behind keeping the indexer cache bf16 (cp_runtime/dtypes.py).

The runtime stores each token's indexer key k (after LayerNorm, RoPE and Hadamard) in the cache;
the query side stays f32. Here the same keys are rounded through each storage scheme and the
top-K earlier pages of every query are recomputed offline with the oracle's functions:

    bf16              the runtime's indexer cache (the reference)
    f32               no rounding (how far bf16 itself is from exact)
    fp8_e4m3          k stored in e4m3, no scale
    fp8_e4m3_tok      k / amax(|k|) stored in e4m3, the per-token scale amax kept in f32
    fp8_e4m3_tok448   k * 448 / amax(|k|) in e4m3 (the scale maps amax to e4m3's largest
                      normal, so small entries stay out of the subnormal range)
    fp8_e5m2          k stored in e5m2, no scale

Per scheme, against bf16: the fraction of queries whose selected set differs, and the mean
fraction of the K selected pages swapped. Only queries with more than K earlier pages count
(with fewer, every earlier page is selected whatever the scores).

Inputs: (1) the random-weight `tiny` model on random tokens, every query of every `full` layer
(random weights give many near-ties: a worst case for flips); (2) the recall model
(cp_runtime/model/recall.py) at the question of needle contexts whose needle has `siblings`
near-key distractors (cosine 0.98) scattered in the haystack. For (2) the answer is also
computed with each scheme's selection (latent cache bf16, so only the indexer differs), for
several index_topk values: when K is smaller than the number of fact pages, a flip in the
indexer's ranking decides whether the needle is read at all.

Measured with the defaults (page_size 16; tiny: 3 seeds x 2 full layers x 2048 tokens, K = 4;
recall model: 64 contexts of 2048 tokens, 7 siblings):
    tiny, queries whose top-4 changed vs bf16: f32 1.7%, e4m3 20.7% (5.3% of pages swapped),
    e4m3 per-token scale 17.9% (4.5%), e4m3 scaled to 448 18.5% (4.7%), e5m2 37.8% (10.0%)
    recall model, recall at K = 1 / 2 / 4: bf16 and f32 64/64 at every K; e4m3 54 / 62 / 63;
    e4m3 per-token scale 61 / 63 / 64; e5m2 36 / 41 / 49 (of 64)
A per-token scale recovers part of e4m3's loss, not all of it; bf16 loses nothing here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.needles import Variant, recall_context, shared_recall_model
from cp_runtime.benchmarks._shared.results import print_table, write_json
from cp_runtime.cli.args import check_not_below_page, length, length_list, positive_int
from cp_runtime.config import ModelConfig, load_model_config
from cp_runtime.dtypes import latent_cache_dtype
from cp_runtime.model.attention_inputs import indexer_inputs, mla_inputs
from cp_runtime.model.indexer_inputs import IndexerInputs
from cp_runtime.model.layers import forward
from cp_runtime.model.ops import logits, rms_norm
from cp_runtime.model.oracle import (dense_sparse_attention, page_scores, selection_mask,
                                     token_scores)
from cp_runtime.parallel.selection import NO_PAGE, earlier_pages_mask, rank_pages
from cp_runtime.weights.params import Params, init_params, layer_params, model_layout

__all__ = ["SCHEMES", "round_keys", "top_pages", "SelectionChange", "selection_change",
           "indexer_inputs_of", "last_token_answers", "build_parser", "parse_args", "main"]

E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
SCHEMES = ("bf16", "f32", "fp8_e4m3", "fp8_e4m3_tok", "fp8_e4m3_tok448", "fp8_e5m2")
REFERENCE = "bf16"
QUICK = {"tokens": ("2048", "1024"), "seeds": ("3", "1"), "recall_trials": ("64", "24")}


def round_keys(k: jax.Array, scheme: str) -> jax.Array:
    """k f32[..., D] as read back from a cache stored under `scheme`, f32[..., D]."""
    k = k.astype(jnp.float32)
    if scheme == "f32":
        return k
    if scheme in ("bf16", "fp8_e4m3", "fp8_e5m2"):
        dtype = {"bf16": jnp.bfloat16, "fp8_e4m3": jnp.float8_e4m3fn,
                 "fp8_e5m2": jnp.float8_e5m2}[scheme]
        return k.astype(dtype).astype(jnp.float32)
    if scheme in ("fp8_e4m3_tok", "fp8_e4m3_tok448"):
        target = 1.0 if scheme == "fp8_e4m3_tok" else E4M3_MAX
        amax = jnp.max(jnp.abs(k), axis=-1, keepdims=True)
        scale = jnp.where(amax > 0, amax / target, 1.0)                # f32[..., 1], kept
        return (k / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    raise ValueError(f"unknown key scheme {scheme!r}; choices: {', '.join(SCHEMES)}")


@functools.partial(jax.jit, static_argnames=("page_size", "k"))
def top_pages(index: IndexerInputs, *, page_size: int, k: int) -> jax.Array:
    """The top-k earlier pages of every query, i32[T, k] (NO_PAGE past the earlier pages)."""
    pscores = page_scores(token_scores(index), page_size)                   # [T, n]
    pages = jnp.broadcast_to(jnp.arange(pscores.shape[1], dtype=jnp.int32), pscores.shape)
    pos = jnp.arange(pscores.shape[0], dtype=jnp.int32)
    eligible = earlier_pages_mask(pages, pos, page_size)
    return rank_pages(jnp.where(eligible, pscores, -jnp.inf), pages, k)[1]


@dataclasses.dataclass(frozen=True)
class SelectionChange:
    """queries: queries with a full K to choose; changed: how many chose a different set;
    swapped: mean over those queries of (pages in ref not in test) / K."""

    queries: int
    changed: int
    swapped: float

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.queries if self.queries else 0.0


def selection_change(ref: np.ndarray, test: np.ndarray,
                     candidates: np.ndarray | None = None) -> SelectionChange:
    """Compare two selections i32[Q, K] row by row, as sets.

    candidates: i32[Q] earlier pages each query could choose from; rows with at most K are
    skipped (everything is selected there). Without it, rows holding NO_PAGE are skipped."""
    ref, test = np.asarray(ref), np.asarray(test)
    if ref.shape != test.shape or ref.ndim != 2:
        raise ValueError(f"selections {ref.shape} and {test.shape} must be the same [Q, K]")
    k = ref.shape[1]
    full = (ref != NO_PAGE).all(-1)
    if candidates is not None:
        full &= np.asarray(candidates) > k
    missing = np.array([len(set(a) - set(b)) for a, b in zip(ref[full], test[full])])
    return SelectionChange(queries=int(full.sum()), changed=int((missing > 0).sum()),
                           swapped=float(missing.mean() / k) if len(missing) else 0.0)


def indexer_inputs_of(params: Params, cfg: ModelConfig, tokens: jax.Array, *, page_size: int,
                      kv_cache_dtype: str = "bf16") -> list[IndexerInputs]:
    """The indexer inputs of every `full` layer along the oracle's forward pass (selection from
    bf16 keys, latents rounded to `kv_cache_dtype`), one sequence of T tokens."""
    return list(_indexer_inputs_of(params, tokens, cfg=cfg, page_size=page_size,
                                   kv_cache_dtype=kv_cache_dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "kv_cache_dtype"))
def _indexer_inputs_of(params, tokens, *, cfg, page_size, kv_cache_dtype):
    latent_dtype = latent_cache_dtype(kv_cache_dtype)
    k_pages = cfg.index_topk // page_size

    def attend(layer, state, q_row, kv_row, index, project):
        mask, seen = state
        if index is not None:
            seen = seen + (index,)
            rounded = IndexerInputs(q=index.q, w=index.w, k=round_keys(index.k, REFERENCE))
            mask = selection_mask(token_scores(rounded), page_size, k_pages)
        kv = kv_row.astype(latent_dtype).astype(kv_row.dtype)
        o = dense_sparse_attention(q_row, kv, mask, value_dim=cfg.kv_lora_rank,
                                   scale=cfg.softmax_scale)
        return project(o), (mask, seen)

    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    _, (_, seen) = forward(params, cfg, tokens, pos, attend, (None, ()))
    return seen


@functools.partial(jax.jit, static_argnames=("cfg", "page_size", "k_pages", "schemes",
                                             "latent_dtype"))
def last_token_answers(params: Params, tokens: jax.Array, *, cfg: ModelConfig, page_size: int,
                       k_pages: int, schemes: tuple[str, ...], latent_dtype: str = "bf16"
                       ) -> tuple[jax.Array, jax.Array]:
    """Per scheme of `schemes`, the logits f32[V] of the last token and its top pages
    i32[k_pages] with indexer keys read back under that scheme, stacked: f32[len(schemes), V]
    and i32[len(schemes), k_pages]. All schemes in one program (one compile, not one each).
    One-layer models only: layer 0's cache rows depend on the tokens alone, so the last token
    runs as a decode step over them."""
    if cfg.num_hidden_layers != 1:
        raise ValueError(f"{cfg.name}: last_token_answers needs a one-layer model")
    t = tokens.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    p = layer_params(params, 0)
    h = rms_norm(params["model.embed_tokens.weight"][tokens], p["input_layernorm.weight"],
                 cfg.rms_norm_eps)
    _, kv_rows, q_lora = mla_inputs(p, cfg, h, pos)                     # [T, D]
    raw_keys = indexer_inputs(p, cfg, h, q_lora, pos).k                 # [T, Di]
    kv_rows = kv_rows.astype(latent_cache_dtype(latent_dtype)).astype(jnp.float32)
    own = (t - 1) // page_size
    key_page = jnp.arange(t) // page_size

    def answer(keys):
        def attend(layer, chosen, q_row, kv_row, index, project):        # one query [1, ...]
            logit = jnp.einsum("hd,sd->hs", index.q[0], keys)
            scores = jnp.einsum("hs,h->s", jax.nn.relu(logit), index.w[0])   # [T]
            n = own + 1
            pscores = jnp.pad(scores, (0, n * page_size - t), constant_values=-jnp.inf
                              ).reshape(n, page_size).max(-1)            # [T] -> [n, ps] -> [n]
            pages = jnp.arange(n, dtype=jnp.int32)
            top = rank_pages(jnp.where(pages < own, pscores, -jnp.inf), pages, k_pages)[1]
            mask = (key_page[:, None] == top[None]).any(-1) | (key_page == own)
            o = dense_sparse_attention(q_row, kv_rows, mask[None], value_dim=cfg.kv_lora_rank,
                                       scale=cfg.softmax_scale)
            return project(o), top

        hidden, top = forward(params, cfg, tokens[-1:], pos[-1:], attend, None)
        return logits(params, hidden)[0], top

    answers = [answer(round_keys(raw_keys, scheme)) for scheme in schemes]
    return jnp.stack([a[0] for a in answers]), jnp.stack([a[1] for a in answers])


# -- the study ----------------------------------------------------------------------------
def tiny_study(args) -> list[dict]:
    """Selection changes on the random-weight `--model` (tiny by default), every query of every
    full layer."""
    cfg = load_model_config(args.model)
    k_pages = cfg.index_topk // args.page_size
    totals = {s: [0, 0, 0.0] for s in SCHEMES if s != REFERENCE}
    for seed in range(args.seeds):
        params = model_layout(init_params(cfg, seed), cfg)
        tokens = jax.random.randint(jax.random.key(1000 + seed), (args.tokens,), 0,
                                    cfg.vocab_size)
        for index in indexer_inputs_of(params, cfg, tokens, page_size=args.page_size):
            ref = top_pages(dataclasses.replace(index, k=round_keys(index.k, REFERENCE)),
                            page_size=args.page_size, k=k_pages)
            for scheme, acc in totals.items():
                test = top_pages(dataclasses.replace(index, k=round_keys(index.k, scheme)),
                                 page_size=args.page_size, k=k_pages)
                change = selection_change(ref, test, np.arange(args.tokens) // args.page_size)
                acc[0] += change.queries
                acc[1] += change.changed
                acc[2] += change.swapped * change.queries
    return [{"model": cfg.name, "index_topk": cfg.index_topk, "scheme": s, "queries": q,
             "changed": f"{c}/{q}", "changed_pct": 100.0 * c / q,
             "swapped_pct": 100.0 * w / q} for s, (q, c, w) in totals.items()]


def recall_study(args) -> tuple[list[dict], list[dict]]:
    """Selection changes at the question, and recall, on the recall model per index_topk."""
    model = shared_recall_model(load_model_config("recall"))
    variant = Variant("selection", needles=1, siblings=args.siblings, level=2)
    rng = np.random.default_rng(args.seed)
    trials = []
    for _ in range(args.recall_trials):
        depth = float(rng.uniform(0.0, 0.9))         # keep the needle off the question's page
        ctx = recall_context(model, variant, args.recall_length, (depth,), rng)
        case = ctx.cases[0]
        probe = case.probes[0]
        tokens = np.concatenate([ctx.haystack[: case.start], case.suffix, probe.prompt])
        trials.append((jnp.asarray(tokens, jnp.int32), probe.answer[0]))
    sel_rows, recall_rows = [], []
    for topk in args.topks:
        k_pages = topk // args.page_size
        out = [last_token_answers(model.params, toks, cfg=model.cfg, page_size=args.page_size,
                                  k_pages=k_pages, schemes=SCHEMES) for toks, _ in trials]
        results = {}
        for i, scheme in enumerate(SCHEMES):
            correct = sum(int(np.argmax(lg[i])) == ans for (lg, _), (_, ans) in zip(out, trials))
            results[scheme] = (np.stack([np.asarray(top[i]) for _, top in out]), correct)
        ref = results[REFERENCE][0]
        for scheme, (tops, correct) in results.items():
            recall_rows.append({"index_topk": topk, "K": k_pages, "scheme": scheme,
                                "recall": f"{correct}/{len(trials)}"})
            if scheme != REFERENCE:
                change = selection_change(ref, tops)
                sel_rows.append({"model": f"recall (question, {args.siblings} siblings)",
                                 "index_topk": topk, "scheme": scheme, "queries": change.queries,
                                 "changed": f"{change.changed}/{change.queries}",
                                 "changed_pct": 100.0 * change.changed_fraction,
                                 "swapped_pct": 100.0 * change.swapped})
    return sel_rows, recall_rows


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("selection", "How often an fp8 indexer key cache changes the DSA top-K "
                                     "pages compared with bf16, and what that does to recall.",
                        quick="fewer seeds, tokens and trials (explicit flags win)",
                        quick_values=QUICK, check=_check)
    p.add_argument("--tokens", type=length, help="sequence length for the random-weight --model")
    p.add_argument("--seeds", type=positive_int, help="--model weight seeds")
    p.add_argument("--recall-trials", type=positive_int, help="needle contexts")
    p.add_argument("--recall-length", type=length, default=2048, help="needle context length")
    p.add_argument("--siblings", type=_siblings, default=7,
                   help="near-key distractors per needle (0 to 7)")
    p.add_argument("--topks", type=length_list, default="16,32,64", metavar="N[,N...]",
                   help="index_topk values for the recall model, multiples of --page-size "
                        "(K = topk / page_size)")
    p.add_shared(model="tiny", page_size=16, seed="the needle contexts", out="out/selection",
                 progress=True)
    return p


def _siblings(text: str) -> int:
    """argparse type: a sibling count in 0..7 (the recall layout's limit)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= n <= 7:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 to 7")
    return n


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    check_not_below_page(parser, "--tokens", args.tokens, args.page_size)
    check_not_below_page(parser, "--recall-length", args.recall_length, args.page_size)
    bad = [t for t in args.topks if t % args.page_size]
    if bad:
        parser.error(f"--topks {bad[0]}: not a multiple of --page-size {args.page_size}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), `--quick` applied to the flags left unset,
    `--out` created."""
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tiny_rows = tiny_study(args)
    sel_rows, recall_rows = recall_study(args)
    columns = ["model", "index_topk", "scheme", "changed", "changed_pct", "swapped_pct"]
    print_table(tiny_rows + sel_rows, columns,
                title=f"selection vs a bf16 indexer cache (page_size {args.page_size}; "
                      "changed = queries whose top-K set differs)")
    print()
    print_table(recall_rows, ["index_topk", "K", "scheme", "recall"],
                title=f"recall model, {args.siblings} siblings at cosine 0.98, latent bf16, "
                      f"{args.recall_length} tokens")
    path = write_json(args.out / "selection.json",
                      {"page_size": args.page_size, "tiny_tokens": args.tokens,
                       "tiny_seeds": args.seeds, "recall_trials": args.recall_trials,
                       "recall_length": args.recall_length, "siblings": args.siblings,
                       "selection": tiny_rows + sel_rows, "recall": recall_rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
