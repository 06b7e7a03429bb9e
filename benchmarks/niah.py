"""Needle in a haystack: recall and log-prob uplift over context lengths x needle depths, per
needle variant, latent cache dtype and shard count, through the serving path (Engine ->
LocalExecutor -> paged, sharded, quantized cache).

By default the model is the hand-built retrieval model (cp_runtime/model/recall.py): it measures
whether the runtime's retrieval path (indexer page selection, context-parallel top-K, sparse
attention over the cache) finds a fact, not language ability. With `--checkpoint DIR` it runs a
real checkpoint with its tokenizer and RULER-style text needles (a key-value sentence hidden in
filler text, then a question). The contexts come from benchmarks/_shared/needles.py; this module
runs them and reports.

Per trial: the context (haystack with the needle(s) at `depth`, the fraction of the haystack
before the first needle), then the question; the answer is scored teacher-forced:

    recall    = every answer token is the argmax (the same as greedy decoding producing it)
    logprob   = sum of log p(answer token)
    uplift    = logprob - logprob of the same answer with the needle(s) absent (same haystack)

Variants: `single` (one needle), `distract` (2 needles at the depth, each with 3 sibling facts
whose keys are near its key, with other values, scattered through the haystack: for the recall
model cosine 0.98, so cache precision decides the answer), `multi` (4 needles with unrelated
keys at the depth). Every needle is asked once; counts add up per (variant, dtype, shards) as
"correct/trials".

Prefill cost: one engine per (dtype, shards); per (variant, length) one root session prefills
the haystack once, in order of depth; each depth forks the root where its needles go, prefills
the rest of its context, forks once per question, and closes everything. The root, completed,
gives the needle-absent baseline. That is L + sum_d (L - p_d) prefill tokens per (variant,
length) instead of L * depths (3.5 L instead of 5 L at 5 depths).

Cost on the development machine (2 x86 cores, 16 virtual CPU devices, S = 16): `--quick` about
1.5 min. The default sweep prefills 8.15M tokens; measured per dtype (3 variants, 8K-128K,
compiles included) as 21 min for fp8_e4m3 (2.1 K tokens/s) and 25 min for fp8_e5m2 (1.8 K), with
a test run sharing the cores for part of each, so about 1 h 10 min for the three dtypes on a quiet
machine. The 128K contexts take over half of it (the indexer scores every earlier key).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time
from collections.abc import Callable

import numpy as np
from tqdm import tqdm

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.needles import (VARIANTS, Case, Context, ContextFn, Probe,
                                                   recall_context, shared_recall_model,
                                                   text_context)
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cache.layout import cdiv
from cp_runtime.cli.args import (add_selection, check_checkpoint_dir, check_not_below_page,
                                 comma_list, length_list, positive_int)
from cp_runtime.config import ModelConfig, RuntimeConfig, load_model_config
from cp_runtime.engine import Engine
from cp_runtime.engine.executor import LocalExecutor
from cp_runtime.model.recall import RecallLayout
from cp_runtime.model.source import WeightsSource
from cp_runtime.optional import require
from cp_runtime.weights.params import Params
from cp_runtime.weights.placement import BlockSource

__all__ = ["Score", "Workload", "build_parser", "parse_args", "main", "run_context",
           "run_sweep", "score_probes", "write_heatmap"]

DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2")
DEFAULT_LENGTHS = "8k,16k,32k,64k,128k"
QUICK_LENGTHS = "2k,4k"
DEFAULT_DEPTHS = 5
QUICK_DEPTHS = 3
# Flags --quick changes: dest -> (default, --quick value), as typed; an explicit flag wins.
QUICK = {"lengths": (DEFAULT_LENGTHS, QUICK_LENGTHS),
         "depths": (str(DEFAULT_DEPTHS), str(QUICK_DEPTHS))}
PROBE_SLACK = 1024  # tokens a context may hold beyond its length (needle sentences, question)


def _depths(text: str) -> tuple[float, ...]:
    """argparse type: '5' -> five evenly spaced depths in [0, 1]; '0,0.5,1' -> those."""
    try:
        if "," not in text and "." not in text:
            n = int(text)
            if n < 1:
                raise argparse.ArgumentTypeError(f"{text!r}: need at least one depth")
            return tuple(float(x) for x in np.linspace(0.0, 1.0, n)) if n > 1 else (0.5,)
        depths = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor a list of "
                                         "depths") from None
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise argparse.ArgumentTypeError(f"{text!r}: depths lie in [0, 1]")
    return depths


# -- running ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Score:
    correct: bool
    logprob: float


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def score_probes(engine, session_id: int, probes: list[Probe]) -> list[Score]:
    """Teacher-forced scores of each probe appended to the session, which is left unchanged
    (each probe runs on a fork). When every probe is one token in and one token out they go
    in batched decode steps, otherwise one chunked extend each."""
    if all(len(p.prompt) == 1 and len(p.answer) == 1 for p in probes):
        return _score_by_decode(engine, session_id, probes)
    return [_score_by_extend(engine, session_id, p) for p in probes]


def _score_by_decode(engine, session_id: int, probes: list[Probe]) -> list[Score]:
    scores = []
    step = engine.runtime.max_batch
    for i in range(0, len(probes), step):
        group = probes[i: i + step]
        forks = [engine.fork(session_id) for _ in group]
        try:
            logits = engine.decode([f.id for f in forks], [p.prompt[0] for p in group])
        finally:
            for f in forks:
                engine.close_session(f.id)
        for row, p in zip(_log_softmax(logits), group):
            scores.append(Score(bool(row.argmax() == p.answer[0]), float(row[p.answer[0]])))
    return scores


def _score_by_extend(engine, session_id: int, probe: Probe) -> Score:
    fork = engine.fork(session_id)
    try:
        logits = engine.extend(fork.id, list(probe.prompt) + list(probe.answer[:-1]),
                               all_logits=True)
    finally:
        engine.close_session(fork.id)
    rows = _log_softmax(logits[len(probe.prompt) - 1:])                  # [len(answer), V]
    picked = rows[np.arange(len(probe.answer)), list(probe.answer)]
    return Score(bool((rows.argmax(-1) == np.asarray(probe.answer)).all()), float(picked.sum()))


def run_context(engine, ctx: Context, progress: Callable[[int], None] | None = None
                ) -> tuple[list[list[Score]], list[list[Score]]]:
    """Scores per case and the needle-absent baseline scores of the same probes."""
    root = engine.create_session()
    done, per_case = 0, []
    try:
        for case in ctx.cases:
            if case.start > done:
                engine.extend(root.id, ctx.haystack[done: case.start].tolist(), progress=progress)
                done = case.start
            child = engine.fork(root.id)
            try:
                engine.extend(child.id, case.suffix.tolist(), progress=progress)
                per_case.append(score_probes(engine, child.id, list(case.probes)))
            finally:
                engine.close_session(child.id)
        if done < len(ctx.haystack):
            engine.extend(root.id, ctx.haystack[done:].tolist(), progress=progress)
        flat = score_probes(engine, root.id, [p for c in ctx.cases for p in c.probes])
    finally:
        engine.close_session(root.id)
    baseline, i = [], 0
    for case in ctx.cases:
        baseline.append(flat[i: i + len(case.probes)])
        i += len(case.probes)
    return per_case, baseline


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the sweep runs: a model, its weights, and how to build a context."""

    name: str
    cfg: ModelConfig
    params: Params | BlockSource
    make_context: ContextFn


def _runtime(args, cfg: ModelConfig, dtype: str, shards: int, max_len: int) -> RuntimeConfig:
    # A root and one child at a time (pages spread over the shards; text needles and questions
    # add up to PROBE_SLACK tokens), plus the question forks, whose new pages can all land on
    # one shard (the owner of the page after the context).
    spread = cdiv(cdiv(2 * (max_len + PROBE_SLACK), args.page_size), shards)
    per_shard = spread + 2 * args.max_batch + 2
    return RuntimeConfig(model=cfg.name, kv_cache_dtype=dtype, page_size=args.page_size,
                         num_shards=shards, pages_per_shard=per_shard,
                         chunk_size=args.chunk_size, max_batch=args.max_batch,
                         query_block=args.query_block, backend=args.backend,
                         weight_dtype=args.weight_dtype, selection=args.selection)


def run_sweep(args, work: Workload) -> dict:
    """Every (shards, dtype, variant, length, depth) cell; returns the report payload."""
    variants = [VARIANTS[v] for v in args.variants]
    contexts = {}
    for variant in variants:
        for length in args.lengths:
            rng = np.random.default_rng([args.seed, list(VARIANTS).index(variant.name), length])
            contexts[variant.name, length] = work.make_context(variant, length, args.depths, rng)
    per_setting = sum(c.prefill_tokens for c in contexts.values())
    total = per_setting * len(args.kv_cache_dtypes) * len(args.shards)
    print(f"niah: {work.name}, {len(contexts)} contexts x {len(args.kv_cache_dtypes)} dtypes x "
          f"{len(args.shards)} shard counts, {total:,} prefill tokens")
    cells, timings = [], []
    bar = tqdm(total=total, unit="tok", unit_scale=True, disable=args.no_progress,
               dynamic_ncols=True, mininterval=1.0)
    for shards in args.shards:
        for dtype in args.kv_cache_dtypes:
            rt = _runtime(args, work.cfg, dtype, shards, max(args.lengths))
            t0 = time.perf_counter()
            engine = Engine(work.cfg, rt, LocalExecutor(work.cfg, rt, work.params))
            for (variant, length), ctx in contexts.items():
                bar.set_description(f"S={shards} {dtype} {variant} {length}")
                per_case, baseline = run_context(engine, ctx, progress=bar.update)
                for case, scores, base in zip(ctx.cases, per_case, baseline):
                    cells.append(_cell(shards, dtype, variant, length, case, scores, base))
            engine.executor.close()
            del engine                                   # free this setting's pool
            timings.append({"shards": shards, "dtype": dtype, "prefill_tokens": per_setting,
                            "seconds": time.perf_counter() - t0})
    bar.close()
    return {"model": work.name, "variants": {v.name: dataclasses.asdict(v) for v in variants},
            "lengths": list(args.lengths), "depths": list(args.depths),
            "page_size": args.page_size, "index_topk": work.cfg.index_topk,
            "selection": args.selection,
            "chunk_size": args.chunk_size, "seed": args.seed, "cells": cells,
            "summary": _summary(cells), "timings": timings}


def _cell(shards, dtype, variant, length, case: Case, scores: list[Score],
          base: list[Score]) -> dict:
    lp = [s.logprob for s in scores]
    blp = [s.logprob for s in base]
    return {"shards": shards, "dtype": dtype, "variant": variant, "length": length,
            "depth": case.depth, "trials": len(scores),
            "correct": sum(s.correct for s in scores),
            "baseline_correct": sum(s.correct for s in base),
            "logprob": float(np.mean(lp)), "baseline_logprob": float(np.mean(blp)),
            "uplift": float(np.mean(np.subtract(lp, blp)))}


def _summary(cells: list[dict]) -> list[dict]:
    """Per (variant, shards, dtype), in run order: correct/trials per length and overall, and
    the mean uplift (nats)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["variant"], c["shards"], c["dtype"]), []).append(c)
    out = []
    for (variant, shards, dtype), cs in sorted(groups.items(), key=lambda kv: (
            list(VARIANTS).index(kv[0][0]) if kv[0][0] in VARIANTS else len(VARIANTS),
            kv[0][1])):
        row = {"shards": shards, "dtype": dtype, "variant": variant}
        for length in sorted({c["length"] for c in cs}):
            sel = [c for c in cs if c["length"] == length]
            row[_length_label(length)] = (f"{sum(c['correct'] for c in sel)}/"
                                          f"{sum(c['trials'] for c in sel)}")
        row["recall"] = f"{sum(c['correct'] for c in cs)}/{sum(c['trials'] for c in cs)}"
        row["no_needle"] = (f"{sum(c['baseline_correct'] for c in cs)}/"
                            f"{sum(c['trials'] for c in cs)}")
        weights = np.asarray([c["trials"] for c in cs], float)
        row["uplift_nats"] = float(np.average([c["uplift"] for c in cs], weights=weights))
        out.append(row)
    return out


def _length_label(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % (1 << 10) == 0 else str(n)


# -- output -------------------------------------------------------------------------------
def write_heatmap(report: dict, path: pathlib.Path) -> pathlib.Path:
    """Recall fraction per length x depth: one panel per (variant, dtype), one row of panels
    per variant, shard counts side by side."""
    require("matplotlib", "the needle heatmap", "bench")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    variants = list(report["variants"])
    cols = sorted({(c["shards"], c["dtype"]) for c in cells}, key=lambda k: (k[0], k[1]))
    lengths, depths = report["lengths"], sorted(set(report["depths"]))
    fig, axes = plt.subplots(len(variants), len(cols), squeeze=False,
                             figsize=(2.2 + 2.4 * len(cols), 0.8 + 2.0 * len(variants)))
    for r, variant in enumerate(variants):
        for k, (shards, dtype) in enumerate(cols):
            ax = axes[r][k]
            grid = np.full((len(lengths), len(depths)), np.nan)
            for c in cells:
                if (c["variant"], c["shards"], c["dtype"]) == (variant, shards, dtype):
                    i, j = lengths.index(c["length"]), depths.index(c["depth"])
                    grid[i, j] = c["correct"] / c["trials"]
                    ax.text(j, i, f"{c['correct']}/{c['trials']}", ha="center", va="center",
                            fontsize=7)
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(depths)), [f"{d:.2g}" for d in depths], fontsize=7)
            ax.set_yticks(range(len(lengths)), [_length_label(n) for n in lengths], fontsize=7)
            ax.set_title(f"{variant}, {dtype}, S={shards}", fontsize=8)
            if r == len(variants) - 1:
                ax.set_xlabel("needle depth", fontsize=7)
            if k == 0:
                ax.set_ylabel("context length", fontsize=7)
    fig.suptitle(f"needle recall (correct/trials), model {report['model']}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_report(report: dict, info: dict) -> None:
    print(f"machine: {info['processor']}, {info['cpu_count']} CPUs, jax {info['jax']} "
          f"backend {info['backend']} ({info['devices']} x {info['device_kind']})")
    lengths = [_length_label(n) for n in report["lengths"]]
    print_table(report["summary"],
                ["variant", "dtype", "shards", *lengths, "recall", "no_needle", "uplift_nats"],
                title=f"needle recall (correct/trials), {report['model']}, depths "
                      f"{report['depths']}, page_size {report['page_size']}, "
                      f"index_topk {report['index_topk']}")
    for t in report["timings"]:
        print(f"S={t['shards']} {t['dtype']}: {t['prefill_tokens']:,} prefill tokens in "
              f"{t['seconds']:.1f} s ({t['prefill_tokens'] / t['seconds']:,.0f} tokens/s, "
              "compiles included)")


# -- command line -------------------------------------------------------------------------
def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("niah", "Needle-in-a-haystack recall and log-prob uplift over context "
                                "lengths x depths, per needle variant, cache dtype and shard "
                                "count.",
                        quick=f"small sweep for a few minutes on a CPU: lengths {QUICK_LENGTHS}, "
                              f"{QUICK_DEPTHS} depths (explicit --lengths/--depths win)",
                        quick_values=QUICK, check=_check)
    p.add_argument("--lengths", type=length_list, metavar="N[,N...]",
                   help="context lengths, e.g. 8k,16k,1m")
    p.add_argument("--depths", type=_depths,
                   help="a count of evenly spaced depths or a list like 0,0.5,1")
    p.add_argument("--variants", type=comma_list(str, choices=list(VARIANTS)),
                   default=",".join(VARIANTS), metavar="V[,V...]",
                   help=f"needle variants, from: {', '.join(VARIANTS)}")
    p.add_argument("--query-block", type=positive_int, default=16,
                   help="sparse prefill query block")
    p.add_argument("--max-batch", type=positive_int, default=8, help="questions per decode step")
    add_selection(p)
    p.add_shared(model="recall", checkpoint=True, shard_counts="16",
                 kv_cache_dtypes=",".join(DTYPES), weight_dtype=True, page_size=16,
                 chunk_size=256, backend="auto", seed="the contexts", out="out/niah",
                 progress=True,
                 why={"chunk_size": "the recall figures of docs/recall.md were measured with it"})
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    """The lengths cover a page; without --checkpoint, --model has the recall layout."""
    args.lengths = sorted(set(args.lengths))
    check_not_below_page(parser, "--lengths", args.lengths, args.page_size)
    if args.checkpoint is None:
        try:
            RecallLayout().check(load_model_config(args.model))
        except ValueError as e:
            parser.error(f"--model {args.model}: {e} (other models run with --checkpoint)")
    check_checkpoint_dir(parser, args.checkpoint)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with `--quick`'s lengths and depths filled in,
    the devices for the largest of `--shards` set up, then `--out` created."""
    return build_parser().parse_args(argv)


def _workload(args) -> Workload:
    if args.checkpoint is None:
        model = shared_recall_model(load_model_config(args.model))
        return Workload(args.model, model.cfg, model.params,
                        lambda v, n, d, rng: recall_context(model, v, n, d, rng))
    # The checkpoint's files, read a device's block at a time (fp8 stays fp8 on the devices).
    loaded = WeightsSource(checkpoint=args.checkpoint).load()
    return Workload(loaded.config.name, loaded.config, loaded.weights,
                    lambda v, n, d, rng: text_context(loaded.tokenizer, v, n, d, rng))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = _workload(args)
    report = run_sweep(args, work)
    info = machine()
    print_report(report, info)
    out = args.out
    json_path = write_json(out / "niah.json", report)
    png_path = write_heatmap(report, out / "niah_heatmap.png")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
