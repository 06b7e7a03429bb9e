"""A model of GLM-5.2 on a tpu7x-16 slice: 1M-token prefill time and decode ms/step at 128K and
1M context, batch 1 and 32, with three ways to split a prefill chunk over the devices. Pure
arithmetic over shapes (no JAX device work, nothing measured).

    cp-runtime bench tpu_model                    # prints the tables (docs/hand-model.md)
    cp-runtime bench tpu_model --out out/         # and writes out/tpu_model.json
    cp-runtime bench tpu_model --json             # one JSON object on stdout, no tables
    cp-runtime bench tpu_model --prefill-design sequence --wire-dtype bf16

The model is in three modules (tpu_model imports tpu_designs, which imports tpu_terms):

    tpu_terms    the rates of a device (Hardware, tpu7x_16), a term and its time (Term), the
                 runtime choices (Setup, DESIGNS, WIRE_BYTES) and the kernels' terms from their
                 cost() functions, with the assumptions they rest on
    tpu_designs  the layer kinds and their weights, each prefill design's collectives, a step's
                 terms by layer kind, a chunked prefill's schedule (serial and overlapped), the
                 designs sweep, the compute floor and the HBM use per device
    tpu_model    this one: the report's cases (`scenarios`, `evaluate`), the four target cases
                 against their targets (`cases`, `compiler_seconds`, `compiler_designs`) beside
                 other systems' published figures (ANCHORS), the tables and the command line

The other two's public names are re-imported here (this module's __all__ lists them), so
`tpu_model.<name>` works as before. The rules the tables' times follow (term time, serial,
overlapped) are in tpu_designs' docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from cp_runtime.aot.roofline import TPU7X_CHIP  # noqa: F401 - read as tpu_model.TPU7X_CHIP
from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import print_table
from cp_runtime.benchmarks.hand_model.tpu_designs import (LayerGroup, _summed, chunk_groups,
                                                          chunk_terms, compute_floor, decode_groups,
                                                          decode_terms, design_sweep, hbm_use,
                                                          layer_kinds, layer_seconds, layer_weights,
                                                          prefill_schedule, prefill_terms)
from cp_runtime.benchmarks.hand_model.tpu_terms import (DESIGNS, GB, INDEXER_SCORES, TFLOP,
                                                        WIRE_BYTES, Hardware, Setup, Term, tpu7x_16)
from cp_runtime.cli.args import (finite_nonnegative_float, finite_positive_float, length_list,
                                 positive_int, positive_int_list)
from cp_runtime.config import ROW_ATTENTION_MODES, ModelConfig, load_model_config
from cp_runtime.dtypes import dtype_bytes, latent_cache_dtype
from cp_runtime.weights.shards import MLP_ROWS

__all__ = ["Hardware", "Term", "Setup", "LayerGroup", "DESIGNS", "WIRE_BYTES", "ANCHORS",
           "CASES", "tpu7x_16", "layer_kinds", "layer_weights", "layer_seconds", "decode_groups",
           "chunk_groups", "decode_terms", "prefill_terms", "prefill_schedule", "chunk_terms",
           "design_sweep", "compute_floor", "hbm_use", "scenarios", "evaluate", "cases",
           "build_parser", "main"]

QUICK = {"compiler_layers": ("4", "1")}

# The cases the targets are set for (`cases`, --json), as (kind, length, batch), and their
# targets in seconds: the 1M prefill's is 2x its compute floor (computed), decode at batch 32's
# is fitting (None).
_CASE_SHAPES = {"prefill 128K": ("prefill", 128 << 10, 1), "prefill 1M": ("prefill", 1 << 20, 1),
                "decode 1M B=1": ("decode", 1 << 20, 1), "decode 1M B=32": ("decode", 1 << 20, 32)}
CASES = tuple(_CASE_SHAPES)
TARGET_SECONDS = {"prefill 128K": 2.0, "decode 1M B=1": 0.008, "decode 1M B=32": None}

# Other systems' published figures, quoted as given (not derived, not comparable one to one:
# other models, other hardware), shown beside the case they speak to.
ANCHORS = (
    {"case": "prefill 1M", "source": "vLLM DCP recipe",
     "setting": "DeepSeek-V4-Flash, 8 B200, data parallel", "figure": "1M-token TTFT 84.7 s",
     "seconds": 84.7},
    {"case": "prefill 1M", "source": "vLLM DCP recipe",
     "setting": "DeepSeek-V4-Flash, 8 B200, tensor parallel",
     "figure": "1M-token TTFT 314.6 s", "seconds": 314.6},
    {"case": "prefill 1M", "source": "Meta, context-parallel prefill",
     "setting": "Llama 3 405B, 128 H100", "figure": "77 s for 1M tokens", "seconds": 77.0},
    {"case": "decode 1M B=1", "source": "sgl-jax",
     "setting": "GLM-5.2, v7x TP-16 slice, 1K context", "figure": "16.1 ms per token",
     "seconds": 0.0161},
    {"case": "decode 1M B=1", "source": "sgl-jax",
     "setting": "GLM-5.2, v7x TP-16 slice, 110K context", "figure": "17.3 ms per token",
     "seconds": 0.0173},
)


def scenarios(prefill_lengths: list[int], contexts: list[int], batches: list[int]) -> list[dict]:
    """The (kind, length, batch, union) cases of the report, prefill first."""
    out = [{"kind": "prefill", "length": n, "batch": 1, "union": -1.0} for n in prefill_lengths]
    out.append({"kind": "prefill", "length": max(prefill_lengths), "batch": 1, "union": None})
    out += [{"kind": "decode", "length": c, "batch": b, "union": None}
            for c in contexts for b in batches]
    return out


def _size(n: int) -> str:
    """8192 -> 8K, 1048576 -> 1M (tokens)."""
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % (1 << 10) == 0 else str(n)


def _label(case: dict) -> str:
    size = _size(case["length"])
    if case["kind"] == "prefill":
        return f"prefill {size}" + (" (union upper bound)" if case["union"] is None else "")
    return f"decode {size} B={case['batch']}"


def evaluate(model: ModelConfig, hw: Hardware, setup: Setup, case: dict) -> dict:
    """Terms, serial time and HBM use of one case; a prefill's also by layer kind, with its
    overlapped time (prefill_schedule). A term's time is the sum of its times in every layer
    of every step (_summed); its bound, the resource its totals take longest on."""
    if case["kind"] == "prefill":
        p = prefill_schedule(model, hw, setup, length=case["length"], union=case["union"])
        tokens = case["length"]
        extra = {"design": setup.prefill_design, "chunk_size": setup.chunk_size,
                 "overlapped_seconds": p["overlapped_s"], "by_kind": p["by_kind"]}
    else:
        p = _summed([decode_groups(model, hw, setup, context=case["length"],
                                   batch=case["batch"])], hw)
        tokens = (case["length"] + 1) * case["batch"]
        extra = {"design": "gather_q", "chunk_size": None, "overlapped_seconds": None,
                 "by_kind": None}
    terms, times, seconds = p["terms"], p["seconds"], p["serial_s"]
    use = hbm_use(model, hw, setup, tokens=tokens)
    worst = max(terms, key=lambda t: times[t.name])
    rate = (case["length"] if case["kind"] == "prefill" else case["batch"]) / seconds
    return {
        "case": _label(case), **case, "seconds": seconds, **extra, "tokens_per_s": rate,
        "largest_term": worst.name, "hbm_gb_per_device": use / GB,
        "fits": use <= hw.hbm_bytes,
        "terms": [{"term": t.name, "hbm_gb": t.hbm_bytes / GB, "tflop": t.flops / TFLOP,
                   "ici_gb": t.ici_bytes / GB, "collectives": t.collectives,
                   "ms": times[t.name] * 1e3, "bound": t.bound(hw)} for t in terms],
    }


def cases(model: ModelConfig, hw: Hardware, setup: Setup, *, design_chunks: list[int],
          source_figures: dict[str, float] | None = None,
          source_designs: dict[str, dict] | None = None) -> list[dict]:
    """The four CASES against their targets, whatever the report's other lists say:

        case            "prefill 128K", "prefill 1M", "decode 1M B=1", "decode 1M B=32"
        seconds         prefill: the lowest overlapped time of DESIGNS x design_chunks;
                        decode: the serial step time (the gather_q design)
        source          "model", or "compiler" where source_figures gives the case (the
                        step's; `host_copy_s` is always the model's)
        fits            HBM use per device <= the device's HBM (hbm_use)
        latent_memory   where the latent cache is held: setup's, or "host" for a decode case
                        whose cache does not fit the devices' memory (RuntimeConfig.
                        latent_memory), which then fits if the weights and the indexer's
                        cache do
        host_copy_s     the step's copies of its host-held pages (`host_copy_seconds`), in
                        `seconds` too; 0 where the cache is on the devices
        design          prefill: {"prefill_design", "chunk_size"} of that time (the compiled
                        programs' where source_designs gives them); decode: None
        target_seconds  prefill 1M: 2 x its compute floor; TARGET_SECONDS for the others
                        (decode 1M B=32: None, its target is fitting)
        meets_target    fits and seconds <= target_seconds (where None: fits)

    source_figures: {case: seconds} measured from compiled programs; a case given there takes
    those seconds instead of the model's (its fit stays the model's, its design too unless
    source_designs, `compiler_designs`, names the one the programs ran).
    """
    if not design_chunks:
        raise ValueError("design_chunks: no chunk size to try")
    figures = source_figures or {}
    targets = TARGET_SECONDS | {
        "prefill 1M": 2 * compute_floor(model, hw, setup, length=1 << 20)["total"]["seconds"]}
    out = []
    for name, (kind, length, batch) in _CASE_SHAPES.items():
        if kind == "prefill":
            best = min(design_sweep(model, hw, setup, length=length, chunks=design_chunks),
                       key=lambda r: r["overlapped_s"])
            seconds = best["overlapped_s"]
            design = {"prefill_design": best["design"], "chunk_size": best["chunk_size"]}
            use = hbm_use(model, hw, dataclasses.replace(setup, prefill_design=best["design"]),
                          tokens=length)
        else:
            seconds = _summed([decode_groups(model, hw, setup, context=length,
                                             batch=batch)], hw)["serial_s"]
            design, use = None, hbm_use(model, hw, setup, tokens=(length + 1) * batch)
        seconds, source = (figures[name], "compiler") if name in figures else (seconds, "model")
        if source == "compiler" and name in (source_designs or {}):
            design = source_designs[name]
        memory, host_s = setup.latent_memory, 0.0
        if kind == "decode" and use > hw.hbm_bytes and memory == "device":
            memory, host_s = "host", host_copy_seconds(model, hw, setup, batch=batch)
            use = hbm_use(model, hw, dataclasses.replace(setup, latent_memory="host"),
                          tokens=(length + 1) * batch)
        fits, target = use <= hw.hbm_bytes, targets[name]
        out.append({"case": name, "seconds": seconds + host_s, "source": source, "fits": fits,
                    "latent_memory": memory, "host_copy_s": host_s,
                    "design": design, "target_seconds": target,
                    "meets_target": fits and (target is None or seconds + host_s <= target)})
    return out


def host_copy_seconds(model: ModelConfig, hw: Hardware, setup: Setup, *, batch: int) -> float:
    """A decode step's copies of a host-held latent cache (cp_runtime.cache.host_pages) at the
    host link's rate: per layer each device stages its share of the rows' K + 1 selected pages
    (1/S of them: the selection spreads over the shards) and reads and writes back the page
    each of its rows writes (1/S of the rows). A hand model: the compiled step cannot say
    how many pages its loops copy."""
    page = setup.page_size * model.latent_dim * dtype_bytes(latent_cache_dtype(
        setup.kv_cache_dtype))
    selected = batch * (model.index_topk // setup.page_size + 1) / hw.devices
    written = 2 * batch / hw.devices
    return model.num_hidden_layers * (selected + written) * page / hw.host_bytes_per_s


def compiler_designs(matrix: dict) -> dict[str, dict]:
    """{prefill case: {"prefill_design", "chunk_size"}} of the chunks a compile matrix JSON
    holds: the attention layout they compiled (every chunk's, joined by "+" where they
    differ) and the matrix's chunk size."""
    layouts = sorted({row["attention"] for row in matrix.get("cases", [])
                      if row.get("program") != "decode" and row.get("attention")})
    if not layouts or "chunk_size" not in matrix:
        return {}
    design = {"prefill_design": "+".join(layouts), "chunk_size": matrix["chunk_size"]}
    return {name: design for name, (kind, _, _) in _CASE_SHAPES.items() if kind == "prefill"}


def compiler_seconds(matrix: dict) -> dict[str, float]:
    """{case: seconds} of the four CASES that a `cp-runtime compile --matrix --out FILE` JSON
    holds (its decode cases by name, its prefills summed over their chunks)."""
    out = {}
    for row in matrix.get("cases", []):
        if row.get("seconds") is not None and row["case"] in _CASE_SHAPES:
            out[row["case"]] = row["seconds"]
    for name, (kind, length, _) in _CASE_SHAPES.items():
        total = matrix.get(f"prefill_{length}_seconds")
        if kind == "prefill" and total is not None:
            out[name] = total
    return out


# -- command line ---------------------------------------------------------------------------
def build_parser() -> BenchmarkParser:
    p = BenchmarkParser(
        "tpu_model", __doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
        quick="the hand model is arithmetic and instant either way; with --compiler, a "
              "one-layer cut",
        quick_values=QUICK)
    p.add_argument("--prefill-lengths", type=length_list, default=[8192, 1 << 20],
                   help="prefill lengths (k/m suffixes); the designs table and the compute "
                        "floor are for the longest")
    p.add_argument("--contexts", type=length_list, default=[128 << 10, 1 << 20],
                   help="decode context lengths (k/m suffixes)")
    p.add_argument("--batches", type=positive_int_list, default=[1, 32],
                   help="decode batch sizes")
    p.add_argument("--weight-dtype", choices=("fp8", "bf16"), default="fp8",
                   help="weight storage; fp8 also runs the projections at the fp8 MXU rate")
    p.add_argument("--wire-dtype", choices=tuple(WIRE_BYTES), default="f32",
                   help="activations on the interconnect (q heads, indexer q, merge partials, "
                        "all-reduces, the designs' all-to-alls); f32 is what the runtime sends "
                        "on the CPU, bf16 near what it sends on a TPU")
    p.add_argument("--mlp-rows", choices=MLP_ROWS, default="wire",
                   help="how gather_kv's split rows reach the MLP: on the wire, or as fp8 "
                        "values with a scale a row (the runtime's choice on a TPU)")
    p.add_argument("--indexer-scores", choices=INDEXER_SCORES, default="cache",
                   help="how a prefill chunk's indexer scores its keys: from the bf16 cache, "
                        "or with q and keys rounded to fp8 at the fp8 rate (the runtime's "
                        "choice on a TPU)")
    p.add_argument("--prefill-design", choices=DESIGNS, default="gather_q",
                   help="how a prefill chunk is split over the devices for the summary and "
                        "term tables: gather_q (every head of q to the pages), gather_kv (the "
                        "pages to the queries; the runtime's auto choice for long-context "
                        "chunks), sequence (tokens split, weights gathered; not in the runtime "
                        "yet)")
    p.add_argument("--design-chunks", type=length_list, default=[8192, 32768],
                   help="chunk sizes the prefill-designs table and the targets' prefill cases "
                        "try, each with every design (k/m suffixes)")
    p.add_argument("--row-attention", choices=ROW_ATTENTION_MODES, default="auto",
                   help="how gather_kv's chunks attend where their rows split: heads, rows "
                        "(q and outputs traded by all-to-all), weights (the head-split "
                        "weights gathered whole), auto (as the runtime picks)")
    p.add_argument("--prefill-union", type=finite_positive_float, default=2.0,
                   help="pages a prefill query block reads, in units of one query's selection")
    p.add_argument("--ici-fraction", type=finite_positive_float, default=1.0,
                   help="fraction of the per-device one-way ICI rate a collective achieves")
    p.add_argument("--collective-us", type=finite_nonnegative_float, default=10.0,
                   help="latency of one collective in microseconds (an assumption)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of the tables: what --out's file holds, "
                        "with the four target cases (`cases`) and the published anchors")
    p.add_argument("--compiler", action="store_true",
                   help="also compile the runtime's decode step and a prefill chunk for "
                        "tpu7x-16 (needs the tpu extra) and print the hand model beside the "
                        "compiler's flops, bytes and time estimate, term by term")
    p.add_argument("--compiler-figures", metavar="FILE", default=None,
                   help="the JSON of `cp-runtime compile --matrix --out FILE` (same model): "
                        "the targets table takes each case's seconds from the compiled "
                        "programs where the file has them (source 'compiler')")
    p.add_argument("--compiler-layers", type=positive_int,
                   help="with --compiler: cut the model to its first N layers, for compile time")
    # --no-progress: the --compiler progress lines on stderr
    p.add_shared(model="glm-5.2", kv_cache_dtype="fp8_e4m3", page_size=16, chunk_size=8192,
                 out=None, progress=True,
                 why={"chunk_size": "docs/hand-model.md's tables model 8K-token prefill steps",
                      "out": "unset, the tables are printed and no JSON is written"})
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with `--out` created (`args.out`: a Path, None
    without one)."""
    return build_parser().parse_args(argv)


def _time(seconds: float | None) -> str:
    """4 significant digits in s, ms or us, whichever keeps the number between 1 and 1000."""
    if seconds is None:
        return ""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return "0" if seconds == 0 else f"{seconds * 1e6:.2g} us"


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def _print_designs(sweep: list[dict], floor: dict, length: int, setup: Setup) -> None:
    """The prefill-designs tables (totals, then by layer kind) and the compute floor."""
    wire = next(k for k, v in WIRE_BYTES.items() if v == setup.wire_bytes)
    print_table([{**r, "chunk": _size(r["chunk_size"]), "ICI GB/dev": r["ici_gb"],
                  "compute": _time(r["compute_s"]), "collectives": _time(r["collective_s"]),
                  "serial": _time(r["serial_s"]), "overlapped": _time(r["overlapped_s"]),
                  "coll <= compute": "yes" if not r["exposed"] else
                  "no: " + ", ".join(r["exposed"])} for r in sweep],
                ["design", "chunk", "ICI GB/dev", "compute", "collectives", "serial",
                 "overlapped", "coll <= compute"],
                title=f"prefill designs: {_size(length)} tokens, wire {wire} (serial = sum of "
                      f"the terms; overlapped = sum over layers of max(compute, collectives))")
    print()
    print_table([{"design": r["design"], "chunk": _size(r["chunk_size"]), "kind": kind,
                  "layers": k["layers"], "compute": _time(k["compute_s"]),
                  "collectives": _time(k["collective_s"]),
                  "overlapped": _time(k["overlapped_s"])}
                 for r in sweep for kind, k in r["by_kind"].items()],
                ["design", "chunk", "kind", "layers", "compute", "collectives", "overlapped"],
                title=f"prefill designs by layer kind: {_size(length)} tokens (step: the "
                      f"embedding and lm head, once per chunk, never overlapped)")
    print()
    print_table([{"part": part, "TFLOP/dev": v["tflop"], "rate": v["precision"] or "",
                  "time": _time(v["seconds"])} for part, v in floor.items()],
                ["part", "TFLOP/dev", "rate", "time"],
                title=f"compute floor: the {_size(length)}-token prefill's flops alone at the "
                      f"peak MXU rate of their dtype (no HBM, no ICI, no kernel padding)")


def _print_targets(report_cases: list[dict]) -> None:
    """The four cases against their targets, each with the numbers of the ANCHORS that speak
    to it, and the anchors listed below."""
    numbers: dict[str, list[str]] = {}
    for i, a in enumerate(ANCHORS, 1):
        numbers.setdefault(a["case"], []).append(f"[{i}]")
    rows = []
    for c in report_cases:
        d = c["design"]
        design = f"{d['prefill_design']} {_size(d['chunk_size'])}" if d else "gather_q"
        rows.append({**c, "time": _time(c["seconds"]), "design": design,
                     "fits": _yes(c["fits"]) + (" (latent on host)"
                                                if c["latent_memory"] == "host" else ""),
                     "meets": _yes(c["meets_target"]),
                     "target": ("fits" if c["target_seconds"] is None
                                else _time(c["target_seconds"])),
                     "anchors": " ".join(numbers.get(c["case"], ["-"]))})
    print_table(rows, ["case", "time", "source", "design", "fits", "target", "meets",
                       "anchors"],
                title="targets (prefill: the lowest overlapped time of the designs and "
                      "--design-chunks; decode: serial)")
    print("published anchors (quoted as given; other systems, other hardware):")
    for i, a in enumerate(ANCHORS, 1):
        print(f"  [{i}] {a['source']}, {a['setting']}: {a['figure']}")


def _print(results: list[dict], hw: Hardware, setup: Setup, model: ModelConfig) -> None:
    wire = next(k for k, v in WIRE_BYTES.items() if v == setup.wire_bytes)
    print(f"{model.name} on {hw.name}: {hw.devices} devices, per device "
          f"{hw.hbm_bytes_per_s / 1e12:.3g} TB/s HBM, {hw.bf16_flops / TFLOP:.4g} / "
          f"{hw.fp8_flops / TFLOP:.4g} TFLOP/s bf16 / fp8, {hw.hbm_bytes / 2**30:.4g} GiB, "
          f"ICI {hw.ici_bytes_per_s / GB:.4g} GB/s one way, {hw.collective_latency_s * 1e6:.3g} "
          f"us per collective")
    print(f"cache {setup.kv_cache_dtype}, page {setup.page_size}, chunk {setup.chunk_size}, "
          f"weights {setup.weight_precision}, wire {wire}, prefill design "
          f"{setup.prefill_design}, prefill union {setup.prefill_union:g} N")
    print()
    print_table([{**r, "time": _time(r["seconds"]), "overlapped": _time(r["overlapped_seconds"]),
                  "tok/s": r["tokens_per_s"], "HBM GB/dev": r["hbm_gb_per_device"],
                  "fits": _yes(r["fits"])} for r in results],
                ["case", "time", "overlapped", "tok/s", "largest_term", "HBM GB/dev", "fits"],
                title="summary (time: serial, the sum of the terms)")
    for r in results:
        print()
        print_table([{**t, "time": _time(t["ms"] / 1e3)} for t in r["terms"]]
                    + [{"term": "total", "time": _time(r["seconds"])}],
                    ["term", "hbm_gb", "tflop", "ici_gb", "collectives", "time", "bound"],
                    title=r["case"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = load_model_config(args.model)
    hw = tpu7x_16(ici_fraction=args.ici_fraction, collective_us=args.collective_us)
    setup = Setup(kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size,
                  chunk_size=args.chunk_size, weight_bytes=1 if args.weight_dtype == "fp8" else 2,
                  prefill_union=args.prefill_union, wire_bytes=WIRE_BYTES[args.wire_dtype],
                  prefill_design=args.prefill_design, row_attention=args.row_attention,
                  mlp_rows=args.mlp_rows, indexer_scores=args.indexer_scores)
    results = [evaluate(model, hw, setup, c)
               for c in scenarios(args.prefill_lengths, args.contexts, args.batches)]
    longest = max(args.prefill_lengths)
    sweep = design_sweep(model, hw, setup, length=longest, chunks=args.design_chunks)
    floor = compute_floor(model, hw, setup, length=longest)
    figures = designs = None
    if args.compiler_figures:
        matrix = json.loads(pathlib.Path(args.compiler_figures).read_text())
        if matrix.get("model") != model.name:
            raise SystemExit(f"cp-runtime bench tpu_model: --compiler-figures holds "
                             f"{matrix.get('model')!r}, not {model.name!r}")
        figures, designs = compiler_seconds(matrix), compiler_designs(matrix)
    report_cases = cases(model, hw, setup, design_chunks=args.design_chunks,
                         source_figures=figures, source_designs=designs)
    if not args.json:
        _print(results, hw, setup, model)
        print()
        _print_designs(sweep, floor, longest, setup)
        print()
        _print_targets(report_cases)
    compared = (_compare_with_compiler(args, model, hw, setup, show=not args.json)
                if args.compiler else None)
    report = {"model": model.name, "hardware": dataclasses.asdict(hw),
              "setup": dataclasses.asdict(setup), "results": results,
              "designs": {"length": longest, "rows": sweep, "compute_floor": floor},
              "cases": report_cases, "anchors": list(ANCHORS), "compiler": compared}
    if args.json:
        print(json.dumps(report, indent=2))
    if args.out is not None:
        path = args.out / "tpu_model.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _compare_with_compiler(args, model: ModelConfig, hw: Hardware, setup: Setup, *,
                           show: bool = True) -> dict:
    """The hand model beside the TPU compiler's figures (tpu_compiler.py); the
    table printed unless show=False (--json)."""
    from cp_runtime.aot.topology import has_libtpu
    from cp_runtime.benchmarks.hand_model import tpu_compiler

    if not has_libtpu():
        raise SystemExit("cp-runtime bench tpu_model: --compiler needs libtpu; install the "
                         "tpu extra: pip install -e '.[tpu]'")
    # the compiled programs are the runtime's: the gather_q design, whatever --prefill-design says
    heads = dataclasses.replace(setup, prefill_design="gather_q")
    out = tpu_compiler.compare(model, hw, heads, layers=args.compiler_layers,
                               context=args.contexts[0], batch=args.batches[0],
                               decode_terms=decode_terms, chunk_terms=chunk_terms,
                               progress=lambda m: args.no_progress or print(
                                   m, file=sys.stderr, flush=True))
    if not show:
        return out
    print()
    print_table(out["rows"], ["program", "term", "hand GFLOP", "compiler GFLOP", "flops x",
                              "hand GB", "compiler GB", "bytes x", "hand ms", "compiler ms",
                              "differs"],
                title=f"hand model vs the TPU compiler: {out['model']} cut to {out['layers']} "
                      f"layers on {out['topology']}, {out['weights']} weights "
                      f"(x = compiler / hand; named where off by more than "
                      f"{tpu_compiler.TOLERANCE:.0%})")
    for term, why in out["differing_terms"].items():
        print(f"  differs: {term}: {why}")
    return out


if __name__ == "__main__":
    sys.exit(main())
