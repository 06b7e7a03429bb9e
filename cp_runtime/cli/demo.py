"""`cp-runtime demo`: a served long-context session, end to end, on local CPU shards.

It starts a server in this process (the hand-built retrieval model, cp_runtime.model.recall;
16 CPU shards; fp8_e4m3 cache), connects a client over a real socket, uploads a synthetic
document of `--tokens` tokens with one planted fact (key k holds value v) at `--depth`, asks for
the value of k, and prints the answer, whether it is right, the prefill rate, the time to first
token and where the session's pages live. The question goes as text, the name the recall
model's byte tokenizer gives the query token (`<|query:K|>`, cp_runtime.model.byte_tokenizer),
and the answer is printed as text too (`<|answer:V|>`); the document's filler ids are bytes.

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
import os
import time

import numpy as np

from cp_runtime.cache.capacity import bytes_per_token
from cp_runtime.cache.layout import cdiv
from cp_runtime.cli.args import (HelpFormatter, add_chunk_size, add_kv_cache_dtype, add_no_progress,
                                 add_page_size, add_selection, add_shards, format_length,
                                 length)
from cp_runtime.config import RuntimeConfig
from cp_runtime.model.recall import RecallLayout
from cp_runtime.model.source import RECALL_MODEL, WeightsSource
from cp_runtime.parallel.devices import init_cpu_devices
from cp_runtime.serving.app import EmbeddedServer, build_server
from cp_runtime.serving.session.client import Client

__all__ = ["add_arguments", "run", "Document", "planted_fact_document", "MAX_TOKENS"]

# The recall model's retrieval is measured up to a million tokens (docs/recall.md); past that
# nothing says it still answers, so the demo does not offer it.
MAX_TOKENS = 1 << 20
# The pool the demo sizes for --tokens may take at most this share of the host's memory (the
# process also holds the document, the weights and XLA's buffers).
POOL_SHARE_OF_HOST = 0.5


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
                   help=f"document length in tokens (k/m suffixes; 16 to "
                        f"{format_length(MAX_TOKENS)}: the range the recall model is measured "
                        "on); the pool is sized to hold it")
    p.add_argument("--depth", type=float, default=0.5,
                   help="where the fact sits, as a fraction of the document (0 = start)")
    add_shards(p)
    add_kv_cache_dtype(p)
    add_selection(p)
    add_page_size(p)
    add_chunk_size(p, 2048, why="the one-layer recall model writes its cache fastest in "
                               "larger chunks")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the document's filler and planted fact (the recall model's "
                        "weights are built, not drawn)")
    add_no_progress(p)


def _runtime(args, model_name: str) -> RuntimeConfig:
    pages = cdiv(cdiv(args.tokens + 1, args.page_size), args.shards) + 1
    return RuntimeConfig(model=model_name, kv_cache_dtype=args.kv_cache_dtype,
                         selection=args.selection, page_size=args.page_size, num_shards=args.shards,
                         pages_per_shard=pages, chunk_size=args.chunk_size)


def _check_tokens(tokens: int, runtime: RuntimeConfig, model) -> None:
    """--tokens within what the recall model is measured on, and its pool within the host."""
    if tokens < 16:
        raise ValueError(f"--tokens {tokens} is too short for a document (16 at least)")
    if tokens > MAX_TOKENS:
        raise ValueError(f"--tokens {format_length(tokens)}: the demo goes up to "
                         f"{format_length(MAX_TOKENS)}, the longest context the recall model "
                         "is measured on (docs/recall.md)")
    pool = (runtime.num_shards * runtime.pages_per_shard * runtime.page_size
            * bytes_per_token(model, runtime.kv_cache_dtype))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if pool > POOL_SHARE_OF_HOST * host:
        raise ValueError(f"--tokens {format_length(tokens)}: its pool needs {pool / 2**30:.1f} "
                         f"GiB, more than half of this host's {host / 2**30:.1f} GiB")


def _answer_text(layout: RecallLayout, token: int) -> str:
    """What an answer token says, as the recall layout reads its id."""
    if token in layout.answer_ids:
        return f"'value {token - layout.answer_ids.start}'"
    return "not an answer token"


def run(args) -> int:
    if not 0 <= args.depth <= 1:
        raise ValueError(f"--depth {args.depth} must be in [0, 1]")
    init_cpu_devices(args.shards)
    source = WeightsSource(model=RECALL_MODEL)
    runtime = _runtime(args, source.config().name)
    _check_tokens(args.tokens, runtime, source.config())
    doc = planted_fact_document(RecallLayout(), args.tokens, args.depth,
                                np.random.default_rng(args.seed))
    print(f"serving the recall model on {args.shards} CPU shards ({args.kv_cache_dtype} "
          f"cache; pool: {runtime.pages_per_shard} pages of {args.page_size} tokens per "
          "shard)")
    with EmbeddedServer(build_server(source, runtime, port=0)) as embedded:
        address = embedded.start()
        # The byte tokenizer names the recall model's tokens (None without `tokenizers`).
        tokenizer = embedded.server.tokenizer
        question = tokenizer.decode([int(doc.tokens[-1])]) if tokenizer is not None else None
        print(f"listening on {address}; uploading {args.tokens:,} tokens with a fact at "
              f"position {doc.fact_position:,}"
              + (f", {tokenizer.decode([int(doc.tokens[doc.fact_position])])}, and the "
                 f"question {question!r} as text" if question is not None else ""))
        with Client(address) as client:
            session = client.create_session()
            t0 = time.perf_counter()
            if question is None:
                session.extend(doc.tokens, progress=not args.no_progress)
            else:
                session.extend(doc.tokens[:-1], progress=not args.no_progress)
                session.extend(question)                 # encoded by the server's tokenizer
            prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            answer = next(iter(session.stream(max_tokens=1)))
            ttft = time.perf_counter() - t1
            info = session.info()
    right = answer == doc.answer
    layout = RecallLayout()
    text = f", text {tokenizer.decode([answer])!r}" if tokenizer is not None else ""
    print(f"answer: token {answer} = {_answer_text(layout, answer)}{text} "
          f"({'right' if right else 'WRONG'}; the fact says token {doc.answer} = "
          f"{_answer_text(layout, doc.answer)})")
    print(f"prefill: {args.tokens:,} tokens in {prefill_s:.1f} s = "
          f"{args.tokens / prefill_s:,.0f} tok/s (compiles included; the recall model has one "
          "layer, whose attention over prefill tokens feeds nothing the cache keeps, so XLA "
          "drops it: this is the rate of writing the cache, the indexer work happens at the "
          "question)")
    print(f"time to first token: {ttft * 1e3:.0f} ms")
    print(f"used pages per shard: {info['pages_per_shard']}")
    print(f"start shard {info['start_shard']}: the shard holding the session's first page; "
          "page i lives on shard (start + i) mod shards, so sessions start on different "
          "shards and their tails spread the load")
    return 0 if right else 1
