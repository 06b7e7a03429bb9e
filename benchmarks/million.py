"""A million-token session on the CPU: chunked prefill into a 16-way sharded fp8 pool, then
decode steps. Reports prefill time and tokens/s, decode ms/step, and peak RSS against the pool's
planned bytes (memory beyond the pool must stay bounded by the chunk, not the context).

    cp-runtime bench million --tokens 1048576
"""

from __future__ import annotations

import argparse
import resource
import time

from cp_runtime.benchmarks.common import init_cpu_devices, machine, print_table, write_json

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cp-runtime bench million",
                                description="One very long session: prefill time, decode ms/step "
                                            "and peak RSS vs the pool's planned bytes.")
    p.add_argument("--tokens", type=int, default=1 << 20, help="context length (default 1M)")
    p.add_argument("--model", default="small", help="model config (default: small)")
    p.add_argument("--shards", type=int, default=16, help="cp shards (virtual CPU devices)")
    p.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens per step)")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--out", default="out/million.json")
    return p


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(args) -> dict:
    # Imported after the device count is set: JAX must not initialise before that.
    import numpy as np
    from tqdm import tqdm

    from cp_runtime.config import RuntimeConfig, load_model_config
    from cp_runtime.engine import Engine
    from cp_runtime.engine.executor import LocalExecutor
    from cp_runtime.layout import cdiv
    from cp_runtime.weights import init_params

    model = load_model_config(args.model)
    pages = cdiv(cdiv(args.tokens + args.decode_steps, args.page_size), args.shards) + 1
    rt = RuntimeConfig(model=args.model, kv_cache_dtype=args.kv_cache_dtype,
                       num_shards=args.shards, pages_per_shard=pages, page_size=args.page_size,
                       chunk_size=args.chunk, key_block_pages=64, query_block=256)
    rss_start = _rss_bytes()
    executor = LocalExecutor(model, rt, init_params(model, seed=0))
    engine = Engine(model, rt, executor)
    planned = executor.pool_spec.planned_bytes
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, args.tokens).tolist()
    session = engine.create_session()
    with tqdm(total=args.tokens, unit="tok", desc="prefill", mininterval=5) as bar:
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
            "kv_cache_dtype": args.kv_cache_dtype, "chunk": args.chunk,
            "prefill_s": prefill_s, "prefill_tok_per_s": args.tokens / prefill_s,
            "decode_ms_per_step": decode_ms, "pool_planned_bytes": planned,
            "rss_start_bytes": rss_start, "peak_rss_bytes": peak,
            "peak_rss_minus_pool_bytes": peak - planned}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_cpu_devices(args.shards)
    result = run(args)
    print_table([result], ["tokens", "shards", "kv_cache_dtype", "prefill_s", "prefill_tok_per_s",
                           "decode_ms_per_step", "pool_planned_bytes", "peak_rss_bytes"],
                title=f"long session on {machine()['processor']} ({machine()['backend']})")
    write_json(args.out, {"result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
