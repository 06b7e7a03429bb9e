"""`cp-runtime compile`: check that a deployment compiles for, and fits, a TPU slice, on any
machine (libtpu compiles for a compile-only topology; no TPU and no array is needed).

Loads cp_runtime.aot (and through it libtpu) only when run, so the other commands never start
libtpu. The table's summary and heading print before the first compile and each program's row
as it finishes; while one compiles, a status line on stderr names it (on a terminal, with its
seconds so far).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import threading
import time

from cp_runtime.cache.capacity import TOPOLOGIES
from cp_runtime.config import (ATTENTION_LAYOUTS, CHUNK_HALVES, RESIDUAL_MODES,
                                ROW_ATTENTION_MODES, TPU_SCHEDULES)
from cp_runtime.cli.args import (HelpFormatter, add_chunk_size, add_expert_groups,
                                 add_kv_cache_dtype, add_latent_memory, add_model, add_page_size,
                                 add_selection, add_weight_dtype, add_weights, length,
                                 positive_int)

__all__ = ["add_compile", "run_compile", "PROGRAM_NAMES"]

PROGRAM_NAMES = ("decode", "prefill_fill", "prefill_sample", "prefill_logits",
                 "experts_to_groups", "experts_to_one", "row_export_latent",
                 "row_export_indexer", "row_import", "page_copy")
# With --latent-device-pages, each step program also over the HBM tier alone.
PROGRAM_NAMES += tuple(f"{name}_in_hbm" for name in PROGRAM_NAMES[:4])
EXIT_NO_LIBTPU = 2


def add_compile(sub) -> None:
    p = sub.add_parser(
        "compile", help="compile every program of a deployment for a TPU slice (no TPU needed)",
        formatter_class=HelpFormatter,
        description="Lower every program the executor runs on the slice (the decode step, a "
                    "prefill chunk with and without its lm head, snapshot row export and "
                    "import, the page copy of forks) from shapes alone, compile each with "
                    "XLA:TPU and Mosaic for the topology's compile-only devices, and print per "
                    "program: compiled or the compiler's error, compile seconds, per-device "
                    "argument/output/alias/temporary bytes, the peak against HBM, and the "
                    "compiler's flops, bytes and time estimate. Needs the tpu extra (libtpu); "
                    "what compiling cannot show (DMA timing, real collectives, HBM speed) it "
                    "does not claim.")
    add_model(p, "glm-5.2", why="the model a slice is planned for")
    p.add_argument("--topology", choices=list(TOPOLOGIES), default="tpu7x-16",
                   help="the slice: tpu7x-N is N TensorCores (devices) of 96 GiB, 8 a host")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="cut the model to its first N layers at full width (faster "
                        "compiles; the figures then describe the cut model)")
    add_kv_cache_dtype(p)
    add_selection(p)
    add_latent_memory(p)
    add_page_size(p, 64, why="a slice deployment's page size (configs/runtime/"
                             "glm-5.2-tpu7x-16.toml, the cluster manifests)")
    p.add_argument("--pages-per-shard", type=pages_or_capacity, default=None, metavar="N",
                   help="KV pages per shard; `capacity`: the pool `cp-runtime capacity "
                        "--topology` fits beside these weights, filling HBM (a cut model's "
                        "pool then grows into the cut layers' room) (default: the pages "
                        "--max-batch sessions of --context tokens take, or capacity's pool "
                        "where that is smaller; with --matrix, capacity's)")
    add_chunk_size(p)
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="decode rows of the decode program")
    p.add_argument("--context", type=length, default=1 << 20,
                   help="tokens of the session the step programs serve: sets the page "
                        "table's width (k/m suffixes allowed)")
    add_weights(p)
    add_weight_dtype(p)
    p.add_argument("--programs", default=None, metavar="NAME[,NAME...]",
                   help=f"compile only these, from: {', '.join(PROGRAM_NAMES)}")
    p.add_argument("--kernels", action="store_true",
                   help="instead of the programs, compile each Pallas kernel alone at the "
                        "model's per-shard shapes (decode batches 1-64, prefill chunks 1-8192 "
                        "queries, cache writes, indexer) for this cache dtype and page size")
    p.add_argument("--phases", action="store_true",
                   help="also print each step program's figures per phase (cache write, "
                        "indexer, selection, attention inputs, q gather, kv gather, sparse "
                        "attention, merge, dense, sampling), summed over its instructions from "
                        "the compiled module: instructions, the compiler's estimated cycles "
                        "and their share, kernels, collectives and their bytes; then each "
                        "phase's time at the compiler's clock beside its floor (MXU, HBM, "
                        "ICI) as a fraction (--json has the figures, with XLA's HBM bytes and "
                        "MXU flops, per layer too)")
    p.add_argument("--matrix", action="store_true",
                   help="instead of one deployment's programs, compile the long-context case "
                        "matrix: decode steps at 128K and 1M context with 1, 8 and 32 rows, "
                        "and prefill chunks at offsets 0 and N - chunk of 128K- and 1M-token "
                        "prompts and 512K; each on the model cut to the fewest layers holding "
                        "every layer kind (or --layers), its figures per phase scaled to the "
                        "whole model and priced: the compiler's cycles at its own clock, "
                        "kernels at their roofline, collectives at ICI rate, beside each "
                        "phase's floor (MXU, HBM, ICI) as a fraction. Slow: one compile a "
                        "case (2-10 minutes each here)")
    p.add_argument("--attention", choices=ATTENTION_LAYOUTS, default="auto",
                   help="where the queries meet the position-sharded cache: gather_q (every "
                        "head of q to every shard, partials merged), gather_kv (the pages to "
                        "every shard, each attends its own heads), auto (whichever moves fewer "
                        "bytes: gather_kv for long-context prefill chunks)")
    p.add_argument("--residual", choices=RESIDUAL_MODES, default="auto",
                   help="the residual stream between layers: auto (split by row over the "
                        "devices where a step runs gather_kv: each device norms and projects "
                        "its own rows, the joined sums are reduce-scattered), replicated "
                        "(every row on every device)")
    p.add_argument("--row-attention", choices=ROW_ATTENTION_MODES, default="auto",
                   help="where the rows are split: heads (each device attends its own heads "
                        "of every row), rows (every head of its own rows, q and outputs "
                        "traded by all-to-all), weights (every head of its own rows, the "
                        "head-split attention weights gathered whole), auto (the one the "
                        "attention kernel's bound and what each sends price lowest)")
    p.add_argument("--tpu-schedule", choices=TPU_SCHEDULES, default="overlap",
                   help="how XLA:TPU schedules the step: overlap (its memory-pressure "
                        "tracking off, so collectives run beside compute with the pool "
                        "filling HBM), xla (XLA's default)")
    p.add_argument("--chunk-halves", choices=CHUNK_HALVES, default="auto",
                   help="a prefill chunk's rows as two halves, interleaved layer by layer so "
                        "each half's collectives run beside the other's compute: on (where "
                        "each device attends every head of its rows), off, auto (on, for "
                        "the TPU)")
    add_expert_groups(p)
    p.add_argument("--out", default=None, metavar="FILE",
                   help="with --matrix: also write the JSON to FILE")
    p.add_argument("--calibration", default=None, metavar="CHIP_JSON",
                   help="with --matrix: also print each phase's estimate times measured / "
                        "estimated on a real TPU, from `cp-runtime bench chip --trace`'s "
                        "chip.json (docs/performance.md)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the table")


def pages_or_capacity(text: str) -> int | str:
    """argparse type of --pages-per-shard: a positive page count, or `capacity`."""
    if text.strip().lower() == "capacity":
        return "capacity"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive number of pages nor "
                                         "'capacity'") from None


class Status:
    """A status line on stderr while something compiles. On a terminal it is one line,
    rewritten in place every second with the seconds so far and cleared before each result is
    printed; elsewhere (a pipe, a log file) one line per item, written as the item starts.
    `quiet` writes nothing (--json to a pipe)."""

    def __init__(self, stream=None, *, quiet: bool = False):
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.tty = not quiet and self.stream.isatty()
        self.total: int | None = None
        self.index = 0
        self._label: str | None = None
        self._started = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, label: str) -> None:
        """A new item: `label` is compiling from now on."""
        if self.quiet:
            return
        with self._lock:
            self.index += 1
            self._label, self._started = label, time.monotonic()
            if self.tty:
                self._draw()
            else:
                print(f"{self._count()}compiling {label} ...", file=self.stream, flush=True)
        if self.tty and self._thread is None:
            self._thread = threading.Thread(target=self._tick, name="compile-status",
                                             daemon=True)
            self._thread.start()

    def clear(self) -> None:
        """Erase the line (before a result goes to stdout on the same terminal)."""
        with self._lock:
            if self.tty and self._label is not None:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            self._label = None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.clear()

    def _count(self) -> str:
        return f"[{self.index}/{self.total}] " if self.total else ""

    def _draw(self) -> None:
        seconds = time.monotonic() - self._started
        self.stream.write(f"\r\x1b[K{self._count()}compiling {self._label} ... {seconds:.0f} s")
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                if self._label is not None:
                    self._draw()


def _emit(status: Status, text: str) -> None:
    """`text` on stdout as soon as it is known, the status line out of its way."""
    status.clear()
    print(text, flush=True)


def run_compile(args) -> int:
    from cp_runtime.aot import topology
    from cp_runtime.aot.calibration import load_calibration

    programs = None
    if args.calibration and not args.matrix:
        raise ValueError("--calibration scales --matrix's figures: give --matrix too")
    if args.calibration:
        load_calibration(args.calibration)           # a bad file is refused before compiling
    if args.programs:
        programs = tuple(p.strip() for p in args.programs.split(","))
        bad = [p for p in programs if p not in PROGRAM_NAMES]
        if bad:
            raise ValueError(f"--programs: {bad[0]!r} is not one of {', '.join(PROGRAM_NAMES)}")
    if not topology.has_libtpu():
        print("cp-runtime compile: error: compiling for a TPU needs libtpu; install the tpu "
              "extra: pip install -e '.[tpu]'", file=sys.stderr)
        return EXIT_NO_LIBTPU
    devices = topology.topology(args.topology).devices
    for flag in ("expert_groups", "prefill_expert_groups"):
        if devices % getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must divide "
                             f"{args.topology}'s {devices} devices")
    if args.kernels:
        return _run_kernels(args)
    if args.matrix:
        return _run_matrix(args)
    deploy = importlib.import_module("cp_runtime.aot.deploy")
    plan = deploy.CompilePlan(
        model=args.model, topology=args.topology, layers=args.layers,
        kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size,
        pages_per_shard=args.pages_per_shard or "sessions", chunk_size=args.chunk_size,
        max_batch=args.max_batch, weights=args.weights, weight_dtype=args.weight_dtype,
        context=args.context, programs=programs, attention=args.attention,
        residual=args.residual, row_attention=args.row_attention,
        tpu_schedule=args.tpu_schedule, chunk_halves=args.chunk_halves,
        expert_groups=args.expert_groups, prefill_expert_groups=args.prefill_expert_groups,
        latent_memory=args.latent_memory, latent_device_pages=args.latent_device_pages,
        selection=args.selection)
    from cp_runtime.aot import report

    status = _status(args)
    started = time.monotonic()

    def on_plan(result, names):
        status.total = len(names)
        if not args.json:
            _emit(status, _summary(result) + "\n" + report.table_header())

    def on_row(row):
        if not args.json:
            _emit(status, report.format_row(row, hbm))

    hbm = int(topology.topology(args.topology).hbm_gib * 2 ** 30)
    try:
        result = deploy.compile_plan(plan, progress=status.start, on_plan=on_plan,
                                     on_row=on_row)
    except topology.TPUCompilerMissing as e:
        print(f"cp-runtime compile: error: {e}", file=sys.stderr)
        return EXIT_NO_LIBTPU
    finally:
        status.close()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_closing(result["programs"], time.monotonic() - started))
        if args.phases:
            _print_phases(result, args.topology)
    return 0 if all(p["compiled"] for p in result["programs"]) else 1


def _status(args) -> Status:
    """The status line: always on a terminal; with --json, only there (not into a pipe)."""
    return Status(sys.stderr, quiet=args.json and not sys.stderr.isatty())


def _closing(rows: list[dict], seconds: float) -> str:
    """The line after the table: how many compiled, in how long, and what to do about a
    program that ran out of HBM."""
    ok = sum(r["compiled"] for r in rows)
    lines = [f"\n{ok} of {len(rows)} programs compiled in {seconds:.0f} s"]
    if any(r["error_code"] == "RESOURCE_EXHAUSTED" for r in rows):
        lines.append("RESOURCE_EXHAUSTED: the program needs more HBM than a device has; a "
                     "smaller pool\n(--pages-per-shard), --max-batch or --chunk-size, or a "
                     "larger slice (--topology) needs less")
    return "\n".join(lines)


def print_result(result: dict, *, phases: bool, topology_name: str) -> None:
    """`compile_plan`'s result as text, all at once: the summary, each program's memory and
    cost, and with `phases` each program's figures per step phase, priced at the compiler's
    clock. (`cp-runtime compile` prints the same lines as the programs finish.)"""
    from cp_runtime.aot import report

    print(_summary(result))
    print(report.format_table(result["programs"], result["hbm_bytes_per_device"]))
    if phases:
        _print_phases(result, topology_name)


def _print_phases(result: dict, topology_name: str) -> None:
    from cp_runtime.aot import report

    print()
    print(report.format_phases(result["programs"]))
    _print_priced_phases(result, topology_name)


def _print_priced_phases(result: dict, topology_name: str) -> None:
    """Each compiled step program's phases priced at the compiler's clock, beside their floors
    (for the model as compiled: a cut model is not scaled here; --matrix scales)."""
    from cp_runtime.aot.cases import priced
    from cp_runtime.aot.phases import PhaseFigures
    from cp_runtime.aot.report import format_case
    from cp_runtime.aot.roofline import compiler_clock_hz
    from cp_runtime.aot.topology import compile_only_devices

    clock = compiler_clock_hz(compile_only_devices(topology_name)[0])
    for program in result["programs"]:
        phases = program.get("phases") or {}
        if not program["compiled"] or not any(f["instructions"] for n, f in phases.items()
                                               if n != "other"):
            continue
        figures = {name: PhaseFigures(**f) for name, f in phases.items()}
        row = {"case": program["name"], "layers_of_model": result["layers"],
               "layers_compiled": result["layers"], "compiled": True, **priced(figures, clock)}
        print()
        print(format_case(row))
    print(f"\n(estimates at the compiler's clock, {clock / 1e9:.3f} GHz; per device)")


def _run_matrix(args) -> int:
    """`--matrix`: the case matrix of cp_runtime.aot.cases, printed per case and phase."""
    from cp_runtime.aot.calibration import load_calibration
    from cp_runtime.aot.cases import case_matrix, prefill_seconds, run_exchanges, run_matrix
    from cp_runtime.aot.report import format_case
    from cp_runtime.aot.roofline import compiler_clock_hz
    from cp_runtime.aot.topology import compile_only_devices

    cases = case_matrix(chunk=args.chunk_size)
    status = _status(args)
    status.total = len(cases)
    if not args.json:
        clock = compiler_clock_hz(compile_only_devices(args.topology)[0])
        print(f"{args.model} on {args.topology}, {args.kv_cache_dtype} cache, pages of "
              f"{args.page_size}, prefill chunks of {args.chunk_size}; the compiler's clock "
              f"{clock / 1e9:.3f} GHz; per device", flush=True)

    calibration = load_calibration(args.calibration) if args.calibration else None

    def on_case(row):
        if not args.json:
            _emit(status, "\n" + format_case(row, calibration))

    pages = None if args.pages_per_shard == "capacity" else args.pages_per_shard
    try:
        result = run_matrix(
            cases, model=args.model, layers=args.layers, chunk=args.chunk_size,
            page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
            topology=args.topology, pages_per_shard=pages, attention=args.attention,
            residual=args.residual, row_attention=args.row_attention,
            tpu_schedule=args.tpu_schedule, chunk_halves=args.chunk_halves,
            expert_groups=args.expert_groups, prefill_expert_groups=args.prefill_expert_groups,
            latent_memory=args.latent_memory, latent_device_pages=args.latent_device_pages,
            selection=args.selection, progress=status.start, on_case=on_case)
    finally:
        status.close()
    exchange_in = {}
    if args.prefill_expert_groups > 1:
        result["expert_exchanges"] = run_exchanges(
            model=args.model, topology=args.topology, groups=args.prefill_expert_groups,
            clock_hz=result["clock_hz"])
        exchange_in = result["expert_exchanges"]["experts_to_groups"]
    for length in (128 << 10, 1 << 20):
        for key in ("seconds", "overlapped_s", "with_unpriced_s"):
            chunks = prefill_seconds(result["cases"], length, args.chunk_size, key)
            before = exchange_in.get("with_unpriced_s" if key == "with_unpriced_s"
                                     else "seconds", 0.0)
            result[f"prefill_{length}_{key}"] = None if chunks is None else chunks + before
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if all(r["compiled"] for r in result["cases"]) else 1
    for length in (128 << 10, 1 << 20):
        total = result[f"prefill_{length}_seconds"]
        if total is not None:
            print(f"\nprefill of {length:,} tokens, summed over its chunks: {total:.2f} s "
                  f"({result[f'prefill_{length}_overlapped_s']:.2f} s overlapped; "
                  f"{result[f'prefill_{length}_with_unpriced_s']:.2f} s with the unpriced "
                  f"work at the HBM rate)")
    if exchange_in:
        out = result["expert_exchanges"]["experts_to_one"]
        print(f"(with the experts exchanged into {args.prefill_expert_groups} groups before "
              f"the prompt: {exchange_in['seconds']:.3f} s, {exchange_in['with_unpriced_s']:.3f}"
              f" s with the unpriced work; back to one group after it, before the next decode "
              f"step: {out['seconds']:.3f} s, {out['with_unpriced_s']:.3f} s)")
    return 0 if all(r["compiled"] for r in result["cases"]) else 1


def _run_kernels(args) -> int:
    """`--kernels`: each kernel case compiled alone (cp_runtime.aot.kernel_cases)."""
    from cp_runtime.aot.kernel_cases import kernel_cases
    from cp_runtime.aot.report import compile_figures
    from cp_runtime.aot.topology import compile_only_devices
    from cp_runtime.config import load_model_config

    device = compile_only_devices(args.topology)[0]
    model = load_model_config(args.model)
    cases = kernel_cases(model, args.kv_cache_dtype, args.page_size, device)
    status = _status(args)
    status.total = len(cases)
    if not args.json:
        print(f"{model.name}, {args.kv_cache_dtype} cache, pages of {args.page_size}, one "
              f"{device.device_kind} device")
        print(f"{'case':<16} {'ok':<3} {'compile':>8} {'VMEM est.':>10} {'temp MB':>8} "
              f"{'flops':>10} {'cost() flops':>12} {'bytes':>10} {'est. time':>10}",
              flush=True)
    rows = []
    try:
        for case in cases:
            status.start(case.name)
            r = compile_figures(case.name, case.jitted(), case.args, {}, device)
            rows.append({**r, "kernel": case.kernel, "cost_flops": case.cost["flops"],
                         "cost_flops_are_vpu_ops": bool(case.cost.get("vpu")),
                         "cost_bytes": case.cost["bytes"],
                         "vmem_bytes": case.cost["vmem_bytes"],
                         "blocks": {k: list(v) for k, v in case.cost.get("blocks", {}).items()}})
            if not args.json:
                _emit(status, _kernel_row(rows[-1]))
    finally:
        status.close()
    if args.json:
        print(json.dumps({"model": model.name, "kv_cache_dtype": args.kv_cache_dtype,
                          "page_size": args.page_size, "device_kind": device.device_kind,
                          "kernels": rows}, indent=2))
    else:
        if any(r.get("cost_flops_are_vpu_ops") for r in rows):
            print("* a VPU kernel: its flops are VPU operations, timed at the VPU rate "
                  "(cp_runtime.aot.roofline), not by the compiler")
    return 0 if all(r["compiled"] for r in rows) else 1


def _kernel_row(r: dict) -> str:
    """A kernel case's line of `--kernels`' table (a failure: its code and whole message)."""
    from cp_runtime.aot.report import format_error
    from cp_runtime.aot.roofline import TPU7X_DEVICE, kernel_seconds

    if not r["compiled"]:
        return (f"{r['name']:<16} no  {r['compile_s']:>7.1f}s  {r['error_code'] or 'error'}\n"
                + format_error(r["error"]))
    est = "-" if r["optimal_seconds"] is None else f"{r['optimal_seconds'] * 1e6:.1f} us"
    if r["cost_flops_are_vpu_ops"]:       # XLA would take them for MXU flops
        vpu_s = kernel_seconds(r["cost_flops"], r["cost_bytes"], TPU7X_DEVICE, vpu=True)
        est = f"{vpu_s * 1e6:.1f} us*"
    return (f"{r['name']:<16} yes {r['compile_s']:>7.1f}s {r['vmem_bytes'] / 2**20:>7.1f} "
            f"MiB {r['temp_bytes'] / 1e6:>8.1f} {r['flops']:>10.3g} "
            f"{r['cost_flops']:>12.3g} {r['bytes_accessed']:>10.3g} {est:>10}")


def _pool_text(r: dict) -> str:
    """Why the pool has the pages it has (cp_runtime.aot.deploy's rules)."""
    rule, cap = r.get("pool_rule"), r.get("capacity_pages_per_shard")
    if rule == "sessions":
        return (f": {r['max_batch']} sessions of {r['context']:,} tokens; "
                f"--pages-per-shard capacity for the {cap:,} that fit")
    if rule == "capacity":
        fewer = r.get("session_pages_per_shard", 0) > r["pages_per_shard"]
        return (": what capacity fits beside the weights" + (
            f", fewer than {r['max_batch']} sessions of {r['context']:,} tokens take"
            if fewer else ""))
    return ""


def _summary(r: dict) -> str:
    gib = 2 ** 30
    cut = (f", cut to its first {r['layers']} of {r['layers_of_model']} layers at full width"
           if r["layers"] != r["layers_of_model"] else "")
    cap = r["capacity_weight_bytes_per_device"]
    cap_text = "" if cap is None else f" (capacity rule: {cap / gib:.2f} GiB)"
    return "\n".join([
        f"{r['model']}{cut} on {r['topology']}: {r['devices']} {r['device_kind']} devices "
        f"(compile-only), backend {r['backend']}",
        f"per device: HBM {r['hbm_bytes_per_device'] / gib:.0f} GiB, pool "
        f"{r['pool_bytes_per_device'] / gib:.2f} GiB ({r['pages_per_shard']:,} pages of "
        f"{r['page_size']} a shard, {r['kv_cache_dtype']}{_pool_text(r)}"
        + ("" if not r["pool_host_bytes_per_device"]
           else f"; its latent cache in host memory: "
                f"{r['pool_host_bytes_per_device'] / gib:.2f} GiB") + "), weights "
        f"{r['weight_bytes_per_device'] / gib:.2f} GiB {r['weights']} {r['weight_dtype']}"
        + ("" if r["expert_groups"] == 1 else f", experts in {r['expert_groups']} groups")
        + ("" if r["prefill_expert_groups"] == 1
           else f", experts regrouped into {r['prefill_expert_groups']} for long prompts")
        + cap_text,
        f"steps: decode {r['max_batch']} rows, prefill chunks of {r['chunk_size']} tokens, "
        f"page tables for a {r['context']:,}-token session",
        "",
    ])
