"""Step plans from engine rows: the host arrays of one `Segment` (cp_runtime.engine.step).

A row is `tokens` of one session written from position `start`; a segment pads its rows to a
power-of-two count and a common width, and its page table to S * 2^k entries, so step shapes
(and compiles) stay few. Page tables are in rotated coordinates (cp_runtime.cache.layout) and
stop at each row's last token: later pages hold no keys yet, and the indexer's work grows with the
table width.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cp_runtime.cache.layout import cdiv, rotated_row
from cp_runtime.cache.pages import PageTable
from cp_runtime.engine.requests import SamplingParams
from cp_runtime.engine.step import Segment, StepInputs
from cp_runtime.model.sampler import (BIAS_SLOTS, MAX_TOP_LOGPROBS, PENALTY_WINDOW,
                                      SamplingArrays)

__all__ = ["Row", "bucket", "build_segment", "sampling_arrays"]


@dataclasses.dataclass(frozen=True)
class Row:
    """`tokens` written from position `start` of the session whose pages are `table`."""

    table: PageTable
    tokens: list[int]
    start: int


def bucket(n: int, multiple: int) -> int:
    """Round n up to multiple * 2^k."""
    size = multiple
    while size < n:
        size *= 2
    return size


def sampling_arrays(params: list[SamplingParams], seeds: list[int],
                    produced: list[int] | None = None,
                    logs: list[list[int]] | None = None) -> SamplingArrays:
    """Per-row sampling settings, padded like the rows (padding rows are greedy).

    produced: tokens each row's generation has made so far (0s if None): until `min_tokens`
    its `stop` ids are banned (bias -inf); logs: each row's session log (prompt and output,
    the output last), whose last PENALTY_WINDOW ids a penalised row carries. The token lists
    are there only when some row needs them (sampler's module docstring): `history` [B, 0]
    without penalties, `bias_ids` [B, 0] without bias or bans, no alternatives unless a row
    asks for top log-probabilities."""
    produced = produced or [0] * len(params)
    bans = [p.stop if made < p.min_tokens else () for p, made in zip(params, produced)]
    penalized = any(p.penalized for p in params)
    biased = any(p.logit_bias or ban for p, ban in zip(params, bans))
    arrays = SamplingArrays.greedy(
        bucket(len(params), 1), window=PENALTY_WINDOW if penalized else 0,
        bias_slots=BIAS_SLOTS if biased else 0,
        alternatives=MAX_TOP_LOGPROBS if any(p.top_logprobs for p in params) else 0)
    for i, (p, seed) in enumerate(zip(params, seeds)):
        arrays.temperature[i], arrays.top_p[i], arrays.top_k[i] = p.temperature, p.top_p, p.top_k
        arrays.min_p[i], arrays.seed[i] = p.min_p, seed
        if p.penalized:
            arrays.presence[i], arrays.frequency[i] = p.presence_penalty, p.frequency_penalty
            arrays.repetition[i] = p.repetition_penalty
            recent = logs[i][-PENALTY_WINDOW:]
            if len(recent):
                arrays.history[i, -len(recent):] = recent
            arrays.history_output[i] = min(produced[i], len(recent))
        entries = list(p.logit_bias) + [(t, -np.inf) for t in bans[i]]
        if entries:
            ids, bias = zip(*entries)
            arrays.bias_ids[i, :len(ids)], arrays.bias[i, :len(ids)] = ids, bias
    return arrays


def build_segment(kind: str, rows: list[Row], *, page_size: int, num_shards: int,
                  sentinel: int, sampling: SamplingArrays | None = None,
                  width: int | None = None, hbm_pages: int = 0) -> Segment:
    """A segment of `rows`, each padded to `width` queries (default: the longest row).
    hbm_pages: slots below it lie in a tiered pool's HBM tier (`latent_device_pages`); a
    segment whose pages all do is `in_hbm`, its tables padded with that tier's last page."""
    num_rows = bucket(len(rows), 1)
    width = width or max(len(r.tokens) for r in rows)
    tokens = np.zeros((num_rows, width), np.int32)
    positions = np.full((num_rows, width), -1, np.int32)
    last = np.zeros((num_rows,), np.int32)
    rotation = np.zeros((num_rows,), np.int32)
    used = [cdiv(r.start + len(r.tokens), page_size) for r in rows]
    in_hbm = hbm_pages > 0 and all(not n or r.table.slot_array[:n].max() < hbm_pages
                                   for r, n in zip(rows, used))
    sentinel = hbm_pages if in_hbm else sentinel
    table_width = bucket(max(u + r.table.rotation for u, r in zip(used, rows)), num_shards)
    table = np.full((num_rows, table_width), sentinel, np.int32)
    for i, (r, n) in enumerate(zip(rows, used)):
        tokens[i, : len(r.tokens)] = r.tokens
        positions[i, : len(r.tokens)] = np.arange(r.start, r.start + len(r.tokens))
        last[i] = len(r.tokens) - 1
        rotation[i] = r.table.rotation
        table[i] = rotated_row(r.table.slot_array[:n], r.table.rotation, table_width,
                               sentinel)
    inputs = StepInputs(tokens=tokens, positions=positions, page_table=table, logit_index=last,
                        rotation=rotation)
    return Segment(kind=kind, inputs=inputs, sampling=sampling, in_hbm=in_hbm)
