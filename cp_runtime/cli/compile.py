"""`cp-runtime compile`: check that a deployment compiles for, and fits, a TPU slice, on any
machine (libtpu compiles for a compile-only topology; no TPU and no array is needed).

Loads cp_runtime.aot (and through it libtpu) only when run, so the other commands never start
libtpu.
"""

from __future__ import annotations

import importlib
import json
import sys

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
    p.add_argument("--pages-per-shard", type=positive_int, default=None,
                   help="KV pages per shard (default: the pool `cp-runtime capacity "
                        "--topology` sizes for this model with these weights)")
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
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the table")


def _progress(name: str) -> None:
    print(f"compiling {name} ...", file=sys.stderr, flush=True)


def run_compile(args) -> int:
    from cp_runtime.aot import topology

    programs = None
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
        pages_per_shard=args.pages_per_shard, chunk_size=args.chunk_size,
        max_batch=args.max_batch, weights=args.weights, weight_dtype=args.weight_dtype,
        context=args.context, programs=programs, attention=args.attention,
        residual=args.residual, row_attention=args.row_attention,
        tpu_schedule=args.tpu_schedule, chunk_halves=args.chunk_halves,
        expert_groups=args.expert_groups, prefill_expert_groups=args.prefill_expert_groups,
        latent_memory=args.latent_memory, latent_device_pages=args.latent_device_pages,
        selection=args.selection)
    try:
        result = deploy.compile_plan(plan, progress=None if args.json else _progress)
    except topology.TPUCompilerMissing as e:
        print(f"cp-runtime compile: error: {e}", file=sys.stderr)
        return EXIT_NO_LIBTPU
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_result(result, phases=args.phases, topology_name=args.topology)
    return 0 if all(p["compiled"] for p in result["programs"]) else 1


def print_result(result: dict, *, phases: bool, topology_name: str) -> None:
    """`compile_plan`'s result as text: the summary, each program's memory and cost, and with
    `phases` each program's figures per step phase, priced at the compiler's clock."""
    from cp_runtime.aot import report

    print(_summary(result))
    print(report.format_table(result["programs"], result["hbm_bytes_per_device"]))
    if phases:
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
    from cp_runtime.aot.cases import case_matrix, prefill_seconds, run_exchanges, run_matrix
    from cp_runtime.aot.report import format_case

    cases = case_matrix(chunk=args.chunk_size)
    result = run_matrix(cases, model=args.model, layers=args.layers, chunk=args.chunk_size,
                        page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
                        topology=args.topology, pages_per_shard=args.pages_per_shard,
                        attention=args.attention, residual=args.residual,
                        row_attention=args.row_attention, tpu_schedule=args.tpu_schedule,
                        chunk_halves=args.chunk_halves, expert_groups=args.expert_groups,
                        prefill_expert_groups=args.prefill_expert_groups,
                        latent_memory=args.latent_memory,
                        latent_device_pages=args.latent_device_pages,
                        selection=args.selection,
                        progress=None if args.json else _progress)
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
    print(f"{result['model']} on {result['topology']}, {result['kv_cache_dtype']} cache, pages "
          f"of {result['page_size']}, prefill chunks of {result['chunk_size']}; the compiler's "
          f"clock {result['clock_hz'] / 1e9:.3f} GHz; per device")
    for row in result["cases"]:
        print()
        print(format_case(row))
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
    from cp_runtime.aot.roofline import TPU7X_DEVICE, kernel_seconds
    from cp_runtime.aot.topology import compile_only_devices
    from cp_runtime.config import load_model_config

    device = compile_only_devices(args.topology)[0]
    model = load_model_config(args.model)
    rows = []
    for case in kernel_cases(model, args.kv_cache_dtype, args.page_size, device):
        if not args.json:
            _progress(case.name)
        r = compile_figures(case.name, case.jitted(), case.args, {}, device)
        rows.append({**r, "kernel": case.kernel, "cost_flops": case.cost["flops"],
                     "cost_flops_are_vpu_ops": bool(case.cost.get("vpu")),
                     "cost_bytes": case.cost["bytes"], "vmem_bytes": case.cost["vmem_bytes"],
                     "blocks": {k: list(v) for k, v in case.cost.get("blocks", {}).items()}})
    if args.json:
        print(json.dumps({"model": model.name, "kv_cache_dtype": args.kv_cache_dtype,
                          "page_size": args.page_size, "device_kind": device.device_kind,
                          "kernels": rows}, indent=2))
    else:
        print(f"{model.name}, {args.kv_cache_dtype} cache, pages of {args.page_size}, one "
              f"{device.device_kind} device")
        print(f"{'case':<16} {'ok':<3} {'compile':>8} {'VMEM est.':>10} {'temp MB':>8} "
              f"{'flops':>10} {'cost() flops':>12} {'bytes':>10} {'est. time':>10}")
        for r in rows:
            if not r["compiled"]:
                print(f"{r['name']:<16} no  {r['error_code']}: {r['error'].splitlines()[0]}")
                continue
            est = "-" if r["optimal_seconds"] is None else f"{r['optimal_seconds'] * 1e6:.1f} us"
            if r["cost_flops_are_vpu_ops"]:       # XLA would take them for MXU flops
                vpu_s = kernel_seconds(r["cost_flops"], r["cost_bytes"], TPU7X_DEVICE, vpu=True)
                est = f"{vpu_s * 1e6:.1f} us*"
            print(f"{r['name']:<16} yes {r['compile_s']:>7.1f}s {r['vmem_bytes'] / 2**20:>7.1f} "
                  f"MiB {r['temp_bytes'] / 1e6:>8.1f} {r['flops']:>10.3g} "
                  f"{r['cost_flops']:>12.3g} {r['bytes_accessed']:>10.3g} {est:>10}")
        if any(r.get("cost_flops_are_vpu_ops") for r in rows):
            print("* a VPU kernel: its flops are VPU operations, timed at the VPU rate "
                  "(cp_runtime.aot.roofline), not by the compiler")
    return 0 if all(r["compiled"] for r in rows) else 1


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
        f"{r['page_size']}, {r['kv_cache_dtype']}"
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
