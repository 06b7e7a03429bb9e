"""Prefill tokens/s and decode ms/step vs context length, shard count, cache dtype and pool size
(first version: the roofline fractions come with the benchmark suite issue).

    python -m benchmarks.throughput --lengths 2k,8k --shards 16 --dtypes bf16,fp8_e4m3 \
        --pool-factors 1,4

Decode time at a fixed context must not depend on the pool size (pool 4x larger: within 10%):
the step updates pool buffers in place and reads only selected pages.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import init_cpu_devices, machine, print_table, write_json

__all__ = ["build_parser", "main", "parse_length"]


def parse_length(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1], 1)
    return int(text.rstrip("km")) * scale


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.throughput",
                                description="Prefill tokens/s and decode ms/step on the CPU mesh.")
    p.add_argument("--model", default="small")
    p.add_argument("--lengths", default="2k,8k", help="context lengths, e.g. 8k,64k,1m")
    p.add_argument("--shards", default="16", help="comma-separated shard counts")
    p.add_argument("--dtypes", default="bf16,fp8_e4m3")
    p.add_argument("--pool-factors", default="1,4",
                   help="pool size as a multiple of what the context needs")
    p.add_argument("--base-pages", type=int, default=256,
                   help="pages per shard of the 1x pool (at least what the context needs)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=10)
    p.add_argument("--out", default="out/throughput.json")
    return p


def _measure(model, params, *, length, shards, dtype, pool_factor, args) -> dict:
    import numpy as np

    from cp_runtime.config import RuntimeConfig
    from cp_runtime.engine import Engine
    from cp_runtime.executor import LocalExecutor
    from cp_runtime.layout import cdiv

    need = cdiv(cdiv(length + args.decode_steps + 1, args.page_size), shards)
    rt = RuntimeConfig(model=model.name, kv_cache_dtype=dtype, num_shards=shards,
                       pages_per_shard=max(need, args.base_pages) * pool_factor,
                       page_size=args.page_size,
                       chunk_size=args.chunk)
    engine = Engine(model, rt, LocalExecutor(model, rt, params))
    session = engine.create_session()
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, length).tolist()
    t0 = time.perf_counter()
    engine.extend(session.id, tokens)
    prefill_s = time.perf_counter() - t0
    engine.decode([session.id], [1])                                   # compile
    samples = []
    for step in range(args.decode_steps):
        t0 = time.perf_counter()
        engine.decode([session.id], [step % model.vocab_size])
        samples.append(time.perf_counter() - t0)
    return {"length": length, "shards": shards, "dtype": dtype, "pool_factor": pool_factor,
            "pool_pages_per_shard": rt.pages_per_shard, "prefill_s": prefill_s,
            "prefill_tok_per_s": length / prefill_s,
            "decode_ms": 1000 * statistics.median(samples)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shard_counts = [int(s) for s in args.shards.split(",")]
    init_cpu_devices(max(shard_counts))
    from tqdm import tqdm

    from cp_runtime.config import load_model_config
    from cp_runtime.weights import init_params

    model = load_model_config(args.model)
    params = init_params(model, seed=0)
    grid = [(length, s, d, f) for length in map(parse_length, args.lengths.split(","))
            for s in shard_counts for d in args.dtypes.split(",")
            for f in map(int, args.pool_factors.split(","))]
    rows = [_measure(model, params, length=length, shards=s, dtype=d, pool_factor=f, args=args)
            for length, s, d, f in tqdm(grid, desc="throughput")]
    base = {(r["length"], r["shards"], r["dtype"]): r["decode_ms"] for r in rows
            if r["pool_factor"] == 1}
    for r in rows:
        r["decode_vs_pool_1x"] = r["decode_ms"] / base.get((r["length"], r["shards"], r["dtype"]),
                                                           float("nan"))
    print_table(rows, ["length", "shards", "dtype", "pool_factor", "pool_pages_per_shard",
                       "prefill_tok_per_s", "decode_ms", "decode_vs_pool_1x"],
                title=f"{args.model} on {machine()['processor']}, {machine()['cpu_count']} cores, "
                      f"backend {machine()['backend']}")
    write_json(args.out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
