"""Prefill tokens/s and decode ms/step vs context length, shard count, cache dtype and pool size;
the fraction of this machine's measured memory bandwidth and matmul FLOP/s that each achieves;
and the decode time of DSA's sparse selection against a dense equivalent.

    cp-runtime bench throughput --lengths 2k,8k --shards 16 --kv-cache-dtypes bf16,fp8_e4m3 \
        --pool-factors 1,4                                 # writes out/throughput.json and PNGs
    cp-runtime bench throughput --lengths 8k,16k,32k,64k,128k,256k,512k,1m \
        --kv-cache-dtypes fp8_e4m3 --chunk-size 4096 --pool-factors 1      # 8K to 1M, one sweep

Per (shards, dtype), one session grows through the lengths on one engine whose pool is sized for
the longest: at each length it has prefilled the segment since the previous length in
`--chunk-size` steps of random tokens, then `--decode-steps` single tokens are decoded on a fork
(median step after a warm-up). `prefill_tok_per_s` is the segment's rate with compile time
excluded (JAX reports it through `jax.monitoring`: trace, lowering and backend compile);
`prefill_total_s` is the wall time from an empty session to that length, and
`prefill_total_tok_per_s` its rate with compile excluded, i.e. a single prefill of that length.
Growing one session costs the longest length's prefill once, instead of the sum of all lengths.

Decode time at a fixed context (`--pool-length`) must not depend on the pool size (a fresh engine
per `--pool-factors` entry; 4x larger: within 10%): the step updates pool buffers in place and
reads only selected pages.

Sparse vs dense (`dense_vs_sparse` = dense ms / sparse ms): the same
model with `index_topk` raised to cover every page of the context, so each decode step selects
and reads all pages, on the same pool and page table as the sparse run (the cache contents are the
sparse run's: only time is measured). Its indexer top-K, page gathers and attention all grow with
the context, so `--dense-max-length` caps the lengths where it runs.

Roofline fractions: work / time / peak, with the peak from benchmarks/_shared/roofline_probe.py
measured in the same run over the same devices, and the work counted by
benchmarks/_shared/minimum_work.py: what this design must do per step (dense layers on every
shard, cache reads and scores only for tokens a query may see, each page read once per step), not
what the reference kernels do with padding and masks. Elementwise work (norms, RoPE, softmax) and
collectives are not counted.

Measured with the defaults on the development machine (2 shared x86 cores, 16 virtual devices,
`small` model; 2.1 min in all): roofline 30 GB/s read, 76 GFLOP/s; prefill 0.8-1.5 K tokens/s
(3-5% of matmul FLOP/s: the 16 replicas of the dense layers dominate the count), 2.7-6.8 s of
compile per prefill; decode 10-13 ms/step at 2K and 8K alike (about 1.3% of bandwidth: per-step
dispatch over 16 devices, not memory, sets it), pool 4x within 0.88-1.17x; dense / sparse decode
2.3-3.0x at 2K and 4.4-5.0x at 8K.

The 8K-to-1M sweep above (fp8_e4m3, S = 16, chunk 4096; 37 min in all, another benchmark running
niced beside it): roofline 23 GB/s, 105 GFLOP/s; segment prefill 1.9 K tokens/s at 8K falling to
0.85 K at 128K and 0.43 K for the last half million (the indexer scores every earlier key:
T^2/2 pairs), 1,937 s from empty to 1M; decode 9.3 ms/step at 8K, 15.5 at 128K, 41 at 1M;
dense / sparse decode 5.9x at 8K rising to 15.6x at 128K.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import statistics
import time

import jax
import jax.monitoring
import numpy as np

from cp_runtime.benchmarks._shared.bench_parser import TPU_PAGES, BenchmarkParser
from cp_runtime.benchmarks._shared.minimum_work import Work, decode_step_work, prefill_work
from cp_runtime.benchmarks._shared.plots import line_chart
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.benchmarks._shared.roofline_probe import measure_roofline
from cp_runtime.cache.layout import cdiv
from cp_runtime.cli.args import (check_not_below_page, length, length_list, nonnegative_length,
                                 positive_int, positive_int_list)
from cp_runtime.config import ModelConfig, RuntimeConfig, load_model_config
from cp_runtime.engine import Engine
from cp_runtime.engine.executor import LocalExecutor
from cp_runtime.kernels.dispatch import resolve_backend
from cp_runtime.weights.params import init_params

__all__ = ["dense_model", "compile_seconds", "build_parser", "parse_args", "main"]

QUICK = {"decode_steps": ("10", "5")}


def dense_model(model: ModelConfig, *, tokens: int, page_size: int) -> ModelConfig:
    """The same model with index_topk covering every page of a `tokens`-token context."""
    return dataclasses.replace(model, index_topk=cdiv(tokens, page_size) * page_size)


# -- measurement ----------------------------------------------------------------------------
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def compile_seconds():
    """Yields a one-element list that accumulates JAX's compile time inside the block."""
    total = [0.0]

    def listener(event: str, duration: float, **_) -> None:
        if event in _COMPILE_EVENTS:
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield total
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _decode_ms(engine: Engine, session_id: int, steps: int, vocab: int) -> float:
    """Median wall ms of `steps` single-token decode steps on a fork of the session (after one
    warm-up step, which compiles); the session itself is left as it was."""
    fork = engine.fork(session_id)
    try:
        engine.decode([fork.id], [1])
        samples = []
        for step in range(steps):
            t0 = time.perf_counter()
            engine.decode([fork.id], [step % vocab])
            samples.append(time.perf_counter() - t0)
    finally:
        engine.close_session(fork.id)
    return 1000 * statistics.median(samples)


def _runtime(model: ModelConfig, *, context: int, shards: int, dtype: str, pool_factor: int,
             args) -> RuntimeConfig:
    """A pool of `pool_factor` x what `context` tokens plus the decode forks need per shard
    (at least --base-pages)."""
    slack = cdiv(2 * args.decode_steps + 2, args.page_size) + 2      # a decode fork's pages
    need = cdiv(cdiv(context, args.page_size), shards) + slack
    return RuntimeConfig(model=model.name, kv_cache_dtype=dtype, num_shards=shards,
                         pages_per_shard=max(need, args.base_pages) * pool_factor,
                         page_size=args.page_size, chunk_size=args.chunk_size,
                         backend=args.backend, weight_dtype=args.weight_dtype)


@contextlib.contextmanager
def _dense_selection(engine: Engine, params, context: int, page_size: int):
    """The engine runs the dense model (index_topk covering `context` tokens) on the same pool
    and page tables inside the block (the cache contents stay the sparse model's: only time is
    measured), and its own executor again after it."""
    sparse = engine.executor
    dense = LocalExecutor(dense_model(sparse.model, tokens=context, page_size=page_size),
                          engine.runtime, params)
    dense.pool, sparse.pool = sparse.pool, None                          # same cache, no copy
    engine.executor = dense
    try:
        yield
    finally:
        sparse.pool, dense.pool = dense.pool, None
        engine.executor = sparse


def _grow(model, params, *, lengths: list[int], shards: int, dtype: str, dense_max: int,
          args) -> list[dict]:
    """One session grows through `lengths` (ascending) on one engine sized for the longest.
    Per length: the prefill of the segment since the previous length (tokens/s with compile
    excluded, and the running total), then decode ms/step at that context, and, up to
    `dense_max`, the same decode with dense selection."""
    from tqdm import tqdm          # here: the work accounting above imports without it
    rt = _runtime(model, context=lengths[-1], shards=shards, dtype=dtype, pool_factor=1,
                  args=args)
    engine = Engine(model, rt, LocalExecutor(model, rt, params))
    session = engine.create_session()
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, lengths[-1]).tolist()
    rows, done, total_s, total_compile = [], 0, 0.0, 0.0
    with tqdm(total=lengths[-1], desc=f"prefill {dtype} S={shards}", unit="tok",
              unit_scale=True, leave=False, disable=args.no_progress) as bar:
        for length in lengths:
            with compile_seconds() as compile_s:
                t0 = time.perf_counter()
                engine.extend(session.id, tokens[done:length], progress=bar.update)
                seconds = time.perf_counter() - t0
            total_s, total_compile = total_s + seconds, total_compile + compile_s[0]
            row = {"length": length, "shards": shards, "dtype": dtype,
                   "pool_pages_per_shard": rt.pages_per_shard, "segment_start": done,
                   "prefill_s": seconds, "prefill_compile_s": compile_s[0],
                   "prefill_tok_per_s": (length - done) / max(seconds - compile_s[0], 1e-9),
                   "prefill_total_s": total_s,
                   "prefill_total_tok_per_s": length / max(total_s - total_compile, 1e-9),
                   "decode_ms": _decode_ms(engine, session.id, args.decode_steps,
                                           model.vocab_size)}
            if length <= dense_max:
                with _dense_selection(engine, params, length + 2 * args.decode_steps + 2,
                                      args.page_size):
                    row["dense_decode_ms"] = _decode_ms(engine, session.id, args.decode_steps,
                                                        model.vocab_size)
                row["dense_vs_sparse"] = row["dense_decode_ms"] / row["decode_ms"]
            rows.append(row)
            done = length
    engine.executor.close()
    return rows


def _pool_rows(model, params, *, length: int, shards: int, dtype: str, factors: list[int],
               args) -> list[dict]:
    """Decode ms/step at a fixed context with pools of each factor x what it needs (a fresh
    engine each): the step's cost must not grow with the pool."""
    rows = []
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, length).tolist()
    for factor in factors:
        rt = _runtime(model, context=length, shards=shards, dtype=dtype, pool_factor=factor,
                      args=args)
        engine = Engine(model, rt, LocalExecutor(model, rt, params))
        session = engine.create_session()
        engine.extend(session.id, tokens)
        rows.append({"length": length, "shards": shards, "dtype": dtype, "pool_factor": factor,
                     "pool_pages_per_shard": rt.pages_per_shard,
                     "decode_ms": _decode_ms(engine, session.id, args.decode_steps,
                                             model.vocab_size)})
        engine.executor.close()
        del engine                                       # free this pool before the next
    for row in rows:
        row["decode_vs_smallest_pool"] = row["decode_ms"] / rows[0]["decode_ms"]
    return rows


def _fractions(name: str, work: Work, seconds: float, roof: dict) -> dict:
    """Achieved GB/s and GFLOP/s of `work` done in `seconds`, and their fractions of `roof`."""
    gbs, gflops = work.bytes / seconds / 1e9, work.flops / seconds / 1e9
    return {f"{name}_gb_per_s": gbs, f"{name}_gflop_per_s": gflops,
            f"{name}_bw_%": 100 * gbs / roof["memory_gb_per_s"],
            f"{name}_flop_%": 100 * gflops / roof["matmul_gflop_per_s"],
            f"{name}_flop_per_byte": work.flops / work.bytes}


def _roofline_fractions(row: dict, model: ModelConfig, roof: dict, *, args,
                        param_bytes: int) -> dict:
    """Roofline fractions of the row's prefill segment and decode step. The segment's work is
    prefill_work(length) - prefill_work(segment_start): exact when the segment starts on a
    chunk boundary, as the engine chunks from the session's length."""
    common = dict(page_size=args.page_size, kv_cache_dtype=row["dtype"], shards=row["shards"],
                  param_bytes=param_bytes, chunk=args.chunk_size)
    whole = prefill_work(model, length=row["length"], **common)
    before = prefill_work(model, length=row["segment_start"], **common)
    segment = Work(whole.flops - before.flops, whole.bytes - before.bytes)
    del common["chunk"]
    decode = decode_step_work(model, context=row["length"] + args.decode_steps // 2, **common)
    tokens = row["length"] - row["segment_start"]
    return (_fractions("prefill", segment, tokens / row["prefill_tok_per_s"], roof)
            | _fractions("decode", decode, row["decode_ms"] / 1000, roof))


def _plots(rows: list[dict], out: pathlib.Path, model: str) -> list[pathlib.Path]:
    series = sorted({(r["dtype"], r["shards"]) for r in rows})
    decode, prefill, groups = {}, {}, {}
    for dtype, shards in series:
        pts = sorted((r["length"], r) for r in rows if (r["dtype"], r["shards"]) == (dtype, shards))
        label = f"{dtype} S={shards}"
        decode[f"sparse {label}"] = ([n for n, _ in pts], [r["decode_ms"] for _, r in pts])
        groups[f"sparse {label}"] = groups[f"dense {label}"] = label
        dense = [(n, r["dense_decode_ms"]) for n, r in pts if "dense_decode_ms" in r]
        if dense:
            decode[f"dense {label}"] = ([n for n, _ in dense], [ms for _, ms in dense])
        prefill[label] = ([n for n, _ in pts], [r["prefill_tok_per_s"] for _, r in pts])
    return [line_chart(out.with_name(out.stem + "_decode.png"), decode, xlabel="context tokens",
                       ylabel="decode ms / step", title=f"{model}: decode step",
                       dashed=[label for label in decode if label.startswith("dense")],
                       groups=groups),
            line_chart(out.with_name(out.stem + "_prefill.png"), prefill,
                       xlabel="context tokens", ylabel="prefill tokens / s",
                       title=f"{model}: prefill of the segment ending at each length "
                             "(compile excluded)")]


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("throughput", "Prefill tokens/s and decode ms/step on the CPU mesh, "
                                      "roofline fractions, sparse vs dense decode.",
                        quick="fewer timed decode steps (the lengths, dtypes and pools are the "
                              "defaults' already: about 1.5 min on a CPU)",
                        quick_values=QUICK, check=_check)
    p.add_argument("--lengths", type=length_list, default="2k,8k", metavar="N[,N...]",
                   help="context lengths one session grows through, e.g. 8k,64k,1m")
    p.add_argument("--pool-factors", type=positive_int_list, default="1,4", metavar="F[,F...]",
                   help="pool sizes, as multiples of what the context needs, for the decode vs "
                        "pool size table (1: no such table)")
    p.add_argument("--pool-length", type=length, default="2k",
                   help="the fixed context of the pool size table")
    p.add_argument("--base-pages", type=positive_int, default=256,
                   help="pages per shard of the 1x pool (at least what the context needs)")
    p.add_argument("--decode-steps", type=positive_int,
                   help="decode steps timed per length, the median reported")
    p.add_argument("--dense-max-length", type=nonnegative_length, default="128k",
                   help="longest context for the dense decode comparison (0: none)")
    p.add_argument("--roofline-mib", type=positive_int, default=None,
                   help="bandwidth array size, all devices together (unset: by backend)")
    p.add_argument("--matmul-n", type=positive_int, default=None,
                   help="roofline matmul side per device (unset: by backend)")
    p.add_shared(model="small", shard_counts="16", kv_cache_dtypes="bf16,fp8_e4m3",
                 weight_dtype=True, page_size=64, chunk_size=1024, backend="auto", out="out",
                 progress=True, why={"page_size": TPU_PAGES})
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    check_not_below_page(parser, "--lengths", args.lengths, args.page_size)
    check_not_below_page(parser, "--pool-length", args.pool_length, args.page_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for the largest of `--shards`
    set up, then `--out` created."""
    return build_parser().parse_args(argv)


def _print(rows: list[dict], pool_rows: list[dict], roofs: dict, args) -> None:
    info = machine()
    print_table(list(roofs.values()), ["devices", "read_gb_per_s", "copy_gb_per_s",
                                       "matmul_n", "matmul_gflop_per_s"],
                title=f"roofline: {info['processor']}, {info['cpu_count']} cores, "
                      f"backend {info['backend']}")
    print()
    print_table(rows, ["length", "shards", "dtype", "segment_start", "prefill_tok_per_s",
                       "prefill_compile_s", "prefill_total_s", "prefill_total_tok_per_s",
                       "decode_ms", "dense_decode_ms", "dense_vs_sparse"],
                title=f"{args.model}: one session per (shards, dtype) grows through the lengths; "
                      f"prefill of each segment (compile excluded), decode at its end; backend "
                      f"{resolve_backend(args.backend)}")
    print()
    print_table(rows, ["length", "shards", "dtype", "prefill_gflop_per_s", "prefill_flop_%",
                       "prefill_bw_%", "decode_gb_per_s", "decode_bw_%", "decode_flop_%"],
                title="achieved fraction of the measured roofline (%)")
    if pool_rows:
        print()
        print_table(pool_rows, ["length", "shards", "dtype", "pool_factor",
                                "pool_pages_per_shard", "decode_ms", "decode_vs_smallest_pool"],
                    title="decode at a fixed context vs pool size")


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm
    args = parse_args(argv)
    shard_counts = args.shards
    model = load_model_config(args.model)
    params = init_params(model, seed=0)
    param_bytes = params["model.embed_tokens.weight"].dtype.itemsize
    roofs = {s: measure_roofline(jax.devices()[:s], mem_mib=args.roofline_mib,
                                 matmul_n=args.matmul_n) for s in shard_counts}
    lengths = sorted(set(args.lengths))
    pool_factors = sorted(set(args.pool_factors))
    settings = [(s, d) for s in shard_counts for d in args.kv_cache_dtypes]
    rows, pool_rows = [], []
    for s, d in tqdm(settings, desc="throughput", disable=args.no_progress):
        for row in _grow(model, params, lengths=lengths, shards=s, dtype=d,
                         dense_max=args.dense_max_length, args=args):
            rows.append(row | _roofline_fractions(row, model, roofs[s], args=args,
                                                  param_bytes=param_bytes))
        if len(pool_factors) > 1:
            pool_rows += _pool_rows(model, params, length=args.pool_length,
                                    shards=s, dtype=d, factors=pool_factors, args=args)
    _print(rows, pool_rows, roofs, args)
    out = args.out / "throughput.json"
    write_json(out, {"args": vars(args), "backend": resolve_backend(args.backend),
                     "roofline": roofs, "rows": rows,
                     "pool_rows": pool_rows})
    pngs = _plots(rows, out, args.model)
    print(f"wrote {out}, {', '.join(map(str, pngs))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
