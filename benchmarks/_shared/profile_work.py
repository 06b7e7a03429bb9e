"""What one profiled step is and the least it must cost: the step shapes (a decode step or a
prefill chunk at a context length, and the layers whose work it keeps) and the minimum bytes
and flops of each of its phases, for `cp-runtime bench profile` (profile.py).

Minimum work (minimum_work.py's accounting, all shards together; t the step's query positions,
ps the page size, K = index_topk / ps, L layers, F full layers, S shards):

    cache write      rows x bytes_per_token (cache/capacity.py)           no flops
    indexer          throughput.indexer_work: keys of every earlier page per query
    top-K, gather    F x (sum_t (t // ps) x 4 [scores read] + S (S - 1) K 8 x rows [received])
    attention        throughput.attention_work: own page + min(K, t // ps) pages per query;
                     pages read: a chunk's own pages + the K its first query selects
    merge            L x S x rows x H x (2 Dv + 1) x 4 bytes (read partials, write result),
                     L x S x rows x H x Dv x 2 flops (rescale and add)
    dense and MoE    throughput.projection_work, replicated on every shard (the CPU design);
                     for a prefill chunk it also counts the last layer's dropped projections
    sampling         its lm-head share of projection_work (1 logit row)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cp_runtime.benchmarks._shared.minimum_work import (Work, attention_work, cache_write_work,
                                                        indexer_work, projection_work)
from cp_runtime.cache.layout import cdiv
from cp_runtime.config import ModelConfig

__all__ = ["DECODE_PHASES", "LABELS", "PHASES", "PREFILL_PHASES", "StepShape", "phase_work",
           "step_shape"]

# (key, label) of each phase, in step order; host first (it precedes and follows the program).
PHASES = (("host", "host planning and dispatch"), ("cache_write", "cache write"),
          ("indexer", "indexer scoring"), ("top_k", "local top-K and all-gather"),
          ("attention", "sparse attention"), ("merge", "merge"),
          ("dense", "dense and MoE layers"), ("sampling", "sampling"))
DECODE_PHASES = tuple(key for key, _ in PHASES)
PREFILL_PHASES = tuple(key for key in DECODE_PHASES if key != "sampling")
LABELS = dict(PHASES)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One profiled step: a decode step or a prefill chunk that ends with `length` tokens in
    the session. It runs the queries at positions [start, length)."""

    kind: str            # "decode" or "prefill"
    length: int
    start: int

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.length)

    @property
    def phases(self) -> tuple[str, ...]:
        return DECODE_PHASES if self.kind == "decode" else PREFILL_PHASES

    def live_layers(self, model: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(layers whose attention output the step uses, full-layer slots whose selection they
        use). A decode step samples from the last layer, so every layer counts; a prefill
        chunk returns only the cache, so the last layer's attention (and a selection only it
        uses) is dead code that XLA drops from the step, and the profile drops it too."""
        layers = tuple(range(model.num_hidden_layers - (self.kind == "prefill")))
        return layers, tuple(sorted({model.indexer_slot(layer) for layer in layers}))


def step_shape(kind: str, length: int, chunk: int) -> StepShape:
    return StepShape(kind, length, length - 1 if kind == "decode" else max(0, length - chunk))

def phase_work(model: ModelConfig, shape: StepShape, *, page_size: int, kv_cache_dtype: str,
               shards: int, param_bytes: int, rows: int = 1) -> dict[str, Work]:
    """Minimum bytes and flops of each phase of one step, all shards together (module doc),
    over the layers the step keeps (StepShape.live_layers)."""
    t, ps, s = shape.positions, page_size, shards
    k = model.index_topk // ps
    layers, slots = shape.live_layers(model)
    live = len(layers) / model.num_hidden_layers                 # attention, merge
    live_full = len(slots) / model.num_full_layers              # indexer, top-K
    earlier = (t // ps) * ps                                      # keys of earlier pages
    selected = np.minimum(k, t // ps)
    own_pages = cdiv(shape.length, ps) - shape.start // ps
    queries = rows * len(t)
    merged = len(layers) * s * queries * model.num_attention_heads
    dv = model.kv_lora_rank
    dense = projection_work(model, queries, logit_rows=0, param_bytes=param_bytes, replicas=s)
    head = projection_work(model, queries, logit_rows=rows, param_bytes=param_bytes, replicas=s)
    work = {
        "host": Work(),
        "cache_write": cache_write_work(model, queries, kv_cache_dtype=kv_cache_dtype),
        "indexer": indexer_work(model, rows * int(earlier.sum()), rows * int(earlier.max()),
                                kv_cache_dtype=kv_cache_dtype).scaled(live_full),
        "top_k": Work(0, len(slots) * rows * (4 * int((t // ps).sum())
                                              + s * (s - 1) * k * 8 * len(t))),
        "attention": attention_work(model, rows * int((selected * ps + t % ps + 1).sum()),
                                    rows * (own_pages + int(selected[0])), page_size=ps,
                                    kv_cache_dtype=kv_cache_dtype).scaled(live),
        "merge": Work(merged * dv * 2, merged * (2 * dv + 1) * 4),
        "dense": dense,
        "sampling": Work(head.flops - dense.flops, head.bytes - dense.bytes),
    }
    return {key: work[key] for key in shape.phases}

