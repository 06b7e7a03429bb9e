"""`cp-runtime demo`: a served long-context session, end to end, on local CPU shards.

It starts a server in this process (the hand-built retrieval model, cp_runtime.recall_model;
16 CPU shards; fp8_e4m3 cache), connects a client over a real socket, uploads a synthetic
document of `--tokens` tokens with one planted fact (key k holds value v) at `--depth`, asks for
the value of k, and prints the answer, whether it is right, the prefill rate, the time to first
token and where the session's pages live.

The model answers only if the DSA indexer selects the fact's page among a million-token
context's top-k pages across all shards and the sparse attention reads the right latent row
back from the fp8 cache: the retrieval path, not language ability. The model has one layer, so
a prefill chunk's attention output feeds nothing the cache keeps and XLA drops it (measured
here: 32K tokens prefill in 0.9 s when no logits are asked, 12 s, compiles included, when
every chunk's logits are): the printed
prefill rate is the rate of writing the cache; the indexer and attention run for the question.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from cp_runtime.cli_args import (HelpFormatter, add_chunk_size, add_kv_cache_dtype,
                                 add_no_progress, add_page_size, add_shards, length)
from cp_runtime.config import RuntimeConfig
from cp_runtime.devices import init_cpu_devices
from cp_runtime.layout import cdiv
from cp_runtime.recall_model import RecallLayout
from cp_runtime.serving.app import EmbeddedServer, build_server
from cp_runtime.serving.client import Client
from cp_runtime.weights_source import RECALL_MODEL, WeightsSource

__all__ = ["add_arguments", "run", "Document", "planted_fact_document"]


@dataclasses.dataclass(frozen=True)
class Document:
    """Token ids i32[N] ending with the question, and the token that answers it."""

    tokens: np.ndarray
    fact_position: int
    answer: int


def planted_fact_document(layout: RecallLayout, tokens: int, depth: float,
                          rng: np.random.Generator) -> Document:
    """Filler, one fact token at `depth` of the way in, and a question token last."""
    key, value = int(rng.integers(layout.n_keys)), int(rng.integers(layout.n_values))
    doc = layout.filler(rng, tokens)
    position = min(int(depth * (tokens - 1)), tokens - 2)
    doc[position] = layout.fact(key, value)
    doc[-1] = layout.query(key)
    return Document(tokens=doc, fact_position=position, answer=layout.answer(value))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = HelpFormatter
    p.add_argument("--tokens", type=length, default=128 * 1024,
                   help="document length in tokens (k/m suffixes; up to 1m)")
    p.add_argument("--depth", type=float, default=0.5,
                   help="where the fact sits, as a fraction of the document (0 = start)")
    add_shards(p, 16)
    add_kv_cache_dtype(p, "fp8_e4m3")
    add_page_size(p, 16)
    add_chunk_size(p, 2048)
    p.add_argument("--seed", type=int, default=0, help="seed of the document")
    add_no_progress(p)


def _runtime(args, model_name: str) -> RuntimeConfig:
    pages = cdiv(cdiv(args.tokens + 1, args.page_size), args.shards) + 1
    return RuntimeConfig(model=model_name, kv_cache_dtype=args.kv_cache_dtype,
                         page_size=args.page_size, num_shards=args.shards,
                         pages_per_shard=pages, chunk_size=args.chunk_size)


def run(args) -> int:
    if not 0 <= args.depth <= 1:
        raise ValueError(f"--depth {args.depth} must be in [0, 1]")
    if args.tokens < 16:
        raise ValueError(f"--tokens {args.tokens} is too short for a document (16 at least)")
    init_cpu_devices(args.shards)
    source = WeightsSource(model=RECALL_MODEL)
    runtime = _runtime(args, source.config().name)
    doc = planted_fact_document(RecallLayout(), args.tokens, args.depth,
                                np.random.default_rng(args.seed))
    print(f"serving the recall model on {args.shards} CPU shards ({args.kv_cache_dtype} "
          f"cache, {runtime.pages_per_shard} pages of {args.page_size} per shard)")
    with EmbeddedServer(build_server(source, runtime, port=0)) as embedded:
        address = embedded.start()
        print(f"listening on {address}; uploading {args.tokens:,} tokens with a fact at "
              f"position {doc.fact_position:,}")
        with Client(address) as client:
            session = client.create_session()
            t0 = time.perf_counter()
            session.extend(doc.tokens, progress=not args.no_progress)
            prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            answer = next(iter(session.stream(max_tokens=1)))
            ttft = time.perf_counter() - t1
            info = session.info()
    right = answer == doc.answer
    print(f"answer: token {answer} ({'right' if right else 'WRONG'}; the fact says "
          f"{doc.answer})")
    print(f"prefill: {args.tokens:,} tokens in {prefill_s:.1f} s = "
          f"{args.tokens / prefill_s:,.0f} tok/s (compiles included; the recall model has one "
          "layer, whose attention over prefill tokens feeds nothing the cache keeps, so XLA "
          "drops it: this is the rate of writing the cache, the indexer work happens at the "
          "question)")
    print(f"time to first token: {ttft * 1e3:.0f} ms")
    print(f"pages per shard: {info['pages_per_shard']} (start shard {info['start_shard']})")
    return 0 if right else 1
