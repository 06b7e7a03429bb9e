"""Token sampling on the device, inside the jitted step: the step returns token ids and their
log-probabilities, never `[B, V]` logits, to the host.

Per row b (all arrays [B]):
    temperature == 0        greedy: argmax of the logits (lowest id on a tie)
    temperature > 0         logits / temperature, then
        top_k > 0           keep the top_k largest (0 = no limit)
        top_p < 1           keep the smallest prefix, by descending probability, whose mass
                            reaches top_p (the first token always stays)
                            and draw by Gumbel-max: argmax(kept logits + g), g ~ Gumbel(0, 1)
The noise `g` is drawn per vocabulary id from key `fold_in(key(seed), position)`, where position
is that of the token being sampled. So a draw depends only on (seed, position, logits): the same
seed gives the same tokens however rows are batched and however many shards the cache has.
When no row filters (every top_k == 0 and top_p == 1) the sort is skipped (`lax.cond`).

The returned log-probability is the model's: log_softmax of the raw logits at the chosen id
(before temperature and filtering), as vLLM and SGLang report by default.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["SamplingArrays", "sample_tokens"]


@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings of one step (host or device arrays).

    temperature f32[B], top_p f32[B], top_k i32[B], seed u32[B]
    """

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seed: np.ndarray

    @classmethod
    def greedy(cls, rows: int) -> "SamplingArrays":
        return cls(temperature=np.zeros(rows, np.float32), top_p=np.ones(rows, np.float32),
                   top_k=np.zeros(rows, np.int32), seed=np.zeros(rows, np.uint32))


jax.tree_util.register_dataclass(SamplingArrays,
                                 data_fields=["temperature", "top_p", "top_k", "seed"],
                                 meta_fields=[])


def _noise(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise f32[B, V], one independent stream per (seed, position)."""

    def row(s, p):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(s), p), (vocab,), jnp.float32)

    return jax.vmap(row)(seed, position)


def _filtered_choice(scaled: jax.Array, noise: jax.Array, top_k: jax.Array,
                     top_p: jax.Array) -> jax.Array:
    """argmax over the top-k / top-p kept ids of scaled + noise: i32[B]."""
    vocab = scaled.shape[-1]
    ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), scaled.shape)
    neg, order = lax.sort((-scaled, ids), dimension=1, num_keys=1)            # descending
    values = -neg                                                             # [B, V]
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
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
    returns   tokens i32[B], logprobs f32[B] (the model's log-probability of each token)
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = sampling.temperature.astype(jnp.float32)
    hot = temperature > 0
    scaled = logits / jnp.where(hot, temperature, 1.0)[:, None]
    noise = _noise(sampling.seed.astype(jnp.uint32), position, logits.shape[-1])
    filters = jnp.any(hot & ((sampling.top_k > 0) | (sampling.top_p < 1)))
    drawn = lax.cond(
        filters,
        lambda: _filtered_choice(scaled, noise, sampling.top_k.astype(jnp.int32),
                                 sampling.top_p.astype(jnp.float32)),
        lambda: jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32))
    tokens = jnp.where(hot, drawn, greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None],
                                   axis=1)[:, 0]
    return tokens, logprobs
