"""Where the time of a step goes: each phase of a decode step and of a prefill chunk, timed on
its own at several context lengths and shard counts, next to the whole step, with each phase's
minimum bytes and flops and the fraction of this machine's measured bandwidth and matmul rate
it achieves.

    cp-runtime bench profile --quick          # 8K and 32K, S = 16 and 2 (writes out/profile.*)
    cp-runtime bench profile                  # 8K, 128K and 1M, S = 16 and 2
    cp-runtime bench profile --model-tpu      # and the TPU v7x model table (bench tpu_model)

Method: timed sub-programs, not JAX's profiler (XLA:CPU's trace names fused ops, not phases).
Each device phase is its own jitted `shard_map` program over the `cp` mesh, given inputs shaped
like the real step's: the step's own device inputs (tokens, positions, per-shard page tables,
rotation, from the same `build_segment` the engine plans with), the engine's pool, and random
activations of the step's shapes. A phase runs for every layer it runs in (a Python loop, as in
the step) and returns what it computes, so XLA keeps all of it. Time = median of `--repeats`
calls after a warm-up call that compiles, each waited for with `block_until_ready`.

Phases, as the step delimits them (cp_runtime/model/attention.py, model/layers.py, engine/step.py):

    host planning and dispatch   the engine's planning and applying of results (its `host_s`)
                                 + the executor's transfer of the plan to the devices + launching
                                 a program that takes the step's arguments and does nothing
                                 (dispatch) + the outputs to the host
    cache write                  write_kv of the step's rows: latent (every layer) and indexer
                                 keys (full layers), owner shard only, pool donated (in place)
    indexer scoring              indexer_page_scores over the shard's pages (full layers)
    local top-K and all-gather   local_candidates, then global_top_pages (full layers), its
                                 gather flat or staged as --gathers says
    sparse attention             attended_pages, owned slots, sparse_attention (every layer)
    merge                        cp_runtime.parallel.merge.combine with --merge and --gathers (every
                                 layer), the output projection left to the dense phase; the
                                 engine runs the same variant
    dense and MoE layers         layers.forward with attention replaced by a stub that only adds
                                 its inputs: embedding, norms, MLA and indexer projections, RoPE,
                                 W_uv/W_o, MLPs and experts, final norm
    sampling                     lm head on the sampled row and sample_tokens (decode only: a
                                 prefill chunk is a "fill" segment, it samples nothing)

Only what the step keeps is timed: a prefill chunk returns nothing but the cache, so XLA drops
its last layer's attention and merge (and a selection only that layer uses) and everything after
the last cache rows; the phase programs drop the same.

The whole step is an engine step (`Engine.step`, a one-token generation or one prefill chunk)
with its host and device seconds (`StepTiming`); the device program is the executor's compiled
step on the same segment, call to done. The sum of phases is shown beside both: it misses the
step's glue between phases and adds each phase program's own launch (at S = 16 virtual CPU
devices a launch alone is most of a small phase: compare S = 2).

Context: a decode step "at N" runs the token at position N - 1 of an N-token session; a prefill
chunk "at N" writes positions [N - chunk, N). The pool is synthetic: random values in every
page, and a session whose page table covers N tokens (nothing is prefilled), so 1M tokens cost
seconds; content decides which pages are selected, not how many.
Minimum work (_shared/profile_work.py's module doc) is all shards together, over the layers the
step keeps.

Fractions are achieved / peak, the peak from benchmarks/_shared/roofline_probe.py measured in
the same run over the same S devices (aggregate over the devices). Elementwise phases report a
bandwidth fraction and little or no flop fraction; collectives are counted as bytes moved.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from tqdm import tqdm

from cp_runtime.benchmarks import registry
from cp_runtime.benchmarks._shared.bench_parser import TPU_PAGES, BenchmarkParser
from cp_runtime.benchmarks._shared.minimum_work import Work
from cp_runtime.benchmarks._shared.plots import token_label
from cp_runtime.benchmarks._shared.profile_phases import PhasePrograms, time_phases
from cp_runtime.benchmarks._shared.profile_report import plot, print_tables
from cp_runtime.benchmarks._shared.profile_steps import (engine_steps, executor_parts, fill_pool,
                                                         program_parts, step_segment,
                                                         synthetic_session)
from cp_runtime.benchmarks._shared.profile_work import (DECODE_PHASES, LABELS, PHASES,
                                                        PREFILL_PHASES, StepShape, phase_work,
                                                        step_shape)
from cp_runtime.benchmarks._shared.results import write_json
from cp_runtime.benchmarks._shared.roofline_probe import measure_roofline
from cp_runtime.cache.layout import cdiv
from cp_runtime.cli.args import check_not_below_page, length_list, positive_int
from cp_runtime.config import MERGE_VARIANTS, ModelConfig, RuntimeConfig, load_model_config
from cp_runtime.engine import Engine, LocalExecutor
from cp_runtime.kernels.dispatch import resolve_backend
from cp_runtime.weights.params import init_params

# The step's shapes and phases are profile_work's, named here too (the command's vocabulary).
__all__ = ["DECODE_PHASES", "PHASES", "PREFILL_PHASES", "StepShape", "phase_work", "step_shape",
           "build_parser", "parse_args", "main"]

FULL_LENGTHS = "8k,128k,1m"
QUICK_LENGTHS = "8k,32k"
QUICK = {"lengths": (FULL_LENGTHS, QUICK_LENGTHS)}
METHOD = ("timed sub-programs: one jitted shard_map program per phase on the step's own inputs "
          "and pool, median of the repeats after a compiling call; host = the engine's host time "
          "+ plan transfer + an empty program with the step's arguments + output fetch")



# -- one shard count ------------------------------------------------------------------------
def _runtime(model: ModelConfig, shards: int, args) -> RuntimeConfig:
    """A pool just big enough for the longest length (plus a page of slack per shard)."""
    pages = cdiv(cdiv(max(args.lengths), args.page_size), shards) + 2
    return RuntimeConfig(model=model.name, kv_cache_dtype=args.kv_cache_dtype,
                         num_shards=shards, pages_per_shard=pages, page_size=args.page_size,
                         chunk_size=args.chunk_size, backend=args.backend, merge=args.merge,
                         gathers=args.gathers, weight_dtype=args.weight_dtype)


def _fractions(work: Work, seconds: float, roof: dict) -> dict:
    gbs, gflops = work.bytes / seconds / 1e9, work.flops / seconds / 1e9
    return {"min_bytes": work.bytes, "min_flops": work.flops, "gb_per_s": gbs,
            "gflop_per_s": gflops, "bw_pct": 100 * gbs / roof["memory_gb_per_s"],
            "flop_pct": 100 * gflops / roof["matmul_gflop_per_s"]}


def profile_step(engine, programs: PhasePrograms, shape: StepShape, roof: dict, *,
                 param_dtype, repeats: int) -> dict:
    """Every phase of one step shape, the whole step and the device program, on a fresh
    synthetic session (closed afterwards)."""
    model, rt, executor = engine.model, engine.runtime, engine.executor
    cached = shape.start if shape.kind == "prefill" else shape.length
    session = synthetic_session(engine, shape.length, cached, model.vocab_size)
    try:
        whole = engine_steps(engine, session, shape, repeats)
        segment = step_segment(engine, session, shape)
        program = program_parts(executor, segment, repeats)
        seconds = time_phases(programs, executor, segment, np.dtype(param_dtype), repeats)
    finally:
        engine.close_session(session.id)
    seconds["host"] = (whole["engine_host_s"] + program["transfer_s"] + program["dispatch_s"]
                       + program["fetch_s"])
    work = phase_work(model, shape, page_size=rt.page_size, kv_cache_dtype=rt.kv_cache_dtype,
                      shards=rt.num_shards, param_bytes=np.dtype(param_dtype).itemsize)
    phases = [{"phase": key, "label": LABELS[key], "seconds": seconds[key],
               **_fractions(work[key], seconds[key], roof)} for key in shape.phases]
    device = sum(p["seconds"] for p in phases if p["phase"] != "host")
    return {"kind": shape.kind, "length": shape.length, "shards": rt.num_shards,
            "queries": shape.length - shape.start, "layers": list(programs.layers),
            "full_layer_slots": list(programs.slots), "phases": phases, **whole,
            **{f"program_{k}": v for k, v in program.items()}, "program_s": program["device_s"],
            "device_phases_s": device, "phases_sum_s": device + seconds["host"]}


def profile_shards(model: ModelConfig, params, shards: int, args, progress) -> dict:
    """Roofline and every (length, kind) step at one shard count, on one engine."""
    roof = measure_roofline(jax.devices()[:shards], mem_mib=args.roofline_mib,
                            matmul_n=args.matmul_n)
    rt = _runtime(model, shards, args)
    executor = LocalExecutor(model, rt, params)
    engine = Engine(model, rt, executor)
    fill_pool(executor)
    mesh, _ = executor_parts(executor)
    param_dtype = params["model.embed_tokens.weight"].dtype            # the host copy's
    programs = {kind: PhasePrograms(model, rt, executor.pool_spec, mesh,
                                    step_shape(kind, max(args.lengths), args.chunk_size))
                for kind in ("decode", "prefill")}
    rows = []
    for length in args.lengths:
        for kind in ("decode", "prefill"):
            shape = step_shape(kind, length, args.chunk_size)
            rows.append(profile_step(engine, programs[kind], shape, roof,
                                     param_dtype=param_dtype, repeats=args.repeats))
            progress(f"{kind} {token_label(length)} S={shards}")
    executor.close()
    return {"roofline": roof, "rows": rows}


# -- command line ---------------------------------------------------------------------------
def build_parser() -> BenchmarkParser:
    p = BenchmarkParser(
        "profile", __doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:3]),
        quick=f"lengths {QUICK_LENGTHS} unless --lengths is given (minutes on a CPU)",
        quick_values=QUICK, check=_check)
    p.add_argument("--lengths", type=length_list, metavar="N[,N...]", help="context lengths")
    p.add_argument("--merge", choices=[m for m in MERGE_VARIANTS if m != "head_scatter"],
                   default="auto",
                   help="merge of the partial attention results (cp_runtime.parallel.merge; "
                        "weights are whole here, so not head_scatter)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed calls per phase and step (the median is reported)")
    p.add_argument("--model-tpu", action="store_true",
                   help="also print the GLM-5.2 tpu7x-16 model table of `cp-runtime bench "
                        "tpu_model` (its defaults)")
    p.add_argument("--roofline-mib", type=positive_int, default=None,
                   help="bandwidth array size, all devices together (unset: by backend)")
    p.add_argument("--matmul-n", type=positive_int, default=None,
                   help="roofline matmul side per device (unset: by backend)")
    p.add_shared(model="small", shard_counts="16,2", kv_cache_dtype="fp8_e4m3",
                 weight_dtype=True, page_size=64, chunk_size=1024, backend="auto", gathers=True,
                 out="out", progress=True,
                 why={"shard_counts": "S = 2 beside 16 shows what 16 devices' launches cost",
                      "page_size": TPU_PAGES})
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    args.lengths = sorted(set(args.lengths))
    args.shards = list(dict.fromkeys(args.shards))
    check_not_below_page(parser, "--lengths", args.lengths, args.page_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for the largest of `--shards`
    set up, then `--out` created."""
    return build_parser().parse_args(argv)


def run(args) -> dict:
    model = load_model_config(args.model)
    params = init_params(model, seed=0)
    t0 = time.perf_counter()
    with tqdm(total=len(args.shards) * len(args.lengths) * 2, desc="profile", leave=False,
              disable=args.no_progress) as bar:
        def progress(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()

        by_shards = {s: profile_shards(model, params, s, args, progress) for s in args.shards}
    return {"method": METHOD, "model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
            "page_size": args.page_size, "chunk_size": args.chunk_size, "merge": args.merge,
            "backend": resolve_backend(args.backend), "repeats": args.repeats,
            "lengths": args.lengths, "shards": args.shards,
            "seconds": time.perf_counter() - t0, "by_shards": by_shards}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_tables(result, args)
    out = args.out
    path = write_json(out / "profile.json", {"args": vars(args), **result})
    png = plot(result, out / "profile.png", args.model)
    print(f"\n{result['seconds']:.0f} s in all; wrote {path}, {png}")
    if args.model_tpu:
        print()
        registry.run("tpu_model", ["--out", str(out)])     # another benchmark: by its name
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
