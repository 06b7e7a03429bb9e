"""The hand-built recall model and the needle / selection benchmarks' core functions.

The model must answer through the serving path (S = 1 and S = 16, bf16 and fp8_e4m3 caches),
and must fail when the needle's page cannot be selected: with the indexer blinded, or with hub
pages filling the top-K. The collapse checks use the dense oracle (the paged path equals it,
tests/model/test_paged_model.py), so they need no engine.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.benchmarks._shared.needles import Probe, Variant, recall_context
from cp_runtime.benchmarks._shared.results import parse_length
from cp_runtime.benchmarks.indexer_cache_dtype import round_keys, selection_change, top_pages
from cp_runtime.benchmarks.niah import run_context, score_probes
from cp_runtime.model.recall import build_recall_model
from conftest import make_engine
from cp_runtime.model.indexer_inputs import IndexerInputs
from cp_runtime.model.oracle import oracle_logits
from cp_runtime.weights.params import param_shapes

PAGE = 16


@pytest.fixture(scope="module")
def recall():
    return build_recall_model()


def test_weights_match_the_config(recall):
    shapes = param_shapes(recall.cfg)
    assert list(recall.params) == list(shapes)
    assert all(recall.params[n].shape == s for n, s in shapes.items())


# Two depths x 2 needles, each needle with 2 siblings at cosine 0.9 scattered in the haystack:
# far enough apart (6.4 logits) that e4m3 rounding (0.5 logits std) cannot swap them.
NEAR = Variant("test", needles=2, siblings=2, level=0)


# bf16 at 16 shards runs with the slow tests: fp8 (the default) crosses 16 shards, bf16 one.
@pytest.mark.parametrize("shards, dtype", [(1, "bf16"), (1, "fp8_e4m3"), (16, "fp8_e4m3"),
                                           pytest.param(16, "bf16", marks=pytest.mark.slow)])
def test_answers_through_the_engine(recall, shards, dtype):
    ctx = recall_context(recall, NEAR, 512, (0.1, 0.6), np.random.default_rng(3))
    engine = make_engine(recall.cfg, recall.params, kv_cache_dtype=dtype, num_shards=shards,
                         page_size=PAGE, pages_per_shard=max(8, 160 // shards), chunk_size=512)
    per_case, baseline = run_context(engine, ctx)
    assert [[s.correct for s in case] for case in per_case] == [[True, True]] * 2
    # Without the needle the question is answered from a sibling (another value): wrong.
    assert not any(s.correct for case in baseline for s in case)
    assert all(s.logprob > -0.01 for case in per_case for s in case)
    assert engine.allocator.num_used() == 0            # every fork and root was closed


def test_multi_token_probes_score_like_decode(recall):
    """The extend path (used for text questions) agrees with the batched decode path."""
    ctx = recall_context(recall, Variant("one", 1, 0, 0), 256, (0.3,),
                         np.random.default_rng(5))
    case = ctx.cases[0]
    engine = make_engine(recall.cfg, recall.params, kv_cache_dtype="bf16", num_shards=1,
                         page_size=PAGE, pages_per_shard=64, chunk_size=256)
    session = engine.create_session()
    engine.extend(session.id, np.concatenate([ctx.haystack[: case.start], case.suffix]).tolist())
    probe = case.probes[0]
    padded = Probe(prompt=(recall.layout.filler(np.random.default_rng(0), 1)[0], *probe.prompt),
                   answer=probe.answer)
    # A wrong answer has a large negative log-prob: a sharper comparison than a right one (~0).
    wrong = Probe(prompt=probe.prompt, answer=(recall.layout.answer(0) if probe.answer[0] !=
                                               recall.layout.answer(0) else
                                               recall.layout.answer(1),))
    fast, fast_wrong = score_probes(engine, session.id, [probe, wrong])
    slow, slow_wrong, slow_padded = score_probes(engine, session.id, [probe, wrong, padded])
    assert fast.correct and slow.correct and slow_padded.correct
    assert not (fast_wrong.correct or slow_wrong.correct)
    assert fast_wrong.logprob < -10
    # Prefill and decode differ only in accumulation order (bf16 cache, f32 math).
    assert slow.logprob == pytest.approx(fast.logprob, abs=1e-4)
    assert slow_wrong.logprob == pytest.approx(fast_wrong.logprob, rel=1e-4)
    engine.close_session(session.id)
    assert engine.allocator.num_used() == 0


def _needle_trials(recall, n: int, *, hubs: int = 0, seed: int = 0, hub_stride: int = 2 * PAGE):
    """n contexts of 512 tokens: one needle on page 20, `hubs` hub tokens `hub_stride` apart
    (on pages 2, 4, ... by default; before the needle), the question at the end. Returns
    (tokens i32[512], answer id)."""
    lay = recall.layout
    rng = np.random.default_rng(seed)
    out = []
    for key in rng.permutation(lay.n_keys)[:n]:
        value = int(rng.integers(lay.n_values))
        tokens = lay.filler(rng, 511)
        tokens[20 * PAGE + 5] = lay.fact(int(key), value)
        tokens[[hub_stride * (i + 1) + 3 for i in range(hubs)]] = lay.hub
        out.append((np.append(tokens, lay.query(int(key))), lay.answer(value)))
    return out


def _recalled(params, cfg, trials, selection: str = "token") -> int:
    hits = 0
    for tokens, answer in trials:
        logits = oracle_logits(params, jnp.asarray(tokens), cfg=cfg, page_size=PAGE,
                               kv_cache_dtype="bf16", selection=selection)
        hits += int(np.argmax(logits[-1])) == answer
    return hits


def test_collapses_when_the_indexer_is_blind(recall):
    trials = _needle_trials(recall, 4)
    assert _recalled(recall.params, recall.cfg, trials) == 4
    # weights_proj = 0: every page scores 0, the top-K are the first K pages, not the needle's.
    blind = dict(recall.params)
    name = "model.layers.0.self_attn.indexer.weights_proj.weight"
    blind[name] = jnp.zeros_like(blind[name])
    assert _recalled(blind, recall.cfg, trials) == 0


@pytest.mark.parametrize("selection", ["token", "page"])
def test_collapses_when_hubs_fill_the_top_k(recall, selection):
    """index_topk hub tokens (token selection; one a page, index_topk / ps pages, in page
    selection) crowd the needle out of the top-k; one fewer, or one more of budget, and it is
    back."""
    k, stride = ((recall.cfg.index_topk, 1) if selection == "token"
                 else (recall.cfg.index_topk // PAGE, 2 * PAGE))
    fewer = _needle_trials(recall, 4, hubs=k - 1, hub_stride=stride)
    assert _recalled(recall.params, recall.cfg, fewer, selection) == 4
    crowded = _needle_trials(recall, 4, hubs=k, hub_stride=stride)
    assert _recalled(recall.params, recall.cfg, crowded, selection) == 0
    wider = dataclasses.replace(recall.cfg, index_topk=recall.cfg.index_topk + PAGE)
    assert _recalled(recall.params, wider, crowded, selection) == 4


def test_selection_change_counts_sets():
    ref = np.array([[1, 2], [3, 4], [5, 6], [0, -1]])
    test = np.array([[2, 1], [3, 7], [8, 9], [1, -1]])
    change = selection_change(ref, test)
    assert (change.queries, change.changed) == (3, 2)   # the row with a free slot is skipped
    assert change.swapped == pytest.approx((0 + 0.5 + 1.0) / 3)
    # A row whose query had only K earlier pages to choose from is skipped too.
    assert selection_change(ref, test, np.array([2, 3, 3, 1])).queries == 2


def test_selection_change_on_random_keys():
    rng = np.random.default_rng(0)
    t, hi, di = 256, 2, 32
    index = IndexerInputs(q=jnp.asarray(rng.normal(size=(t, hi, di)), jnp.float32),
                          w=jnp.asarray(rng.uniform(0.5, 1.0, size=(t, hi)), jnp.float32),
                          k=jnp.asarray(rng.normal(size=(t, di)), jnp.float32))

    def pages(scheme):
        return np.asarray(top_pages(dataclasses.replace(index, k=round_keys(index.k, scheme)),
                                    page_size=PAGE, k=4))

    ref = pages("bf16")
    earlier = np.arange(t) // PAGE
    assert selection_change(ref, ref, earlier).changed == 0
    for scheme in ("f32", "fp8_e4m3", "fp8_e4m3_tok", "fp8_e5m2"):
        change = selection_change(ref, pages(scheme), earlier)
        assert change.queries == t - 5 * PAGE         # queries with more than 4 earlier pages
        assert 0.0 <= change.swapped <= change.changed_fraction <= 1.0
    # e5m2 keys (2 mantissa bits) move the selection, bf16 vs f32 hardly.
    e5m2 = selection_change(ref, pages("fp8_e5m2"), earlier).changed
    assert 0 < e5m2
    assert selection_change(ref, pages("f32"), earlier).changed < e5m2


def test_parse_length():
    assert [parse_length(x) for x in ("8k", "1m", "5000", "16K")] == [8192, 1 << 20, 5000,
                                                                         16384]
    with pytest.raises(ValueError, match="bad length"):
        parse_length("8 kb")


@pytest.mark.slow
def test_needles_at_half_and_one_million_tokens(tmp_path):
    """The needle sweep at 512K and 1M tokens (3 depths, every variant, bf16 and fp8_e4m3,
    S = 16): 24M prefill tokens, about 11 min on a 2-core CPU. Bounds from the measured run:
    every needle found except the fp8 distractor case, which lost 1 of 12 there (and 5 of 50
    at 8K-128K); the needle is what answers (never right without it)."""
    from cp_runtime.benchmarks import niah

    assert niah.main(["--lengths", "512k,1m", "--depths", "3", "--kv-cache-dtypes",
                      "bf16,fp8_e4m3", "--shards", "16", "--out", str(tmp_path),
                      "--no-progress"]) == 0
    report = json.loads((tmp_path / "niah.json").read_text())
    for row in report["summary"]:
        correct, trials = map(int, row["recall"].split("/"))
        assert row["no_needle"] == f"0/{trials}", row
        near_keys_in_fp8 = row["variant"] == "distract" and row["dtype"] == "fp8_e4m3"
        assert correct >= (trials - 2 if near_keys_in_fp8 else trials), row
