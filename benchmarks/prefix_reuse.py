"""Prefix reuse over HTTP: ten questions about one long document, each a stateless completion
that resends the whole document, against a server that keeps no prefix-cache entries
(`--prefix-cache-entries 0`: every question prefills the document again) and one with the
default (the later questions fork the first's session and prefill only their question).

    cp-runtime bench prefix_reuse                  # 10 questions on a 128K-token document:
                                                   # out/prefix_reuse.json (~15 min on a CPU)
    cp-runtime bench prefix_reuse --quick          # 3 questions on 2K tokens (~1 min)

Each server is a `cp-runtime serve --http-port 0` process (the servers share a persistent XLA
compilation cache, so only the first compiles), warmed up with one completion of a document of
the same length (other tokens), so the measured questions run compiled programs. Each question
is `POST /v1/completions` with `prompt` = the document's token ids + the question's
(`--question-tokens` random ids), greedy, `max_tokens` `--answer-tokens`, `return_token_ids`,
timed on the client from sending to the whole answer. Per server:

    prefill tokens   the engine's prefill_tokens_total over the questions (its `stats`)
    cached tokens    the sum of the answers' usage.prompt_tokens_details.cached_tokens
    total s          the questions' wall time, one after another
    first s / later s p50   the first question's time, and the median of the others

`answers equal` counts the questions whose greedy token ids are the same on both servers: reuse
must not change a token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import urllib.request

import numpy as np

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import length, positive_int
from cp_runtime.serving.process import ServerProcess

__all__ = ["build_parser", "main", "parse_args", "summarize"]

STARTUP_S = 300.0
REQUEST_TIMEOUT_S = 3600.0
QUICK = {"doc_tokens": ("128k", "2k"), "questions": ("10", "3")}
MODES = (("without reuse", "0"), ("with reuse", None))    # label, --prefix-cache-entries


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser(
        "prefix_reuse", "Questions about one long document as stateless HTTP completions, each "
                        "resending the document, against a server without prefix-cache entries "
                        "and one with them: prefill tokens, cached tokens and time, and whether "
                        "the greedy answers are equal.",
        quick="a short document and three questions: about a minute on a CPU (explicit flags "
              "win)",
        quick_values=QUICK)
    p.add_argument("--doc-tokens", type=length, metavar="N",
                   help="document tokens, k/m suffixes allowed")
    p.add_argument("--questions", type=positive_int, metavar="N",
                   help="questions asked, one after another")
    p.add_argument("--question-tokens", type=positive_int, default=32, metavar="N",
                   help="tokens of each question")
    p.add_argument("--answer-tokens", type=positive_int, default=8, metavar="N",
                   help="tokens generated for each answer (greedy)")
    p.add_shared(model="tiny", shards=16, kv_cache_dtype="fp8_e4m3", page_size=16,
                 chunk_size=1024, seed="the random document and question tokens", out="out",
                 progress=True, devices=False, whole_chunks=True)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), `--quick` applied, then `--out` created
    (`args.out` a Path)."""
    return build_parser().parse_args(argv)


def pages_per_shard_for(args: argparse.Namespace) -> int:
    """Two documents (the warm-up's and the questions') with every question's own pages, with
    room to spare: the pool never refuses, so prefix-cache entries are never evicted."""
    request = args.doc_tokens + args.question_tokens + args.answer_tokens
    pages = 2 * (-(-request // args.page_size)) + args.questions * (
        -(-(args.question_tokens + args.answer_tokens) // args.page_size) + 2)
    return -(-pages // args.shards) + 4


def _serve_flags(args: argparse.Namespace, entries: str | None, pages: int) -> list[str]:
    flags = ["--model", args.model, "--shards", str(args.shards),
             "--kv-cache-dtype", args.kv_cache_dtype, "--page-size", str(args.page_size),
             "--pages-per-shard", str(pages), "--chunk-size", str(args.chunk_size),
             "--max-tokens-per-request", str(args.doc_tokens + args.question_tokens),
             "--http-port", "0", "--log-summary-s", "0"]
    return flags if entries is None else [*flags, "--prefix-cache-entries", entries]


def _complete(http: str, prompt: list[int], max_tokens: int) -> tuple[dict, float]:
    """(the completion's JSON, seconds from sending to the whole answer)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://{http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as r:
        answer = json.loads(r.read())
    return answer, time.perf_counter() - t


def _stats(address: str) -> dict:
    from cp_runtime import Client

    with Client(address) as client:
        return client.stats()


def _ask(server: ServerProcess, doc: list[int], questions: list[list[int]], answer_tokens: int,
         bar) -> dict:
    """Every question in turn; the answers, times and the server's prefill over them."""
    before = _stats(server.address)
    answers, seconds, cached = [], [], 0
    for q in questions:
        answer, s = _complete(server.http_address, doc + q, answer_tokens)
        answers.append(answer["choices"][0]["token_ids"])
        seconds.append(s)
        cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        bar.update(1)
    after = _stats(server.address)
    return {"answers": answers, "seconds": seconds, "cached_tokens": cached,
            "prefill_tokens": after["prefill_tokens_total"] - before["prefill_tokens_total"]}


def summarize(label: str, run: dict) -> dict:
    s = run["seconds"]
    return {"mode": label, "questions": len(s), "prefill tokens": run["prefill_tokens"],
            "cached tokens": run["cached_tokens"], "total s": sum(s), "first s": s[0],
            "later s p50": float(np.median(s[1:])) if len(s) > 1 else None}


COLUMNS = ["mode", "questions", "prefill tokens", "cached tokens", "total s", "first s",
           "later s p50"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    rng = np.random.default_rng(args.seed)
    vocab = None
    pages = pages_per_shard_for(args)
    runs = {}
    with contextlib.ExitStack() as stack:
        cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="prefix-xla-"))
        for label, entries in MODES:
            server = ServerProcess(_serve_flags(args, entries, pages), startup_s=STARTUP_S, env={
                "JAX_COMPILATION_CACHE_DIR": cache_dir,
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
            try:
                if vocab is None:
                    from cp_runtime import Client
                    with Client(server.address) as client:
                        vocab = client.server["vocab_size"]
                    doc = rng.integers(0, vocab, args.doc_tokens).tolist()
                    warm = rng.integers(0, vocab, args.doc_tokens).tolist()
                    questions = [rng.integers(0, vocab, args.question_tokens).tolist()
                                 for _ in range(args.questions)]
                t = time.perf_counter()
                _complete(server.http_address, warm + questions[0], args.answer_tokens)
                warm_s = time.perf_counter() - t
                with tqdm(total=args.questions, unit="question", desc=label,
                          disable=args.no_progress) as bar:
                    runs[label] = {**_ask(server, doc, questions, args.answer_tokens, bar),
                                   "warmup_s": warm_s}
            finally:
                server.stop()
    rows = [summarize(label, runs[label]) for label, _ in MODES]
    without, with_ = (runs[label] for label, _ in MODES)
    equal = sum(a == b for a, b in zip(without["answers"], with_["answers"]))
    info = machine()
    print_table(rows, COLUMNS, title=(
        f"prefix reuse: {args.questions} questions of {args.question_tokens} tokens on a "
        f"{args.doc_tokens}-token document; {args.model}, S={args.shards}, chunk "
        f"{args.chunk_size}; {info['cpu_count']} cores"))
    ratio = sum(without["seconds"]) / sum(with_["seconds"])
    print(f"time without / with reuse: {ratio:.2f}x; prefill tokens "
          f"{without['prefill_tokens']} / {with_['prefill_tokens']}; answers equal: "
          f"{equal}/{args.questions}")
    command = " ".join(["cp-runtime bench prefix_reuse", *(sys.argv[1:] if argv is None
                                                           else argv)])
    path = write_json(args.out / "prefix_reuse.json", {
        "args": vars(args), "command": command, "machine": info, "rows": rows,
        "answers_equal": equal, "time_ratio": ratio, "runs": runs})
    print(f"wrote {path}")
    return 0 if equal == args.questions else 1


if __name__ == "__main__":
    raise SystemExit(main())
