"""Token sampling on the device, inside the jitted step: the step returns token ids and their
log-probabilities, never `[B, V]` logits, to the host.

Per row b (all settings [B] arrays but the token lists below), in vLLM's order:
    logit_bias              bias[b, j] added at bias_ids[b, j] (the engine puts the ids that
                            `min_tokens` bans there too, at -inf)
    penalties               over the row's `history` (the last PENALTY_WINDOW ids of its
                            session's log, the generation's own `history_output` last among
                            them): repetition_penalty r divides a positive logit and multiplies
                            a negative one for every id in the history (prompt or output);
                            frequency_penalty f and presence_penalty p subtract f * count and
                            p * [count > 0], count the id's occurrences in the output
    temperature == 0        greedy: argmax of those logits (lowest id on a tie)
    temperature > 0         logits / temperature, then
        min_p > 0           keep the ids whose probability is at least min_p times the largest
        top_k > 0           keep the top_k largest (0 = no limit)
        top_p < 1           keep the smallest prefix, by descending probability (of what
                            min_p and top_k kept), whose mass reaches top_p (the first token
                            always stays)
                            and draw by Gumbel-max: argmax(kept logits + g), g ~ Gumbel(0, 1)
The noise `g` is drawn per vocabulary id from key `fold_in(key(seed), position)`, where position
is that of the token being sampled. So a draw depends only on (seed, position, logits): the same
seed gives the same tokens however rows are batched and however many shards the cache has.
When no row filters (every top_k == 0, top_p == 1 and min_p == 0) the sort is skipped
(`lax.cond`).

The returned log-probability is the model's: log_softmax of the raw logits at the chosen id
(before bias, penalties, temperature and filtering), as vLLM (`raw_logprobs`) and SGLang report
by default; so are the `alternatives` most likely ids and their log-probabilities, when asked
for.

Where the penalties' state lives. vLLM counts a request's whole prompt and output. Counting a
whole session here (up to a million tokens) on the device would need per-row state kept
between steps by the executor ([rows, V] counts, built once per generation from its log); the
step is a pure function of its plan instead, so each step carries, per row that is penalised,
its last PENALTY_WINDOW token ids (4 KiB a row) and the device counts them into [B, V] with one
scatter. That is exact for a generation's whole output while it is at most PENALTY_WINDOW
tokens long (then its latest PENALTY_WINDOW), and sees the end of the prompt beside it; no
[B, V] array crosses from the host, and a step with no penalised row carries none (its
`history` is [B, 0] and the penalty code is not in its program). The same holds for
`bias_ids` ([B, 0] unless a row has a logit bias or a ban) and for `alternatives` (a static
count: 0, or MAX_TOP_LOGPROBS, whose step returns [B, 1 + K] arrays, the sampled id first).
Each of the three is one more compiled variant of a decode step, built only when used.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["BIAS_SLOTS", "MAX_TOP_LOGPROBS", "PENALTY_WINDOW", "SamplingArrays",
           "sample_tokens"]

PENALTY_WINDOW = 1024     # token ids of its log a penalised row carries each step
BIAS_SLOTS = 256          # a row's logit_bias entries plus the ids min_tokens bans, at most
MAX_TOP_LOGPROBS = 20     # alternatives (`top_logprobs`) a token can carry, as vLLM's default

_DATA_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence", "frequency",
                "repetition", "history", "history_output", "bias_ids", "bias")


@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings of one step (host or device arrays).

    temperature f32[B], top_p f32[B], top_k i32[B], min_p f32[B], seed u32[B],
    presence f32[B], frequency f32[B], repetition f32[B]      the penalties (neutral: 0, 0, 1)
    history i32[B, W]      the last W ids of each row's log, right-aligned, -1 before them
                           (W: 0 when no row is penalised, else PENALTY_WINDOW)
    history_output i32[B]  how many of the history's last ids the generation produced
    bias_ids i32[B, L], bias f32[B, L]   logit bias entries (id -1: none; L 0 or BIAS_SLOTS)
    alternatives           static: how many most likely ids and log-probabilities each row
                           returns beside its token (0 or MAX_TOP_LOGPROBS)
    """

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    history: np.ndarray
    history_output: np.ndarray
    bias_ids: np.ndarray
    bias: np.ndarray
    alternatives: int = 0

    @classmethod
    def greedy(cls, rows: int, *, window: int = 0, bias_slots: int = 0,
               alternatives: int = 0) -> "SamplingArrays":
        """Neutral settings (greedy, nothing biased or penalised) for `rows` rows, with room
        for `window` history ids and `bias_slots` bias entries a row."""
        def f32(value):
            return np.full(rows, value, np.float32)

        return cls(temperature=f32(0), top_p=f32(1), top_k=np.zeros(rows, np.int32),
                   min_p=f32(0), seed=np.zeros(rows, np.uint32), presence=f32(0),
                   frequency=f32(0), repetition=f32(1),
                   history=np.full((rows, window), -1, np.int32),
                   history_output=np.zeros(rows, np.int32),
                   bias_ids=np.full((rows, bias_slots), -1, np.int32),
                   bias=np.zeros((rows, bias_slots), np.float32), alternatives=alternatives)

    @property
    def variant(self) -> tuple[int, int, int]:
        """What its step program is compiled for beside the rows: (history width, bias
        slots, alternatives)."""
        return self.history.shape[1], self.bias_ids.shape[1], self.alternatives


jax.tree_util.register_dataclass(SamplingArrays, data_fields=list(_DATA_FIELDS),
                                 meta_fields=["alternatives"])


def _noise(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise f32[B, V], one independent stream per (seed, position)."""

    def row(s, p):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(s), p), (vocab,), jnp.float32)

    return jax.vmap(row)(seed, position)


def _scatter_rows(shape, ids: jax.Array, values: jax.Array, how: str) -> jax.Array:
    """zeros(shape) with values[b, j] added (or max-ed, `how`) at [b, ids[b, j]]; ids < 0 are
    dropped."""
    vocab = shape[-1]
    rows = jnp.broadcast_to(jnp.arange(shape[0], dtype=jnp.int32)[:, None], ids.shape)
    cols = jnp.where(ids >= 0, ids, vocab)                           # out of range: dropped
    at = jnp.zeros(shape, values.dtype).at[rows, cols]
    return at.add(values, mode="drop") if how == "add" else at.max(values, mode="drop")


def adjust_logits(logits: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """f32[B, V] logits with each row's logit bias, then its penalties, applied (vLLM's
    order); the rows' neutral settings leave their logits exactly as they are."""
    shape = logits.shape
    if sampling.bias_ids.shape[1]:
        logits = logits + _scatter_rows(shape, sampling.bias_ids,
                                        sampling.bias.astype(jnp.float32), "add")
    if sampling.history.shape[1]:
        history = sampling.history
        width = history.shape[1]
        produced = (jnp.arange(width, dtype=jnp.int32)[None, :]
                    >= width - sampling.history_output[:, None])          # trailing: output
        counts = _scatter_rows(shape, history, produced.astype(jnp.float32), "add")
        seen = _scatter_rows(shape, history, jnp.ones(history.shape, jnp.float32), "max") > 0
        r = sampling.repetition.astype(jnp.float32)[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
        logits = (logits - sampling.frequency.astype(jnp.float32)[:, None] * counts
                  - sampling.presence.astype(jnp.float32)[:, None]
                  * (counts > 0).astype(jnp.float32))
    return logits


def _filtered_choice(scaled: jax.Array, noise: jax.Array, top_k: jax.Array,
                     top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """argmax over the min-p / top-k / top-p kept ids of scaled + noise: i32[B]."""
    vocab = scaled.shape[-1]
    ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)
    neg, order = lax.sort((-scaled, ids), dimension=1, num_keys=1)            # descending
    values = -neg                                                             # [B, V]
    probs = jax.nn.softmax(values, axis=-1)
    keep = probs >= min_p[:, None] * probs[:, :1]            # min_p 0 keeps every id
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    keep &= (top_k[:, None] <= 0) | (rank < top_k[:, None])
    probs = jax.nn.softmax(jnp.where(keep, values, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (top_p[:, None] >= 1) | (mass_before < top_p[:, None])   # rounding never drops
    noisy = jnp.where(keep, values + jnp.take_along_axis(noise, order, axis=1), -jnp.inf)
    return jnp.take_along_axis(order, jnp.argmax(noisy, axis=-1)[:, None], axis=1)[:, 0]


def sample_tokens(logits: jax.Array, sampling: SamplingArrays, position: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row.

    logits:   f32[B, V]
    position: i32[B]   position of the token being sampled (keys the noise)
    returns   tokens i32[B], logprobs f32[B] (the model's log-probability of each token); with
              `sampling.alternatives` K > 0, i32[B, 1 + K] and f32[B, 1 + K]: each row's token
              and its log-probability first, then the K most likely ids and theirs (by
              descending log-probability, the lowest id first on a tie)
    """
    logits = logits.astype(jnp.float32)
    adjusted = adjust_logits(logits, sampling)
    greedy = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)
    temperature = sampling.temperature.astype(jnp.float32)
    hot = temperature > 0
    scaled = adjusted / jnp.where(hot, temperature, 1.0)[:, None]
    noise = _noise(sampling.seed.astype(jnp.uint32), position, logits.shape[-1])
    min_p = sampling.min_p.astype(jnp.float32)
    filters = jnp.any(hot & ((sampling.top_k > 0) | (sampling.top_p < 1) | (min_p > 0)))
    drawn = lax.cond(
        filters,
        lambda: _filtered_choice(scaled, noise, sampling.top_k.astype(jnp.int32),
                                 sampling.top_p.astype(jnp.float32), min_p),
        lambda: jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32))
    tokens = jnp.where(hot, drawn, greedy)
    model = jax.nn.log_softmax(logits, axis=-1)
    logprobs = jnp.take_along_axis(model, tokens[:, None], axis=1)[:, 0]
    if not sampling.alternatives:
        return tokens, logprobs
    top, top_ids = lax.top_k(model, sampling.alternatives)
    return (jnp.concatenate([tokens[:, None], top_ids.astype(jnp.int32)], axis=1),
            jnp.concatenate([logprobs[:, None], top], axis=1))
