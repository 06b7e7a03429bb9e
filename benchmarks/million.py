"""A million-token session on the CPU: chunked prefill into a 16-way sharded fp8 pool, then
decode steps. Reports prefill time and tokens/s, decode ms/step, and peak RSS against the pool's
planned bytes (memory beyond the pool must stay bounded by the chunk, not the context).

    cp-runtime bench million --tokens 1m     # writes out/million.json
    cp-runtime bench million --quick         # 64K tokens
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import time

from cp_runtime.benchmarks.common import (apply_quick, init_shard_devices, machine, print_table,
                                         quick_help, write_json)
from cp_runtime.cli.args import (HelpFormatter, add_chunk_size, add_kv_cache_dtype, add_model,
                                 add_no_progress, add_out, add_page_size, add_shards,
                                 add_weight_dtype, check_not_below_page, check_out_dir,
                                 check_page_size, check_page_size_for_model, length, positive_int)

__all__ = ["build_parser", "parse_args", "main", "run"]

QUICK = {"tokens": ("1m", "64k")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cp-runtime bench million", formatter_class=HelpFormatter,
                                description="One very long session: prefill time, decode ms/step "
                                            "and peak RSS vs the pool's planned bytes.")
    p.add_argument("--tokens", type=length, default=None,
                   help=f"context length, k/m suffixes allowed ({quick_help(QUICK, 'tokens')})")
    add_model(p, "small")
    add_shards(p, 16)
    add_kv_cache_dtype(p, "fp8_e4m3")
    add_weight_dtype(p)
    add_page_size(p, 64, why="64-token pages, as the TPU deployment configs use")
    add_chunk_size(p, 4096, why="a million tokens in 256 prefill steps instead of 1024")
    p.add_argument("--decode-steps", type=positive_int, default=8,
                   help="decode steps timed after the prefill")
    p.add_argument("--quick", action="store_true", help="a shorter session")
    add_no_progress(p)
    add_out(p, "out")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for `--shards` set up, then
    `--out` created."""
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_quick(parser, args, QUICK)
    check_page_size(parser, args.page_size)
    check_page_size_for_model(parser, args.model, args.page_size)
    check_not_below_page(parser, "--tokens", args.tokens, args.page_size)
    init_shard_devices(parser, args.shards)
    check_out_dir(parser, args.out)
    return args


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
    write_json(pathlib.Path(args.out) / "million.json", {"result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
