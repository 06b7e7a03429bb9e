"""Needle contexts: a haystack, needles hidden at depths, and the questions that ask for them.

Two sources, one shape (`Context`): `recall_context` builds token contexts for the hand-built
retrieval model (cp_runtime/model/recall.py: fact tokens with clustered keys, a query token per
key); `text_context` builds RULER-style text for a real checkpoint's tokenizer (filler sentences,
a key-value sentence per needle, then "Question: ... Answer: ..."). benchmarks/niah.py runs them.

`shared_recall_model` builds the recall model once per process, for every benchmark that asks
(niah and selection in one `bench all` run).

A depth d puts a context's first needle after a fraction d of the haystack and the others every
`gap` tokens after it (a window of about 1/16 of the haystack); text needles move down to the
nearest sentence boundary.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from cp_runtime.config import ModelConfig
from cp_runtime.model.recall import RecallModel, build_recall_model
from cp_runtime.weights.checkpoint import HFTokenizer

__all__ = ["KEY_WORDS", "OBJECTS", "SUBJECTS", "VARIANTS", "VERBS", "Case", "Context",
           "ContextFn", "Probe", "Variant", "recall_context", "shared_recall_model", "text_context"]


@functools.lru_cache(maxsize=None)
def shared_recall_model(cfg: ModelConfig) -> RecallModel:
    """build_recall_model(cfg) with its defaults, built once per process: the build is seconds
    of work and its result never changes (its arrays are immutable)."""
    return build_recall_model(cfg)


@dataclasses.dataclass(frozen=True)
class Variant:
    """needles: facts hidden at the depth, each asked once; siblings: near-key distractor facts
    per needle, placed anywhere in the haystack; level: index into the recall model's key
    levels (`RecallLayout.rhos`) the needle keys come from (their siblings' cosine)."""

    name: str
    needles: int
    siblings: int
    level: int


VARIANTS = {
    "single": Variant("single", needles=1, siblings=0, level=0),
    "distract": Variant("distract", needles=2, siblings=3, level=2),
    "multi": Variant("multi", needles=4, siblings=0, level=0),
}


@dataclasses.dataclass(frozen=True)
class Probe:
    """A question appended to a context and the answer tokens it should produce."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Case:
    """One depth: the context is haystack[:start] + suffix (needles inserted at `start`...)."""

    depth: float
    start: int
    suffix: np.ndarray
    probes: tuple[Probe, ...]


@dataclasses.dataclass(frozen=True)
class Context:
    """One (variant, length): a haystack and its depth cases, sorted by `start`."""

    haystack: np.ndarray
    cases: tuple[Case, ...]

    @property
    def prefill_tokens(self) -> int:
        return len(self.haystack) + sum(len(c.suffix) for c in self.cases)


ContextFn = Callable[[Variant, int, tuple[float, ...], np.random.Generator], Context]


def _insertion_points(hay_len: int, depth: float, needles: int) -> np.ndarray:
    """Where a depth's needles go: the first after `depth` of the haystack, the rest every
    `gap` tokens after it (a window of about 1/16 of the haystack)."""
    gap = max(1, hay_len // (16 * needles))
    span = (needles - 1) * gap
    start = round(depth * (hay_len - span))
    return start + gap * np.arange(needles)


def _build_context(haystack: np.ndarray, depths: tuple[float, ...],
                   needles: list[list[np.ndarray]], probes: list[list[Probe]],
                   boundaries: np.ndarray | None = None) -> Context:
    """Insert each depth's needle token runs into the haystack; cases sorted by start.
    With `boundaries` (sorted allowed insertion indices, 0 included) each insertion point moves
    down to the nearest boundary."""
    cases = []
    for depth, runs, qs in zip(depths, needles, probes):
        points = _insertion_points(len(haystack), depth, len(runs))
        if boundaries is not None:
            points = boundaries[np.searchsorted(boundaries, points, side="right") - 1]
        pieces, prev = [], int(points[0])
        for point, run in zip(points, runs):
            pieces += [haystack[prev:point], run]
            prev = int(point)
        pieces.append(haystack[prev:])
        cases.append(Case(depth=depth, start=int(points[0]),
                          suffix=np.concatenate(pieces).astype(np.int32), probes=tuple(qs)))
    return Context(haystack=haystack, cases=tuple(sorted(cases, key=lambda c: c.start)))


def recall_context(model: RecallModel, variant: Variant, length: int,
                   depths: tuple[float, ...], rng: np.random.Generator) -> Context:
    """A recall-model context of `length` tokens (needles included; the question follows).

    Needle keys of one context come from distinct clusters; with siblings, every needle of
    every depth gets its own cluster, since all siblings live in the shared haystack."""
    lay = model.layout
    hay_len = length - variant.needles
    if hay_len < 16 * variant.needles:
        raise ValueError(f"length {length} is too short for {variant.needles} needles")
    n_cl = lay.clusters_per_level
    if variant.siblings:
        if len(depths) * variant.needles > n_cl:
            raise ValueError(f"variant {variant.name}: {len(depths)} depths x {variant.needles} "
                             f"needles need that many key clusters; the model has {n_cl}")
        if variant.siblings > lay.keys_per_cluster - 1:
            raise ValueError(f"variant {variant.name}: at most {lay.keys_per_cluster - 1} "
                             "siblings per needle")
        picks = rng.permutation(n_cl)[: len(depths) * variant.needles] + variant.level * n_cl
        clusters = picks.reshape(len(depths), variant.needles)
    else:
        total = len(lay.rhos) * n_cl
        clusters = np.stack([rng.permutation(total)[: variant.needles] for _ in depths])
    haystack = lay.filler(rng, hay_len)
    sibling_facts = []
    needles, probes = [], []
    for row in clusters:
        runs, qs = [], []
        for cluster in row:
            key = int(cluster) * lay.keys_per_cluster + int(rng.integers(lay.keys_per_cluster))
            value = int(rng.integers(lay.n_values))
            runs.append(np.asarray([lay.fact(key, value)], np.int32))
            qs.append(Probe(prompt=(lay.query(key),), answer=(lay.answer(value),)))
            others = [v for v in range(lay.n_values) if v != value]
            for sib in rng.permutation(lay.siblings(key))[: variant.siblings]:
                sibling_facts.append(lay.fact(int(sib), int(rng.choice(others))))
        needles.append(runs)
        probes.append(qs)
    if sibling_facts:
        haystack[rng.permutation(hay_len)[: len(sibling_facts)]] = sibling_facts
    return _build_context(haystack, depths, needles, probes)


# -- text needles for a real checkpoint ---------------------------------------------------
SUBJECTS = ("The old ferry", "A tired courier", "The village choir", "Our night porter",
             "The river pilot", "A patient gardener", "The station clock", "Every bookbinder")
VERBS = ("waited beside", "walked past", "sang about", "looked over", "talked about",
          "painted", "counted", "remembered")
OBJECTS = ("the grey harbour wall", "a crate of winter apples", "the narrow stone bridge",
            "three copper lanterns", "the market square at dawn", "a map of the coast",
            "the last train north", "an unfinished letter")
KEY_WORDS = ("amber", "cobalt", "falcon", "granite", "harbor", "juniper", "lantern", "marble",
              "nectar", "orchid", "pepper", "quartz", "saffron", "timber", "velvet", "willow")


def text_context(tokenizer: HFTokenizer, variant: Variant, length: int,
                 depths: tuple[float, ...], rng: np.random.Generator) -> Context:
    """RULER-style: `length` tokens of filler sentences, key-value needle sentences inserted at
    sentence boundaries (they add their own tokens), and a question whose answer is the value.
    Siblings: needle sentences whose key shares the first word, with other values. The context
    starts with the tokenizer's BOS token when it has one."""
    def enc(text: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(text), np.int32)

    def sentence(key: str, value: str) -> str:
        return f" The registered code for the {key} account is {value}."

    hay, n = [], 0
    while n < length:
        s = enc(f" {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}.")
        hay.append(s)
        n += len(s)
    needles, probes, siblings = [], [], []
    words = list(KEY_WORDS)
    for _ in depths:
        runs, qs = [], []
        for _ in range(variant.needles):
            first, second = rng.choice(words, 2, replace=False)
            key, value = f"{first}-{second}", str(rng.integers(1_000_000, 10_000_000))
            runs.append(enc(sentence(key, value)))
            question = (f"\nQuestion: what is the registered code for the {key} account?\n"
                        f"Answer: The registered code for the {key} account is")
            qs.append(Probe(prompt=tuple(enc(question).tolist()),
                            answer=tuple(enc(f" {value}").tolist())))
            for other in rng.permutation([w for w in words if w not in (first, second)])[
                    : variant.siblings]:
                siblings.append(enc(sentence(f"{first}-{other}",
                                             str(rng.integers(1_000_000, 10_000_000)))))
        needles.append(runs)
        probes.append(qs)
    for s in siblings:
        hay.insert(int(rng.integers(len(hay) + 1)), s)
    bos = tokenizer.bos_token_id
    head = [np.asarray([bos], np.int32)] if bos is not None else []
    haystack = np.concatenate(head + hay)[:length]
    bounds = np.concatenate([[0], np.cumsum([len(h) for h in head + hay])])
    return _build_context(haystack, depths, needles, probes, bounds[bounds <= length])
