"""A million-token session on the CPU: chunked prefill into a 16-way sharded fp8 pool, then
decode steps. Reports prefill time and tokens/s, decode ms/step, and peak RSS against the pool's
planned bytes (memory beyond the pool must stay bounded by the chunk, not the context).

    cp-runtime bench million --tokens 1m     # writes out/million.json
    cp-runtime bench million --quick         # 64K tokens
"""

from __future__ import annotations

import argparse
import resource
import time

from cp_runtime.benchmarks._shared.bench_parser import TPU_PAGES, BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import check_not_below_page, length, positive_int

__all__ = ["build_parser", "parse_args", "main", "run"]

QUICK = {"tokens": ("1m", "64k")}


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("million", "One very long session: prefill time, decode ms/step and peak "
                                   "RSS vs the pool's planned bytes.",
                        quick="a shorter session", quick_values=QUICK, check=_check)
    p.add_argument("--tokens", type=length, help="context length, k/m suffixes allowed")
    p.add_argument("--decode-steps", type=positive_int, default=8,
                   help="decode steps timed after the prefill")
    p.add_shared(model="small", shards=16, kv_cache_dtype="fp8_e4m3", weight_dtype=True,
                 page_size=64, chunk_size=4096, out="out", progress=True,
                 why={"page_size": TPU_PAGES,
                      "chunk_size": "a million tokens in 256 prefill steps instead of 1024"})
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    check_not_below_page(parser, "--tokens", args.tokens, args.page_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for `--shards` set up, then
    `--out` created."""
    return build_parser().parse_args(argv)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(args) -> dict:
    # Imported after the device count is set: JAX must not initialise before that.
    import numpy as np
    from tqdm import tqdm

    from cp_runtime.cache.layout import cdiv
    from cp_runtime.config import RuntimeConfig, load_model_config
    from cp_runtime.engine import Engine
    from cp_runtime.engine.executor import LocalExecutor
    from cp_runtime.weights.params import init_params

    model = load_model_config(args.model)
    pages = cdiv(cdiv(args.tokens + args.decode_steps, args.page_size), args.shards) + 1
    rt = RuntimeConfig(model=args.model, kv_cache_dtype=args.kv_cache_dtype,
                       num_shards=args.shards, pages_per_shard=pages, page_size=args.page_size,
                       chunk_size=args.chunk_size, key_block_pages=64, query_block=256,
                       weight_dtype=args.weight_dtype)
    rss_start = _rss_bytes()
    executor = LocalExecutor(model, rt, init_params(model, seed=0))
    engine = Engine(model, rt, executor)
    planned = executor.pool_spec.planned_bytes
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, args.tokens).tolist()
    session = engine.create_session()
    with tqdm(total=args.tokens, unit="tok", desc="prefill", mininterval=5,
              disable=args.no_progress) as bar:
        t0 = time.perf_counter()
        logits = engine.extend(session.id, tokens, progress=bar.update)
        prefill_s = time.perf_counter() - t0
    next_token = int(np.argmax(logits))
    engine.decode([session.id], [next_token])                      # compile
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        next_token = int(np.argmax(engine.decode([session.id], [next_token])[0]))
    decode_ms = 1000 * (time.perf_counter() - t0) / args.decode_steps
    peak = _rss_bytes()
    return {"tokens": args.tokens, "model": args.model, "shards": args.shards,
            "kv_cache_dtype": args.kv_cache_dtype, "chunk": args.chunk_size,
            "prefill_s": prefill_s, "prefill_tok_per_s": args.tokens / prefill_s,
            "decode_ms_per_step": decode_ms, "pool_planned_bytes": planned,
            "rss_start_bytes": rss_start, "peak_rss_bytes": peak,
            "peak_rss_minus_pool_bytes": peak - planned}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_table([result], ["tokens", "shards", "kv_cache_dtype", "prefill_s", "prefill_tok_per_s",
                           "decode_ms_per_step", "pool_planned_bytes", "peak_rss_bytes"],
                title=f"long session on {machine()['processor']} ({machine()['backend']})")
    write_json(args.out / "million.json", {"result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
