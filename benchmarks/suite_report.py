"""The whole benchmark suite in one run, written up as DIR/report.md with its PNGs.

    cp-runtime bench all --quick                  # every benchmark small: a few minutes on a CPU
    cp-runtime bench all --quick --out out/report
    cp-runtime bench all --only capacity,kernel_error --out out/report

Sections, in order: niah, capacity, kernel_error, selection, throughput (with the roofline),
merge, kernels, serving. Each benchmark's `main(argv)` runs in this process with its `--out`
inside DIR; its console output is echoed and kept, and the report renders its JSON as markdown
tables next to its PNGs. `--quick` runs each as `cp-runtime bench NAME --quick`, its own quick
mode; without it each runs with its own defaults (hours for the needle sweep). `--no-progress`
is passed on to every section.

DIR/report.md is rewritten after every section, so an interrupted run keeps what it finished
(the sections still to run are listed as pending). JAX is given `--shards` virtual CPU devices
once, here, before anything uses it; the benchmarks that ask for devices themselves ask for that
same count, which JAX accepts after start-up (a different count would raise). A benchmark that
fails is reported in its section with its traceback, its last error line is printed on the
console, the others still run, and the exit status is 1.

Measured on the development machine (2 shared x86 cores, 16 virtual devices, nothing else
running): `bench all --quick --no-progress` took 5.8 min at a peak RSS of 3.3 GiB (GNU time's
maximum resident set size, the serving section's server process included): niah 115 s,
throughput 100 s, serving 58 s, kernels 24 s, merge 20 s (its prefill chunk sized to fit:
benchmarks/merge_variants.py), selection 19 s, the rest 7 s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import pathlib
import sys
import time
import traceback
from collections.abc import Callable

from cp_runtime.benchmarks import registry
from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.markdown import markdown_table
from cp_runtime.benchmarks._shared.results import machine
from cp_runtime.cli.args import comma_list

__all__ = ["Section", "SECTIONS", "last_error_line", "write_report",
           "build_parser", "parse_args", "main"]

PROG = "cp-runtime bench all"              # the command that runs this module


def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def _image(out: pathlib.Path, path: pathlib.Path, caption: str) -> str:
    return f"![{caption}]({path.relative_to(out).as_posix()})" if path.exists() else ""


# -- sections -------------------------------------------------------------------------------
# Each renderer turns a benchmark's outputs under DIR into markdown blocks.
def _niah(out: pathlib.Path) -> list[str]:
    d = _load(out / "niah" / "niah.json")
    rows = d["summary"]
    head, tail = ["variant", "dtype", "shards"], ["recall", "no_needle", "uplift_nats"]
    lengths = [k for k in rows[0] if k not in head + tail]
    return [f"Model `{d['model']}`, depths {d['depths']}, page size {d['page_size']}, index_topk "
            f"{d['index_topk']}; recall as correct/trials per length, uplift in nats.",
            markdown_table(rows, head + lengths + tail),
            "Prefill time per engine (compiles included):",
            markdown_table(d["timings"]),
            _image(out, out / "niah" / "niah_heatmap.png", "niah heatmap")]


def _capacity(out: pathlib.Path) -> list[str]:
    d = _load(out / "capacity" / "capacity.json")
    where = ((f"{d['topology']}, " if d["topology"] else "")
             + f"{d['devices']} devices x {d['hbm_gib']:g} GiB")
    if d["weights_gib"] is not None:
        taken = f"{d['weights_gib']:g} GiB each for weights"
    else:
        taken = (f"each model's weights per device (`--weight-dtype {d['weight_dtype']}`, "
                 f"`--weights {d['weights']}`) and a reserve, as `cp-runtime capacity` counts "
                 "them")
    return [f"Slice: {where}; {taken}. Weights, reserve and KV in GiB per device.",
            markdown_table(d["rows"], ["model", "dtype", "latent", "indexer", "bytes_per_token",
                                       "tokens_per_gib", "ratio_vs_bf16", "weights_gib",
                                       "reserve_gib", "kv_gib", "slice_tokens_M"]),
            _image(out, out / "capacity" / "capacity.png", "capacity")]


def _kernel_error(out: pathlib.Path) -> list[str]:
    d = _load(out / "kernel_error.json")
    return [f"fp8 vs bf16 latent cache, `{d['model']}` shapes, backend `{d['backend']}`.",
            markdown_table(d["rows"])]


def _selection(out: pathlib.Path) -> list[str]:
    d = _load(out / "selection" / "selection.json")
    return ["Top-K changes against a bf16 indexer cache:",
            markdown_table(d["selection"], ["model", "index_topk", "scheme", "changed",
                                            "changed_pct", "swapped_pct"]),
            f"Recall model ({d['recall_trials']} contexts of {d['recall_length']} tokens, "
            f"{d['siblings']} siblings):",
            markdown_table(d["recall"])]


def _throughput(out: pathlib.Path) -> list[str]:
    d = _load(out / "throughput.json")
    rows = d["rows"]
    parts = ["Roofline measured in the same run (aggregate over the devices):",
             markdown_table(list(d["roofline"].values()),
                            ["devices", "read_gb_per_s", "copy_gb_per_s", "matmul_n",
                             "matmul_gflop_per_s"]),
             f"Model `{d['args']['model']}`, backend `{d['backend']}`: one session grows "
             "through the lengths; prefill of each segment (compile excluded) and decode at its "
             "end; dense = index_topk covering every page:",
             markdown_table(rows, ["length", "shards", "dtype", "prefill_tok_per_s",
                                   "prefill_compile_s", "prefill_total_tok_per_s", "decode_ms",
                                   "dense_decode_ms", "dense_vs_sparse"]),
             "Achieved fraction of the measured roofline (%):",
             markdown_table(rows, ["length", "shards", "dtype", "prefill_gflop_per_s",
                                   "prefill_flop_%", "prefill_bw_%", "decode_gb_per_s",
                                   "decode_bw_%", "decode_flop_%"])]
    if d.get("pool_rows"):
        parts += ["Decode at a fixed context vs pool size:",
                  markdown_table(d["pool_rows"], ["length", "shards", "dtype", "pool_factor",
                                                  "pool_pages_per_shard", "decode_ms",
                                                  "decode_vs_smallest_pool"])]
    return parts + [_image(out, out / "throughput_decode.png", "decode ms vs length"),
                    _image(out, out / "throughput_prefill.png", "prefill tokens/s vs length")]


def _merge(out: pathlib.Path) -> list[str]:
    d = _load(out / "merge.json")
    shapes = ", ".join(f"{label} ({n} tokens)" for label, n in d["tokens"].items())
    return [f"Model `{d['model']}` widths, S = {d['shards']}; timed: {shapes}. {d['sizing']}",
            markdown_table(d["rows"])]


def _serving(out: pathlib.Path) -> list[str]:
    d = _load(out / "serving.json")
    e = d["engine"]
    rows = [{"measure": m, "n": d[f"{k}_samples"], "p50_ms": d[f"{k}_p50_ms"],
             "p99_ms": d[f"{k}_p99_ms"], "max_ms": d[f"{k}_max_ms"]}
            for m, k in (("TTFT", "ttft"), ("ITL", "itl"), ("chat prompt", "prompt"))]
    return [f"Workload {d['workload']}; {d['tokens_per_s']:.4g} tokens/s over {d['wall_s']:.3g} s; "
            f"host share {e['host_share']:.3g} (host {e['host_ms_per_step']:.3g} + server CPU "
            f"{e['server_cpu_ms_per_step']:.3g} vs device {e['device_ms_per_step']:.4g} ms/step).",
            markdown_table(rows), markdown_table(d["uploads"]),
            _image(out, out / "serving.png", "serving timeline and latencies")]


def _kernels(out: pathlib.Path) -> list[str]:
    d = _load(out / "kernels.json")
    return [f"Mode `{d['mode']}`, size `{d['size']}` (interpret-mode ms time the CPU "
            "simulation, not the kernel).",
            markdown_table(d["results"], ["kernel", "cache_dtype", "grid", "vmem_bytes", "bytes",
                                          "flops", "max_abs_err", "rel_l2", "call_ms"])]


@dataclasses.dataclass(frozen=True)
class Section:
    """One benchmark: its name in the registry (benchmarks/registry.py), its `--out` directory
    inside DIR ("": DIR itself), the renderer of its outputs, and whether it runs on the report's
    `--shards`."""

    name: str
    title: str
    out: str
    render: Callable[[pathlib.Path], list[str]]
    takes_shards: bool = False

    def argv(self, out: pathlib.Path, *, quick: bool, shards: int,
             no_progress: bool) -> list[str]:
        return [*(("--quick",) if quick else ()), *(("--no-progress",) if no_progress else ()),
                *(("--shards", str(shards)) if self.takes_shards else ()),
                "--out", str(out / self.out)]


SECTIONS = (
    Section("niah", "Needle in a haystack (recall per cache dtype)", "niah", _niah,
            takes_shards=True),
    Section("capacity", "Capacity", "capacity", _capacity),
    Section("kernel_error", "fp8 cache error", "", _kernel_error),
    Section("selection", "Indexer cache dtype and selection", "selection", _selection),
    Section("throughput", "Throughput and roofline", "", _throughput, takes_shards=True),
    Section("merge", "Merge collectives", "", _merge, takes_shards=True),
    Section("kernels", "Pallas kernels vs references", "", _kernels),
    Section("serving", "Serving under load (a server process, concurrent clients)", "",
            _serving),
)


# -- running --------------------------------------------------------------------------------
class _Tee(io.TextIOBase):
    """Writes to a stream and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _run(section: Section, out: pathlib.Path, *, args: argparse.Namespace, label: str) -> dict:
    """Run one benchmark's main; returns its argv, seconds, console text and error (or None)."""
    argv = section.argv(out, quick=args.quick, shards=args.shards, no_progress=args.no_progress)
    print(f"\n== [{label}] {section.name}: cp-runtime bench {section.name} "
          f"{' '.join(argv)}", flush=True)
    tee = _Tee(sys.stdout)
    error = None
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(tee):
        try:
            status = registry.load(section.name).main(argv)
            if status:
                error = f"exit status {status}"
        except SystemExit as e:                 # argparse and some mains exit instead of raising
            if e.code:
                error = f"exit: {e.code}"
        except Exception:                       # reported in the section; the suite goes on
            error = traceback.format_exc()
    return {"argv": argv, "seconds": time.perf_counter() - t0, "console": tee.copy.getvalue(),
            "error": error}


def _section_md(section: Section, run: dict, out: pathlib.Path) -> list[str]:
    md = [f"## {section.title}", "",
          f"`cp-runtime bench {section.name} {' '.join(run['argv'])}`: "
          f"{run['seconds']:.1f} s", ""]
    blocks = []
    if run["error"] is None:
        try:
            blocks = section.render(out)
        except (OSError, KeyError, ValueError) as e:
            blocks = [f"(could not render the outputs: {e!r})"]
    else:
        blocks = ["**failed:**", "```text\n" + run["error"].rstrip() + "\n```"]
    md += [b for block in blocks if block for b in (block, "")]
    md += ["<details><summary>console output</summary>", "", "```text",
           run["console"].rstrip(), "```", "</details>", ""]
    return md


def write_report(out: pathlib.Path, runs: dict[str, dict], *, quick: bool, total_s: float,
                 pending: tuple[str, ...] = ()) -> pathlib.Path:
    """DIR/report.md of the sections run so far (`runs`), the ones still to run listed as
    pending."""
    info = machine()
    done = f"{len(runs)} benchmarks in {total_s:.0f} s"
    if pending:
        done += f", {len(pending)} still to run"
    md = ["# cp-runtime benchmark report", "",
          f"{'Quick run' if quick else 'Full run'} of {done} "
          f"({time.strftime('%Y-%m-%d %H:%M')}).", "",
          markdown_table([info]), ""]
    md += [f"- {s.name}: {'failed' if runs[s.name]['error'] else 'ok'}, "
           f"{runs[s.name]['seconds']:.1f} s" for s in SECTIONS if s.name in runs]
    md += [f"- {name}: pending" for name in pending]
    md.append("")
    for section in SECTIONS:
        if section.name in runs:
            md += _section_md(section, runs[section.name], out)
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def last_error_line(error: str) -> str:
    """The line of a section's error that says what went wrong: a traceback's last line."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[-1] if lines else error


def build_parser(prog: str = PROG) -> BenchmarkParser:
    """The flags; `prog` names the command in usage and errors (`cp-runtime bench all` runs
    this same report)."""
    names = [s.name for s in SECTIONS]
    p = BenchmarkParser("all", "Run every benchmark and write DIR/report.md, rewritten after "
                               "each section.\nJAX gets --shards virtual CPU devices, and niah, "
                               "throughput and merge run on that many shards;\n--quick and "
                               "--no-progress are passed on to every section.",
                        quick="every benchmark in its own quick mode (minutes on a CPU)",
                        prog=prog)
    p.add_argument("--only", type=comma_list(str, choices=names), default=None,
                   metavar="NAME[,NAME...]",
                   help=f"run only these sections, from: {', '.join(names)} (unset: all)")
    # --no-progress: passed on to every section
    p.add_shared(shards=16, out="out/report", progress=True)
    return p


def parse_args(argv: list[str] | None = None,
               prog: str = PROG) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the `--shards` devices set up, then `--out`
    created (`args.out` a Path)."""
    return build_parser(prog).parse_args(argv)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Run the chosen sections in order, rewriting report.md after each; 1 if any failed."""
    args = parse_args(argv, prog)
    out, only = args.out, args.only or [s.name for s in SECTIONS]
    t0 = time.perf_counter()
    chosen = [s for s in SECTIONS if s.name in only]
    runs: dict[str, dict] = {}
    for i, section in enumerate(chosen, 1):
        run = runs[section.name] = _run(section, out, args=args, label=f"{i}/{len(chosen)}")
        if run["error"]:
            print(f"== {section.name} FAILED after {run['seconds']:.1f} s: "
                  f"{last_error_line(run['error'])}", flush=True)
        write_report(out, runs, quick=args.quick, total_s=time.perf_counter() - t0,
                     pending=tuple(s.name for s in chosen[i:]))
    path = out / "report.md"
    failed = [n for n, r in runs.items() if r["error"]]
    print(f"\nwrote {path} ({time.perf_counter() - t0:.0f} s"
          + (f"; failed: {', '.join(failed)})" if failed else ")"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
