"""The step programs a server will run, compiled before it says it is ready.

The engine pads every step to few shapes (cp_runtime.engine.plans): a prefill chunk is
[1, chunk_size] tokens, a decode step [B, 1] with B a power of two up to max_batch, and a page
table is S * 2^k entries wide, up to the widest a session of the whole pool can need (its pages
plus its rotation). So the programs are a grid, known from the runtime alone:

    fill     one per table width                                   (chunk_size tokens a step)
    sample   one per (decode batch bucket, table width)            (plain sampling)

`sampling="all"` adds each decode program's other sampling variants (penalties, logit bias,
top log-probabilities: cp_runtime.model.sampler), eight per shape in all; "plain" leaves those
to compile on first use. A tiered pool (`latent_device_pages`) has each program twice: over
its HBM tier alone and over the whole pool. A fork's page copy is compiled too (the HTTP door
forks a cached prefix for most requests); other programs (logits returned to the host, larger
page copies for spills to host memory, rows read for snapshots) compile on first use.

Each program is compiled (or loaded from JAX's persistent compilation cache, when one is set)
by the executor's `compile`, so the first request that needs it runs it at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from typing import Callable, Iterable

import jax
import numpy as np

from cp_runtime.cache.layout import cdiv
from cp_runtime.config import RuntimeConfig
from cp_runtime.engine.plans import bucket
from cp_runtime.engine.step import Segment, StepInputs
from cp_runtime.model.sampler import BIAS_SLOTS, MAX_TOP_LOGPROBS, PENALTY_WINDOW, SamplingArrays

__all__ = ["SAMPLING_CHOICES", "StartupProgram", "compile_at_startup", "enable_compile_cache",
           "precompile", "startup_programs", "table_widths"]

log = logging.getLogger(__name__)

SAMPLING_CHOICES = ("plain", "all")


@dataclasses.dataclass(frozen=True)
class StartupProgram:
    """One step program: a name for the log (`fill 1x8192 table 256`) and a plan of its
    shapes (one segment; its values are padding)."""

    name: str
    plan: tuple[Segment, ...]


def table_widths(runtime: RuntimeConfig) -> list[int]:
    """Every page-table width a step can have: S * 2^k up to the bucket of the widest table
    (all S * P pages of the pool, rotated by at most S - 1)."""
    s = runtime.num_shards
    widest = bucket(s * runtime.pages_per_shard + s - 1, s)
    widths, w = [], s
    while w <= widest:
        widths.append(w)
        w *= 2
    return widths


def batch_buckets(max_batch: int) -> list[int]:
    """The decode row counts a step pads to: powers of two up to bucket(max_batch)."""
    return [1 << i for i in range(bucket(max_batch, 1).bit_length())]


def _segment(kind: str, rows: int, width: int, table_width: int, sentinel: int,
             in_hbm: bool, sampling: SamplingArrays | None) -> Segment:
    inputs = StepInputs(tokens=np.zeros((rows, width), np.int32),
                        positions=np.full((rows, width), -1, np.int32),
                        page_table=np.full((rows, table_width), sentinel, np.int32),
                        logit_index=np.zeros((rows,), np.int32),
                        rotation=np.zeros((rows,), np.int32))
    return Segment(kind=kind, inputs=inputs, sampling=sampling, in_hbm=in_hbm)


def _sampling_variants(rows: int, sampling: str) -> list[tuple[str, SamplingArrays]]:
    if sampling not in SAMPLING_CHOICES:
        raise ValueError(f"sampling={sampling!r}: choose from {SAMPLING_CHOICES}")
    variants = [(0, 0, 0)] if sampling == "plain" else list(itertools.product(
        (0, PENALTY_WINDOW), (0, BIAS_SLOTS), (0, MAX_TOP_LOGPROBS)))
    out = []
    for window, slots, alternatives in variants:
        label = "".join(f" +{name}" for name, on in (("penalties", window), ("bias", slots),
                                                      ("logprobs", alternatives)) if on)
        out.append((label, SamplingArrays.greedy(rows, window=window, bias_slots=slots,
                                                 alternatives=alternatives)))
    return out


def startup_programs(runtime: RuntimeConfig, *, sampling: str = "plain",
                     max_context: int | None = None) -> list[StartupProgram]:
    """The grid of fill and decode programs (module docstring), cheapest first (narrow tables,
    few rows), so the log shows progress early. max_context: only tables a session of at most
    that many tokens needs (default: the whole pool)."""
    widths = table_widths(runtime)
    if max_context is not None:
        s = runtime.num_shards
        need = bucket(cdiv(max_context, runtime.page_size) + s - 1, s)
        widths = [w for w in widths if w <= need]
    tiers = [(False, runtime.pages_per_shard)]
    if runtime.latent_device_pages:
        tiers.append((True, runtime.latent_device_pages))
    programs = []
    for table_width in widths:
        for in_hbm, sentinel in tiers:
            where = " (HBM tier)" if in_hbm else ""
            programs.append(StartupProgram(
                f"fill 1x{runtime.chunk_size} table {table_width}{where}",
                (_segment("fill", 1, runtime.chunk_size, table_width, sentinel, in_hbm, None),)))
            for rows in batch_buckets(runtime.max_batch):
                for label, arrays in _sampling_variants(rows, sampling):
                    programs.append(StartupProgram(
                        f"decode {rows}x1 table {table_width}{label}{where}",
                        (_segment("sample", rows, 1, table_width, sentinel, in_hbm, arrays),)))
    return programs


def enable_compile_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path` for this process, every program in it
    however fast it compiled (JAX's defaults skip those under a second, which a restart would
    then compile again). Set before the first compile."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def precompile(compile_plan: Callable[[tuple[Segment, ...]], None],
               programs: Iterable[StartupProgram],
               on_done: Callable[[StartupProgram, float], None] | None = None) -> float:
    """compile_plan(program.plan) for each program (an executor's `compile`); on_done(program,
    seconds) after each (a progress bar, a log line). Returns the seconds in all."""
    start = time.perf_counter()
    for program in programs:
        t0 = time.perf_counter()
        compile_plan(program.plan)
        if on_done is not None:
            on_done(program, time.perf_counter() - t0)
    return time.perf_counter() - start


def compile_at_startup(executor, runtime: RuntimeConfig, *, sampling: str = "plain",
                       max_context: int | None = None, progress: bool = True) -> float:
    """Every startup program (`startup_programs`) compiled by `executor.compile`, with a log
    line each and, if `progress`, a bar on stderr. Returns the seconds taken."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    programs = startup_programs(runtime, sampling=sampling, max_context=max_context)
    with tqdm(total=len(programs), desc="compiling", unit="program",
              disable=not progress) as bar, logging_redirect_tqdm([logging.getLogger(
                  "cp_runtime")]):
        finished: list[StartupProgram] = []

        def done(program: StartupProgram, seconds: float) -> None:
            bar.update(1)
            finished.append(program)
            log.info("compile: %s in %.1f s (%d of %d)", program.name, seconds,
                     len(finished), len(programs))

        cached = _cache_entries()
        start = time.perf_counter()
        executor.compile_page_copy(1)        # forks: HTTP prefix reuse makes one per request
        precompile(executor.compile, programs, done)
        seconds = time.perf_counter() - start
    if cached is None:
        log.info("compile: %d step programs and a fork's page copy ready in %.1f s",
                 len(programs), seconds)
    else:
        log.info("compile: %d step programs and a fork's page copy ready in %.1f s; %d "
                 "compiled, the rest loaded from the compilation cache %s", len(programs),
                 seconds,
                 _cache_entries() - cached, jax.config.jax_compilation_cache_dir)
    return seconds


def _cache_entries() -> int | None:
    """Entries in this process's persistent compilation cache (None: there is none). A compile
    writes one; a program loaded from the cache writes none."""
    path = jax.config.jax_compilation_cache_dir
    if not path or not os.path.isdir(path):
        return None if not path else 0
    return sum(name.endswith("-cache") for name in os.listdir(path))
