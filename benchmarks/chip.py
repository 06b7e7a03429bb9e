"""The engine on one accelerator chip, against that chip's own measured peaks: a full-width cut of
a real model (its first `--layers` layers, by default as many as fit beside the pool), random
weights made on the host in their serving dtype, the engine in this process (LocalExecutor, one
shard), prefill and decode timed as the server runs them (`Engine.submit` and `Engine.step`).

    cp-runtime bench chip --model glm-5.2 --contexts 8k,32k,128k --batches 1,8,32 --trace
    cp-runtime bench chip --quick                    # a toy model on the CPU: seconds

Phases, each written to `--out`/chip.json as soon as it ends (a run cut short keeps the rest):

    peaks      the chip's matmul FLOP/s (a [n, n] @ [n, n], bf16 on a TPU and f32 elsewhere, the
               dtype its model matmuls run in; n = 8192 on a TPU; mean of --repeats calls) and
               HBM GB/s (an f32 array of 1 GiB on a TPU: x + 1, bytes read and written, and its
               sum, bytes read; each the mean of --repeats calls; the larger is the HBM rate)
    weights    random weights made on the host in their stored dtype (cp_runtime.weights.host_init:
               fp8 values and block scales where the model serves fp8), then placed by the
               executor: bytes placed / seconds, every copy waited for
    cold start the pool and weights placed, and every program compiled on the way (JAX's backend
               compiles, counted and timed through jax.monitoring: the step programs and the
               small ones), with the wall time of each phase's first step
    prefill    at each --contexts C, a fresh session's C random tokens in --chunk-size steps
               (Engine.submit(Extend), Engine.step until done): warm tokens/s = C / (the steps'
               wall seconds less the compile seconds inside them), and the MXU floor's share
    decode     at the longest context that prefilled (forked B times a page or more before its
               end, so that the decode rows stay on its pages), B generations decoded together
               (Engine.submit(Generate), one Engine.step a token each): median ms a step after
               a compiling one, against the HBM floor; the engine's host seconds of a step
               (planning, applying results) and the executor's (transfers, program, fetch)
    trace      with --trace, one prefill chunk at the longest context and --trace-steps decode
               steps at each B run under jax.profiler.trace; each named step phase's device ms
               (benchmarks/_shared/chip_trace.py says how the trace is read), the programs'
               device ms,
               and the host ms of a step: its wall ms less that

Floors, one formula each (benchmarks/_shared/minimum_work.py's Work: flops and bytes a step
must do):

    prefill of C tokens, chunks of c:
        flops  = prefill_work(C, c).flops         dense layers 2 W_tok per token, the Hadamard
                                                  rotations, one lm-head row a chunk; indexer
                                                  F * pairs * Hi * (2 Di + 3); attention
                                                  L * pairs * 2 H (D_lat + kv_lora)
        MXU floor s = flops / measured matmul FLOP/s;   share = floor s / warm s
    decode step of B rows at context t (page p = t // ps, K = index_topk // ps):
        bytes  = W(B)                             every weight as stored (fp8 values and their
                                                  scales, bf16, f32) once, the lm head whole,
                                                  the embedding's B rows, min(E, B k) / E of
                                                  each routed-expert stack
               + B * (F * p ps * Di * c_idx       the indexer's keys before the row's page
                      + L * (1 + min(K, p)) * ps * D_lat * c_lat     the attended latent pages
                      + bytes_per_token)          the row's cache write
        HBM floor ms = bytes / measured HBM GB/s;   share = floor ms / measured ms a step

Token selection reads the page of each selected token, up to index_topk pages a row rather than
K + 1: its floor is the least it must read (its selected tokens' rows are within a page of
(K + 1) pages' worth), not what its kernels read. The shares are in (0, 1] when the floors are
floors; where a share is above 1, the formula or the peak is wrong, not the chip fast.

Robustness: each phase's failure is written with its error and the run goes on. On a TPU a
step that fails for another reason than memory is retried once on a simpler runtime, the
fp8-scored indexer, fp8 MLP rows and halved chunks off (`indexer_scores = "cache"`, `mlp_rows =
"wire"`, `chunk_halves = "off"`), then once more with the XLA kernels (`backend = "xla"`), each
placing the same host weights anew; `variant` in each row says which ran. `--budget-s` stops
starting phases once that many seconds have passed.
"""

from __future__ import annotations

import argparse
import gc
import logging
import pathlib
import statistics
import sys
import tempfile
import time
import traceback

from cp_runtime.benchmarks._shared.bench_parser import BY_QUICK, TPU_PAGES, BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import (add_selection, check_not_below_page, finite_nonnegative_float,
                                 format_length, length_list, positive_int, positive_int_list)
from cp_runtime.config import WEIGHT_MODES, load_model_config

__all__ = ["build_parser", "parse_args", "run", "main"]

DEFAULT_CONTEXTS = (8 << 10, 32 << 10, 128 << 10)
LONG_CONTEXT = 1 << 20            # added to the default contexts where its pool fits
QUICK_CONTEXTS = (512, 1024)
QUICK_LAYERS = 2                  # tiny's first two: a full and a shared indexer, dense and MoE
QUICK = {"model": ("glm-5.2", "tiny"),
         "chunk_size": ("8k", "512"),
         "batches": ("1,8,32", "1,2"),
         "decode_steps": ("10", "3"),
         "repeats": ("10", "3")}
# The simpler runtimes a TPU run falls back to, in order (module docstring).
FALLBACKS = ({"indexer_scores": "cache", "mlp_rows": "wire", "chunk_halves": "off"},
             {"indexer_scores": "cache", "mlp_rows": "wire", "chunk_halves": "off",
              "backend": "xla"})
_OOM = ("resource_exhausted", "out of memory", "ran out of memory", "exceeds the memory")


# -- command line ---------------------------------------------------------------------------
def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("chip", __doc__.split("\n\n")[0],
                        quick="a toy model (tiny, 2 layers) on short contexts, small chunks "
                              "and batches: under a minute on a CPU, mostly compiles",
                        quick_values=QUICK, check=_check)
    p.add_argument("--layers", type=positive_int, default=None, metavar="N",
                   help="the model's first N layers, full width (default: as many as fit "
                        f"beside a pool for the longest context; --quick: {QUICK_LAYERS})")
    p.add_argument("--contexts", type=length_list, default=None, metavar="N[,N...]",
                   help="prefill context lengths (default: 8k,32k,128k, and 1m where its pool "
                        "fits beside the layers; --quick: 512,1k)")
    p.add_argument("--batches", type=positive_int_list, metavar="B[,B...]",
                   help="decode batch sizes, at the longest context")
    p.add_argument("--decode-steps", type=positive_int, help="timed decode steps per batch")
    p.add_argument("--weights", choices=WEIGHT_MODES, default="replicated",
                   help="the runtime's weights mode (default replicated: one chip holds the "
                        "whole cut; sharded over one device runs the split weights' "
                        "collectives over a single shard)")
    add_selection(p)
    p.add_argument("--repeats", type=positive_int,
                   help="calls of each peak measurement, the mean reported")
    p.add_argument("--matmul-n", type=positive_int, default=None,
                   help="the peak matmul's side (unset: 8192 on a TPU, 512 elsewhere)")
    p.add_argument("--copy-mib", type=positive_int, default=None,
                   help="the peak bandwidth's array, MiB (unset: 1024 on a TPU, 64 elsewhere)")
    p.add_argument("--trace", action="store_true",
                   help="also run a prefill chunk and decode steps under jax.profiler.trace "
                        "and report each step phase's device time (traces kept in "
                        "OUT/chip_trace)")
    p.add_argument("--trace-steps", type=positive_int, default=3,
                   help="decode steps per batch run under the trace")
    p.add_argument("--budget-s", type=finite_nonnegative_float, default=0.0,
                   help="start no phase after this many seconds (default 0: no budget)")
    p.add_shared(model=BY_QUICK, kv_cache_dtype="fp8_e4m3", weight_dtype=True, page_size=64,
                 chunk_size=BY_QUICK, backend="auto", seed="the random weights and prompts",
                 out="out", progress=True,
                 why={"page_size": TPU_PAGES,
                      "chunk_size": "8K-token prefill chunks, a chip's worth of queries"})
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    model = load_model_config(args.model)
    if args.layers is not None and args.layers > model.num_hidden_layers:
        parser.error(f"--layers {args.layers}: {args.model} has {model.num_hidden_layers}")
    if args.contexts is not None:
        args.contexts = sorted(set(args.contexts))
        check_not_below_page(parser, "--contexts", args.contexts, args.page_size)
    args.batches = sorted(set(args.batches))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), then `--out` created."""
    return build_parser().parse_args(argv)


# -- the run's record -----------------------------------------------------------------------
class _Record:
    """The result so far, written to OUT/chip.json after every phase."""

    def __init__(self, out: pathlib.Path | None, args):
        self.path = None if out is None else out / "chip.json"
        self.t0 = time.perf_counter()
        self.data = {"args": {k: v for k, v in vars(args).items()}, "errors": [],
                     "skipped": [], "prefill": [], "decode": [], "phases": [], "variants": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        self.data["elapsed_s"] = self.elapsed()
        if self.path is not None:
            try:
                write_json(self.path, self.data)
            except Exception as e:        # noqa: BLE001 - a full disk must not end the run
                print(f"chip: cannot write {self.path}: {e}", file=sys.stderr)

    def error(self, phase: str, variant: int, e: BaseException, detail: str | None) -> dict:
        entry = {"phase": phase, "variant": variant, "type": type(e).__name__,
                 "message": str(e)[:4000], "detail": (detail or "")[:4000],
                 "traceback": traceback.format_exc(limit=-6)[-4000:],
                 "out_of_memory": _is_oom(f"{e} {detail or ''}")}
        self.data["errors"].append(entry)
        self.save()
        say(f"{phase}: FAILED ({entry['type']}: {entry['message'][:300]})")
        return entry


def say(line: str) -> None:
    print(f"chip: {line}", flush=True)


def _is_oom(text: str) -> bool:
    """Out of HBM (a kernel out of VMEM is not: another variant may do without it)."""
    text = text.lower()
    if "vmem" in text or "smem" in text:
        return False
    return any(k in text for k in _OOM) or ("allocat" in text and "memory" in text)


class _Progress:
    """tqdm where it is installed (not on every TPU host), else nothing."""

    def __init__(self, total: int, desc: str, disable: bool):
        self.bar = None
        if not disable:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="tok", unit_scale=True,
                                leave=False, mininterval=2)
            except ImportError:
                pass

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _StepFailed(RuntimeError):
    pass


class _LogTimes(logging.Handler):
    """The executor's own pool and weight seconds, from its start-up log records."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seconds: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        for key in ("pool:", "weights:"):
            if msg.startswith(key) and record.args:
                try:
                    self.seconds[key[:-1]] = float(record.args[-1])
                except (TypeError, ValueError):
                    pass


# -- the engine, its variants ----------------------------------------------------------------
class _Bench:
    """The engine on the chip: its runtime variants (the requested one, then on a TPU the
    FALLBACKS), the host weights placed for each, and the session decode forks from."""

    def __init__(self, model, runtime, source, compiles, record: _Record, args, tpu: bool):
        import dataclasses
        self.model, self.source, self.compiles, self.record, self.args = (model, source,
                                                                          compiles, record, args)
        self.tpu = tpu
        self.runtimes = [runtime] + ([dataclasses.replace(runtime, **f) for f in FALLBACKS]
                                     if tpu else [])
        self.variant = -1
        self.executor = self.engine = self.recorder = None
        self.parent = None                 # (context, session id) decode forks from
        self.ok_contexts: list[int] = []

    @property
    def runtime(self):
        return self.runtimes[self.variant]

    def next_variant(self) -> bool:
        """Place the weights for the next runtime variant (the old executor's freed first);
        False when there is none left or it cannot be built."""
        from cp_runtime.benchmarks._shared.chip_trace import Recorder
        from cp_runtime.engine import Engine, LocalExecutor

        while self.variant + 1 < len(self.runtimes):
            self.variant += 1
            self.executor = self.engine = self.recorder = self.parent = None
            gc.collect()
            rt = self.runtime
            handler, logger = _LogTimes(), logging.getLogger("cp_runtime.engine.executor")
            level = logger.level
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            programs, compile_s = self.compiles.snapshot()
            t0 = time.perf_counter()
            try:
                executor = LocalExecutor(self.model, rt, self.source)
            except Exception as e:        # noqa: BLE001 - recorded; the next variant may do
                self.record.error(f"build variant {self.variant}", self.variant, e, None)
                continue
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            build_s = time.perf_counter() - t0
            placed = sum(t.nbytes_per_device for t in executor.weight_tensors.values())
            place_s = handler.seconds.get("weights", build_s)
            entry = {"variant": self.variant, "overrides": self._overrides(),
                     "weights_mode": executor.runtime.weights,
                     "weight_dtype": executor.runtime.weight_dtype,
                     "build_s": build_s, "pool_s": handler.seconds.get("pool"),
                     "weights_place_s": place_s, "weights_bytes": placed,
                     "weights_gb_per_s": placed / max(place_s, 1e-9) / 1e9,
                     "pool_bytes": _pool_nbytes(executor),
                     "programs_compiled": self.compiles.programs - programs,
                     "compile_s": self.compiles.seconds - compile_s}
            self.record.data["variants"].append(entry)
            self.record.save()
            say(f"variant {self.variant} ({entry['overrides'] or 'as asked'}): "
                f"{placed / 1e9:.3g} GB of weights placed in {place_s:.3g} s "
                f"({entry['weights_gb_per_s']:.3g} GB/s)")
            self.executor = executor
            self.recorder = Recorder(executor)
            self.engine = Engine(self.model, rt, executor, seed=self.args.seed)
            return True
        return False

    def _overrides(self) -> dict:
        return {} if self.variant == 0 else dict(FALLBACKS[self.variant - 1])

    def fresh_engine(self) -> None:
        """A new engine on the same executor (a failed step leaves its sessions rebuilding)."""
        from cp_runtime.engine import Engine
        self.parent = None
        if self.executor is not None:
            self.engine = Engine(self.model, self.runtime, self.executor, seed=self.args.seed)

    def attempt(self, phase: str, fn):
        """fn() under the current variant; on a failure the error is recorded and, where a
        device step failed for another reason than HBM, fn is tried again under the next
        variant (a failure of the host's own work, or out of memory, would fail there too).
        None if none succeeded."""
        while self.engine is not None:
            detail = None
            try:
                return fn()
            except Exception as e:        # noqa: BLE001 - recorded, and the run goes on
                detail = self.recorder.last_error if self.recorder else None
                entry = self.record.error(phase, self.variant, e, detail)
            # Out of the except block: the exception's frames, which hold the old engine's
            # arrays, are gone before another executor places its weights.
            if self.recorder is not None:
                self.recorder.last_error = None
                self.recorder.recording = False
            if (detail is None or entry["out_of_memory"]
                    or self.variant + 1 >= len(self.runtimes)):
                self.fresh_engine()
                return None
            if not self.next_variant():
                return None
        return None


def _pool_nbytes(executor) -> int:
    import jax
    return sum(x.nbytes for x in jax.tree.leaves(executor.pool))


# -- steps ----------------------------------------------------------------------------------
def _run_steps(bench: _Bench, count: int | None) -> list[dict]:
    """`count` engine steps (None: until no work is left), each timed: wall seconds, the
    compiles inside it, the engine's host and device seconds. A failed step raises."""
    from cp_runtime.engine.requests import Failed

    engine, rows = bench.engine, []
    while engine.has_work and (count is None or len(rows) < count):
        programs, compile_s = bench.compiles.snapshot()
        t0 = time.perf_counter()
        events = engine.step()
        wall = time.perf_counter() - t0
        failed = [e for e in events if isinstance(e, Failed)]
        if failed:
            raise _StepFailed(f"{failed[0].code}: {failed[0].message}")
        timing = engine.timings[-1] if engine.timings else None
        rows.append({"wall_s": wall, "compile_s": bench.compiles.seconds - compile_s,
                     "programs": bench.compiles.programs - programs,
                     "host_s": getattr(timing, "host_s", None),
                     "device_s": getattr(timing, "device_s", None)})
    return rows


def _prefill(bench: _Bench, context: int, tokens, progress: bool) -> tuple[str, list[dict]]:
    """A fresh session of `context` tokens through the engine's steps: (its id, the steps)."""
    from cp_runtime.engine.requests import Extend

    engine = bench.engine
    session = engine.create_session()
    engine.submit(Extend(id=("chip", context), session=session.id, tokens=tokens[:context]))
    bar = _Progress(context, f"prefill {format_length(context)}", not progress)
    steps = []
    try:
        while engine.has_work:
            steps += _run_steps(bench, 1)
            bar.update(min(bench.args.chunk_size, context - bench.args.chunk_size
                           * (len(steps) - 1)))
    finally:
        bar.close()
    return session.id, steps


# -- phases ---------------------------------------------------------------------------------
def _prefill_phase(bench: _Bench, context: int, tokens, peaks: dict) -> None:
    from cp_runtime.benchmarks._shared.chip_measure import prefill_floor, weight_read_bytes

    args = bench.args
    if bench.parent is not None:            # one long session at a time
        bench.engine.close_session(bench.parent[1])
        bench.parent = None
    session, steps = _prefill(bench, context, tokens, not args.no_progress)
    wall = sum(s["wall_s"] for s in steps)
    compile_s = sum(s["compile_s"] for s in steps)
    warm = max(wall - compile_s, 1e-9)
    row = {"context": context, "variant": bench.variant, "chunks": len(steps),
           "wall_s": wall, "compile_s": compile_s,
           "programs_compiled": sum(s["programs"] for s in steps), "warm_s": warm,
           "first_step_s": steps[0]["wall_s"], "tok_per_s": context / warm,
           "engine_host_s": sum(s["host_s"] or 0.0 for s in steps)}
    floor = None
    if peaks:
        weights = weight_read_bytes(bench.executor.weight_tensors, bench.model,
                                    args.chunk_size, 1)
        floor = prefill_floor(bench.model, peaks, context=context, chunk=args.chunk_size,
                              page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
                              weight_bytes=weights)
        row.update(floor.as_dict("floor"), mxu_share=floor.mxu_s / warm,
                   hbm_share=floor.hbm_s / warm)
    bench.record.data["prefill"].append(row)
    bench.record.save()
    bench.parent = (context, session)
    bench.ok_contexts.append(context)
    say(f"prefill {format_length(context)}: {row['tok_per_s']:,.0f} tok/s warm ({warm:.2f} s; "
        f"{compile_s:.1f} s of {row['programs_compiled']} compiles)"
        + (f", MXU floor {floor.mxu_s:.3f} s = {100 * row['mxu_share']:.1f}%" if floor else ""))


def _decode_fork_length(context: int, args) -> int:
    """Where decode forks a session of `context` tokens: whole pages before its end, room for
    every token the forks will write, so the rows' page tables stay the prefill's width."""
    tokens = args.decode_steps + args.trace_steps + 3
    back = -(-tokens // args.page_size) * args.page_size
    return max(1, context - back)


def _ensure_parent(bench: _Bench, contexts: list[int], tokens) -> tuple[int, str]:
    """The session decode forks from: the longest context that prefilled (prefilled again
    where a failure replaced the engine)."""
    if bench.parent is not None:
        return bench.parent
    context = max(bench.ok_contexts or contexts)
    session, _ = _prefill(bench, context, tokens, False)
    bench.parent = (context, session)
    return bench.parent


def _decode_phase(bench: _Bench, batch: int, contexts: list[int], tokens, peaks: dict,
                  trace_dir: pathlib.Path | None) -> None:
    from cp_runtime.benchmarks._shared.chip_measure import decode_floor
    from cp_runtime.engine.requests import Generate, SamplingParams

    args, engine = bench.args, bench.engine
    context, parent = _ensure_parent(bench, contexts, tokens)
    at = _decode_fork_length(context, args)
    trace_steps = args.trace_steps if trace_dir is not None else 0
    forks = [engine.fork(parent, at).id for _ in range(batch)]
    try:
        for i, fork in enumerate(forks):
            engine.submit(Generate(id=("chip", batch, i), session=fork,
                                   sampling=SamplingParams(max_tokens=1 + args.decode_steps
                                                           + trace_steps)))
        first = _run_steps(bench, 1)[0]
        steps = _run_steps(bench, args.decode_steps)
        traced = None
        if trace_dir is not None:
            traced = _traced(bench, trace_dir / f"decode_b{batch}",
                             lambda: _run_steps(bench, trace_steps), trace_steps)
        _run_steps(bench, None)                          # nothing left, normally
    finally:
        for fork in forks:
            if fork in engine.sessions:
                engine.close_session(fork)
    median = statistics.median(s["wall_s"] for s in steps)
    row = {"batch": batch, "context": at, "variant": bench.variant, "steps": len(steps),
           "step_ms": 1e3 * median,
           "step_ms_mean": 1e3 * statistics.fmean(s["wall_s"] for s in steps),
           "tok_per_s": batch / median, "first_step_s": first["wall_s"],
           "first_step_compile_s": first["compile_s"],
           "programs_compiled": first["programs"] + sum(s["programs"] for s in steps),
           "engine_host_ms": 1e3 * statistics.median(s["host_s"] or 0.0 for s in steps),
           "executor_ms": 1e3 * statistics.median(s["device_s"] or 0.0 for s in steps)}
    floor = None
    if peaks:
        floor = decode_floor(bench.model, peaks, bench.executor.weight_tensors, batch=batch,
                             context=at + args.decode_steps // 2, page_size=args.page_size,
                             kv_cache_dtype=args.kv_cache_dtype)
        row.update(floor.as_dict("floor"), hbm_share=floor.hbm_s / median)
    if traced is not None:
        row["trace"] = traced
        if traced.get("available"):
            device = traced.get("module_ms") or traced["busy_ms"]
            row["device_ms"] = device
            row["host_ms"] = row["step_ms"] - device
            _phase_rows(bench, f"decode B={batch}", traced)
    bench.record.data["decode"].append(row)
    bench.record.save()
    extra = (f"; device {row['device_ms']:.2f} ms, host {row['host_ms']:.2f} ms"
             if "device_ms" in row else "")
    say(f"decode B={batch} at {format_length(at)}: {row['step_ms']:.2f} ms a step"
        + (f", HBM floor {1e3 * floor.hbm_s:.2f} ms = {100 * row['hbm_share']:.1f}%"
           if floor else "") + extra)


def _phase_rows(bench: _Bench, step: str, traced: dict) -> None:
    """A row per phase: its device ms a step, and on a TPU the compiler's estimate for this
    chip and measured / estimated (the calibration `compile --matrix --calibration` reads)."""
    estimated = traced.get("estimated_ms") or {}
    for phase, ms in traced["phases_ms"].items():
        row = {"step": step, "phase": phase, "device_ms": ms, "variant": bench.variant}
        if estimated.get(phase):
            row.update(estimated_ms=estimated[phase], measured_over_estimate=(
                ms / estimated[phase]))
        bench.record.data["phases"].append(row)


def _traced(bench: _Bench, log_dir: pathlib.Path, fn, steps: int) -> dict:
    """fn() (engine steps) under jax.profiler.trace into `log_dir`; each step phase's device
    ms a step, or why not. The steps run whether or not the profiler does; a step's failure
    is raised, the profiler's is reported."""
    from cp_runtime.benchmarks._shared import chip_trace

    why = None
    bench.recorder.start()
    try:
        try:
            chip_trace.start_trace(log_dir)
            tracing = True
        except Exception as e:            # noqa: BLE001 - the steps are timed all the same
            why, tracing = f"the profiler did not start: {type(e).__name__}: {e}", False
        try:
            fn()
        finally:
            if tracing:
                try:
                    chip_trace.stop_trace()
                except Exception as e:    # noqa: BLE001
                    why = f"the profiler did not stop: {type(e).__name__}: {e}"
    finally:
        segments = bench.recorder.stop()
    if why is not None:
        return {"available": False, "why": why[:2000]}
    try:
        texts = chip_trace.compiled_texts(bench.executor, segments)
        traced = chip_trace.phase_times(chip_trace.newest_xplane(log_dir), texts, steps)
    except Exception as e:                # noqa: BLE001 - the numbers above stand without it
        return {"available": False, "why": f"{type(e).__name__}: {e}"[:2000]}
    peaks = bench.record.data.get("peaks")
    if traced.get("available") and peaks and bench.tpu:
        try:
            traced["estimated_ms"] = chip_trace.estimated_phase_ms(
                texts, bench.executor.mesh.devices.flat[0], peaks)
        except Exception as e:            # noqa: BLE001 - the measured phases stand alone
            traced["estimated_why"] = f"{type(e).__name__}: {e}"[:2000]
    return traced


def _prefill_trace_phase(bench: _Bench, tokens, trace_dir: pathlib.Path) -> None:
    """One prefill chunk at the longest context, under the trace: a fork a chunk before the
    parent's end, extended by that chunk (the same program as the prefill's last chunk)."""
    from cp_runtime.engine.requests import Extend

    args, engine = bench.args, bench.engine
    context, parent = _ensure_parent(bench, bench.ok_contexts, tokens)
    start = max(context - args.chunk_size, 0)
    child = engine.fork(parent, start).id if start else engine.create_session().id
    try:
        engine.submit(Extend(id=("chip", "trace"), session=child, tokens=tokens[start:context]))
        traced = _traced(bench, trace_dir / "prefill", lambda: _run_steps(bench, None), 1)
    finally:
        if child in engine.sessions:
            engine.close_session(child)
    entry = {"context": context, "start": start, "variant": bench.variant, **traced}
    bench.record.data["prefill_trace"] = entry
    if traced.get("available"):
        _phase_rows(bench, f"prefill chunk at {format_length(context)}", traced)
    bench.record.save()
    say(f"prefill chunk traced at {format_length(context)}: "
        + (f"{traced.get('module_ms') or traced['busy_ms']:.1f} ms on the device"
           if traced.get("available") else f"no phases ({traced.get('why')})"))


# -- the run --------------------------------------------------------------------------------
def _plan(args, model_full, weight_dtype: str, memory: int) -> tuple[list[int], dict]:
    """(contexts, the layers' fit) for the flags: the layers that fit beside a pool for the
    longest context asked (the defaults' 128K), then 1M added to the default contexts where
    its pool fits beside those layers too."""
    from cp_runtime.benchmarks._shared.chip_measure import fit_layers

    if args.contexts is not None:
        contexts = list(args.contexts)
    elif args.quick:
        contexts = list(QUICK_CONTEXTS)
    else:
        contexts = list(DEFAULT_CONTEXTS)
    common = dict(weight_dtype=weight_dtype, kv_cache_dtype=args.kv_cache_dtype,
                  memory=memory, page_size=args.page_size, chunk=args.chunk_size)
    layers = args.layers
    if layers is None and args.quick:
        layers = min(QUICK_LAYERS, model_full.num_hidden_layers)
    fit = fit_layers(model_full, pages=_pages(max(contexts), args), layers=layers, **common)
    if args.contexts is None and not args.quick:
        longer = fit_layers(model_full, pages=_pages(LONG_CONTEXT, args),
                            layers=fit["layers"], **common)
        if longer["fits"]:
            contexts.append(LONG_CONTEXT)
            fit = longer
    return contexts, fit


def _pages(context: int, args) -> int:
    """Pool pages: the longest session, and beside it the larger of a traced chunk's fork and
    the widest decode batch's forks (each a copied page and its tokens' pages), and slack."""
    ps = args.page_size
    fork = -(-(args.decode_steps + args.trace_steps + 3) // ps) + 2
    return -(-context // ps) + max(-(-args.chunk_size // ps) + 2, max(args.batches) * fork) + 2


def _runtime(model, args, pages: int):
    from cp_runtime.config import RuntimeConfig
    return RuntimeConfig(model=model.name, kv_cache_dtype=args.kv_cache_dtype, num_shards=1,
                         pages_per_shard=pages, page_size=args.page_size,
                         chunk_size=args.chunk_size, max_batch=max(args.batches),
                         backend=args.backend, weights=args.weights,
                         weight_dtype=args.weight_dtype, selection=args.selection,
                         max_queued_tokens=0)


def run(args) -> dict:
    """Every phase in order; returns the record (also in OUT/chip.json after each phase)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cp_runtime.benchmarks._shared.chip_measure import Compiles, cut_model, measure_peaks
    from cp_runtime.weights.format import resolve_weight_dtype
    from cp_runtime.weights.host_init import RandomBlocks
    from cp_runtime.weights.placement import device_memory_bytes

    record = _Record(args.out, args)
    compiles = Compiles().install()
    try:
        t0 = time.perf_counter()
        device = jax.devices()[0]
        backend_s = time.perf_counter() - t0
        tpu = device.platform == "tpu"
        model_full = load_model_config(args.model)
        weight_dtype = resolve_weight_dtype(args.weight_dtype, model_full)
        memory = device_memory_bytes()
        contexts, fit = _plan(args, model_full, weight_dtype, memory)
        model = cut_model(model_full, fit["layers"])
        pages = _pages(max(contexts), args)
        record.data.update(
            device={"platform": device.platform, "kind": device.device_kind,
                    "memory_bytes": memory, "backend_init_s": backend_s},
            model={"name": args.model, "layers": fit["layers"],
                   "of_layers": model_full.num_hidden_layers, "weight_dtype": weight_dtype,
                   "moe_layers": sum(model.is_moe_layer(i)
                                     for i in range(model.num_hidden_layers))},
            fit=fit, contexts=contexts, batches=args.batches, pool_pages=pages)
        record.save()
        say(f"{device.device_kind} ({device.platform}, {memory / 2**30:.1f} GiB): "
            f"{args.model} cut to {fit['layers']} of {model_full.num_hidden_layers} layers "
            f"({fit['weight_bytes'] / 1e9:.3g} GB of {weight_dtype} weights, "
            f"{fit['pool_bytes'] / 1e9:.3g} GB pool{'' if fit['fits'] else ', DOES NOT FIT'}); "
            f"contexts {','.join(map(format_length, contexts))}, batches {args.batches}")

        # peaks: before the weights, whose memory they would need
        n = args.matmul_n or (8192 if tpu else 512)
        copy = (args.copy_mib or (1024 if tpu else 64)) << 20
        try:
            peaks = measure_peaks(matmul_n=n, matmul_dtype=jnp.bfloat16 if tpu else jnp.float32,
                                  copy_bytes=copy, repeats=args.repeats)
        except Exception as e:            # noqa: BLE001 - no floors then, the rest still runs
            record.error("peaks", -1, e, None)
            peaks = None
        record.data["peaks"] = peaks
        record.save()
        if peaks:
            say(f"peaks: matmul {peaks['matmul_tflop_per_s']:.3g} TFLOP/s ({n}^3 "
                f"{peaks['matmul_dtype']}), HBM copy {peaks['hbm_copy_gb_per_s']:.3g} GB/s, "
                f"read {peaks['hbm_read_gb_per_s']:.3g} GB/s")
        gc.collect()

        # weights on the host, in their stored dtype
        t0 = time.perf_counter()
        source = RandomBlocks(model, weight_dtype, seed=args.seed)
        source.prepare()
        host_s = time.perf_counter() - t0
        record.data["cold_start"] = {"backend_init_s": backend_s, "host_init_s": host_s,
                                     "host_bytes": source.nbytes}
        record.save()
        say(f"weights made on the host: {source.nbytes / 1e9:.3g} GB in {host_s:.2f} s")

        bench = _Bench(model, _runtime(model, args, pages), source, compiles, record, args,
                       tpu)
        if not bench.next_variant():
            return record.data
        cold = record.data["variants"][0]
        record.data["cold_start"].update(
            weights_place_s=cold["weights_place_s"], weights_bytes=cold["weights_bytes"],
            weights_gb_per_s=cold["weights_gb_per_s"], pool_s=cold["pool_s"],
            executor_build_s=cold["build_s"])
        record.save()
        tokens = np.random.default_rng(args.seed).integers(
            0, model.vocab_size, max(contexts), dtype=np.int64).astype(np.int32)
        trace_dir = None
        if args.trace:
            trace_dir = (args.out or pathlib.Path(tempfile.mkdtemp())) / "chip_trace"

        def budget(phase: str) -> bool:
            if args.budget_s and record.elapsed() > args.budget_s:
                record.data["skipped"].append({"phase": phase, "why": "budget"})
                record.save()
                say(f"{phase}: skipped (--budget-s {args.budget_s:g} passed)")
                return False
            return True

        for context in contexts:
            name = f"prefill {format_length(context)}"
            if budget(name):
                bench.attempt(name, lambda c=context: _prefill_phase(bench, c, tokens, peaks))
        if (trace_dir is not None and bench.engine is not None and bench.ok_contexts
                and budget("prefill trace")):
            bench.attempt("prefill trace", lambda: _prefill_trace_phase(bench, tokens,
                                                                        trace_dir))
        for batch in args.batches:
            if budget(f"decode B={batch}"):
                bench.attempt(f"decode B={batch}",
                              lambda b=batch: _decode_phase(bench, b, contexts, tokens, peaks,
                                                            trace_dir))
        record.data["cold_start"].update(
            programs_compiled=compiles.programs, compile_s=compiles.seconds,
            backend_compile_s=compiles.backend_seconds,
            step_programs=len(bench.recorder.shapes) if bench.recorder else None)
        record.save()
        return record.data
    finally:
        compiles.uninstall()


# -- output ---------------------------------------------------------------------------------
def print_tables(data: dict) -> None:
    info = machine()
    device = data.get("device", {})
    print(f"\n{data.get('model', {}).get('name')} cut to {data.get('model', {}).get('layers')} "
          f"layers on {device.get('kind')} ({info['backend']})")
    if data.get("peaks"):
        print_table([data["peaks"]], ["matmul_n", "matmul_dtype", "matmul_tflop_per_s",
                                      "hbm_copy_gb_per_s", "hbm_read_gb_per_s"],
                    title="\nthe chip's peaks, measured")
    if data.get("cold_start"):
        print_table([data["cold_start"]], ["host_init_s", "weights_bytes", "weights_place_s",
                                           "weights_gb_per_s", "step_programs",
                                           "programs_compiled", "compile_s"],
                    title="\ncold start: weights placed, programs compiled")
    if data["prefill"]:
        print_table(data["prefill"], ["context", "variant", "chunks", "tok_per_s", "warm_s",
                                      "compile_s", "programs_compiled", "floor_mxu_ms",
                                      "mxu_share"],
                    title="\nprefill (warm: compile excluded), against the MXU floor")
    if data["decode"]:
        print_table(data["decode"], ["batch", "context", "variant", "step_ms", "tok_per_s",
                                     "engine_host_ms", "executor_ms", "device_ms", "host_ms",
                                     "floor_hbm_ms", "hbm_share"],
                    title="\ndecode at the longest context, against the HBM floor")
    if data["phases"]:
        columns = ["step", "phase", "device_ms"]
        if any("estimated_ms" in row for row in data["phases"]):
            columns += ["estimated_ms", "measured_over_estimate"]
        print_table(data["phases"], columns,
                    title="\neach step phase's device ms a step (profiler trace), beside the "
                          "compiler's estimate for this chip where it is a TPU")
    for e in data["errors"]:
        print(f"error in {e['phase']} (variant {e['variant']}): {e['type']}: "
              f"{e['message'][:200]}")


def main(argv: list[str] | None = None) -> int:
    from cp_runtime.platform import keep_jax_off_absent_tpus
    keep_jax_off_absent_tpus()
    args = parse_args(argv)
    data = run(args)
    print_tables(data)
    if args.out is not None:
        print(f"\n{data['elapsed_s']:.0f} s in all; wrote {args.out / 'chip.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
