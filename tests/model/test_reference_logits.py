"""The runtime against transformers: tiny checkpoints written by transformers' own classes
(GlmMoeDsaForCausalLM, DeepseekV32ForCausalLM; tests/reference/build_fixtures.py, run in an
environment with torch), loaded here through the real loader, as `serve --checkpoint DIR` loads
them (WeightsSource -> read_hf_config, the tokenizer, CheckpointBlocks), and run by the engine:
the prompt (prefill), then teacher-forced decode steps, one token each.

Against transformers' logits (stored beside each checkpoint, tests/reference/fixtures/NAME/
reference.npz): with token selection (the model as trained) relative L2 <= 1e-4 and the same
argmax at every position, at S = 1 (weights whole) and S = 16 (weights split), f32 weights and
an f32 cache; transformers itself agrees with its own float64 run to ~5e-7 on these models
(reference.json), so 1e-4 leaves room for accumulation order only, not for a different formula
or a different selection (measured: 4.8e-7 to 6.9e-7 over both models, both S, prompt and
decode). Page selection (an approximation, a different model) is measured and printed, not
asserted.

No torch here: the default suite reads the stored files only.

    glm-moe-dsa    4 layers (1 dense, 3 MoE in 4 groups of 2, top-2 groups), IndexShare
                   (layers 1 and 3 reuse layers 0 and 2's selection), interleaved rope in MLA
                   and indexer (config.json names neither), rms_norm_eps 1e-5
    deepseek-v32   3 layers (1 dense, 2 MoE, same groups), an indexer in each, YaRN rope with
                   mscale != mscale_all_dim, rms_norm_eps 1e-6
    both           prompt 256 tokens, index_topk 32, 4 decode steps, vocabulary 256; the MLA
                   down projections' outputs small (mean square ~1e-4), so the inner norms'
                   eps (1e-6, not rms_norm_eps) shows in the logits
"""

import json
import pathlib

import numpy as np
import pytest
from conftest import rel_l2

from cp_runtime.config import RuntimeConfig
from cp_runtime.engine.core import Engine
from cp_runtime.engine.executor import LocalExecutor
from cp_runtime.model.source import WeightsSource

FIXTURES = pathlib.Path(__file__).parents[1] / "reference" / "fixtures"
MODELS = ("glm-moe-dsa", "deepseek-v32")
BOUND = 1e-4               # rel-L2 of the logits against transformers, token selection
PAGE_SIZE = 16


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as z:
        return {k: z[k] for k in z.files}


def engine_for(name: str, shards: int, selection: str) -> Engine:
    """An engine over the checkpoint as `serve --checkpoint` loads it: f32 weights, f32 cache;
    weights whole at S = 1, split at S = 16. Chunks of 128 tokens: the prompt's second chunk
    selects among keys the first wrote to the cache."""
    loaded = WeightsSource(checkpoint=str(FIXTURES / name)).load()
    cfg = loaded.config
    ref = reference(name)
    pages = -(-(ref["prompt_ids"].size + ref["decode_ids"].size) // PAGE_SIZE)
    rt = RuntimeConfig(model=cfg.name, kv_cache_dtype="f32", num_shards=shards,
                       pages_per_shard=-(-pages // shards) + 1, page_size=PAGE_SIZE,
                       chunk_size=128, max_batch=1,
                       weights="replicated" if shards == 1 else "sharded",
                       weight_dtype="f32", selection=selection)
    return Engine(cfg, rt, LocalExecutor(cfg, rt, loaded.weights))


def run(engine: Engine, ref: dict) -> tuple[np.ndarray, np.ndarray]:
    """(prompt logits f32[T, V] from the prefill, decode logits f32[N, V] from N teacher-forced
    one-token decode steps)."""
    s = engine.create_session()
    prompt = np.asarray(engine.extend(s.id, ref["prompt_ids"].tolist(), all_logits=True))
    steps = [np.asarray(engine.decode([s.id], [int(t)]))[0] for t in ref["decode_ids"]]
    return prompt, np.stack(steps)


def compare(name: str, shards: int, selection: str) -> dict[str, tuple[float, float]]:
    """{"prompt" | "decode": (rel-L2 against transformers, share of positions whose argmax
    agrees)}, printed."""
    ref = reference(name)
    prompt, decode = run(engine_for(name, shards, selection), ref)
    out = {}
    for part, got in (("prompt", prompt), ("decode", decode)):
        want = ref[f"{part}_logits"]
        assert got.shape == want.shape, (part, got.shape, want.shape)
        agree = float(np.mean(got.argmax(-1) == ref[f"{part}_argmax"]))
        out[part] = (rel_l2(got, want), agree)
    print(f"{name} S={shards} {selection}: " + ", ".join(
        f"{part} rel-L2 {err:.2e} argmax {agree:.3f}" for part, (err, agree) in out.items()))
    return out


def test_fixtures_are_transformers_own():
    """The stored checkpoints are what transformers 5 wrote (its names, f32, `dtype`), and
    transformers agreed with itself (cached decode vs one pass; f32 vs f64)."""
    for name in MODELS:
        meta = json.loads((FIXTURES / name / "reference.json").read_text())
        assert meta["versions"]["transformers"].startswith("5.")
        assert meta["decode_cached_vs_uncached_rel_l2"] < 1e-5
        assert max(meta["f32_vs_f64_rel_l2"].values()) < 1e-5
        hf = json.loads((FIXTURES / name / "config.json").read_text())
        assert hf["dtype"] == "float32" and "torch_dtype" not in hf
        assert "indexer_rope_interleave" not in hf and "rope_interleave" not in hf
        ref = reference(name)
        assert ref["prompt_ids"].size >= 8 * meta["index_topk"]      # selection matters
        cfg = WeightsSource(checkpoint=str(FIXTURES / name)).config()
        assert cfg.weight_dtype == "f32" and cfg.index_topk == meta["index_topk"]


# Each case builds an engine and compiles its prefill and decode steps (~10 s on the 2-core
# machine): the default suite runs GLM-5's layout at S = 16 (weights split, as served) and
# DeepSeek-V3.2's at S = 1 (weights whole), the slow run the other two.
@pytest.mark.parametrize("name, shards", [
    ("glm-moe-dsa", 16), ("deepseek-v32", 1),
    pytest.param("glm-moe-dsa", 1, marks=pytest.mark.slow),
    pytest.param("deepseek-v32", 16, marks=pytest.mark.slow)])
def test_token_selection_matches_transformers(name, shards):
    """Token selection: the logits of every prompt position and decode step within 1e-4 of
    transformers', and the same argmax at each."""
    got = compare(name, shards, "token")
    for part, (err, agree) in got.items():
        assert err <= BOUND, f"{name} S={shards} {part}: rel-L2 {err:.3e} > {BOUND}"
        assert agree == 1.0, f"{name} S={shards} {part}: argmax agrees at {agree:.3f}"


@pytest.mark.slow         # a measurement, not a check: kept out of the default suite's budget
@pytest.mark.parametrize("name", MODELS)
def test_page_selection_distance_is_reported(name):
    """Page selection serves another model (its own page and the index_topk / page_size pages
    ranked by their best token): its distance from transformers is printed (pytest -s), not
    bounded. Measured at S = 16: rel-L2 0.80 (GLM, argmax agreeing at 30% of the prompt's
    positions), 0.67 (DeepSeek, 34%)."""
    got = compare(name, 16, "page")
    assert all(np.isfinite(err) for err, _ in got.values())
