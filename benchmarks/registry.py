"""The benchmark suite's one table: each benchmark's name (`cp-runtime bench NAME`), the module
that runs it and what it measures, in one line. `cp-runtime bench` (its NAME choices, its help
and the module it runs), `bench all` (benchmarks/suite_report.py, which runs a section of these
by name) and the tests all read this table; no other list of the benchmarks exists.

The layout of the folder the table points into:

    benchmarks/<module>.py   the entry points: one benchmark each, a `build_parser()` and a
                             `main(argv)`; none imports another
                             (tests/benchmarks/test_benchmark_registry.py)
    benchmarks/_shared/      the code two or more benchmarks share (argument base, results and
                             tables, plots, measured peaks, work counts, profiling parts)
    benchmarks/hand_model/   the analytical model of a TPU slice, `bench tpu_model`
                             (docs/hand-model.md)

A module is imported only when its benchmark runs (`load`), so reading the table imports
nothing heavier than this file.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

__all__ = ["Benchmark", "BENCHMARKS", "names", "get", "load", "run"]

PACKAGE = "cp_runtime.benchmarks"


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark: `cp-runtime bench NAME` runs `cp_runtime.benchmarks.<module>`'s
    `main(argv)`. `plots`: it draws PNGs, so it needs matplotlib (the `bench` extra); one that
    draws none runs on a bare TPU host."""

    name: str
    module: str
    purpose: str
    plots: bool = True

    @property
    def qualified_module(self) -> str:
        return f"{PACKAGE}.{self.module}"


BENCHMARKS = (
    Benchmark("niah", "niah",
              "needle-in-a-haystack recall and log-prob uplift over lengths, depths and dtypes"),
    Benchmark("serving", "serving",
              "concurrent client sessions against a real server: TTFT, ITL, tokens/s"),
    Benchmark("recovery", "restart_recovery",
              "how long a session takes to answer again after its server is killed and restarted"),
    Benchmark("capacity", "cache_capacity",
              "cache bytes per token and the tokens that fit on a TPU slice, per model and dtype"),
    Benchmark("kernel_error", "kernel_error",
              "error of an fp8 latent cache against a bf16 one, on the prefill and decode paths"),
    Benchmark("selection", "indexer_cache_dtype",
              "how often a narrower indexer key cache changes the page selection, and recall"),
    Benchmark("throughput", "throughput",
              "prefill tokens/s and decode ms/step vs context, shards, dtype and pool size"),
    Benchmark("kernels", "kernels",
              "each Pallas kernel's launch shape and cost next to its agreement with XLA's"),
    Benchmark("merge", "merge_variants",
              "every merge variant of the shards' attention partials: bytes and collectives"),
    Benchmark("roofline", "machine_roofline",
              "this machine's measured memory bandwidth and matmul FLOP/s"),
    Benchmark("million", "million",
              "one million-token session on the CPU: prefill, decode and peak RSS"),
    Benchmark("tpu_model", "hand_model.tpu_model",
              "the hand model: GLM-5.2 on a tpu7x-16 slice, by arithmetic (docs/hand-model.md)"),
    Benchmark("dispatch", "lockstep_dispatch",
              "per-step cost of lockstep dispatch: the Ray executor against the local one"),
    Benchmark("profile", "profile",
              "each phase of a decode step and a prefill chunk, timed against the roofline"),
    Benchmark("decode", "decode",
              "a decode step as context and pool grow: host overhead, merge share, gathers"),
    Benchmark("collectives", "all_gather_latency",
              "the latency of one small all-gather as the shards grow, XLA's and native"),
    Benchmark("overload", "overload",
              "more clients than a server can serve in time, with and without admission bound"),
    Benchmark("prefix_reuse", "prefix_reuse",
              "ten questions about one document over HTTP, with and without the prefix cache"),
    Benchmark("moe_layouts", "moe_layouts",
              "one device's routed experts of a prefill half-chunk, per expert-group layout"),
    Benchmark("host_pages", "host_page_transfers",
              "how fast a host-held latent cache's pages reach HBM and go back"),
    Benchmark("chip", "chip",
              "the engine on one accelerator chip against that chip's own measured peaks",
              plots=False),
    Benchmark("all", "suite_report",
              "the report: its sections' benchmarks in turn, written up as DIR/report.md"),
)

_BY_NAME = {b.name: b for b in BENCHMARKS}


def names() -> tuple[str, ...]:
    """Every benchmark's name, in the table's order (`all` last)."""
    return tuple(_BY_NAME)


def get(name: str) -> Benchmark:
    """The benchmark called `name` (KeyError, naming the known ones, for any other)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no benchmark {name!r}; known: {', '.join(_BY_NAME)}") from None


def load(name: str) -> ModuleType:
    """The module that runs benchmark `name`, imported now."""
    return importlib.import_module(get(name).qualified_module)


def run(name: str, argv: list[str] | None = None) -> int:
    """Benchmark `name`'s `main(argv)` in this process; its exit status."""
    return int(load(name).main(argv) or 0)
