"""A decode step as the context and the pool grow, its host overhead, its merge's share and its
gathers: five comparisons in one run, interleaved step by step (each round runs --steps steps
of every configuration, one step each in an order shuffled every time, so drift on a shared
machine hits all alike and no configuration always follows the same one), reported as min /
median / max over the rounds of each round's median step.

    cp-runtime bench decode                       # small, S = 16: 8K vs 1M, 1x vs 4x pool, ...
    cp-runtime bench decode --long 128k --rounds 3
    cp-runtime bench decode --quick               # 8K vs 128K, 32K pool context, 3 rounds x 4

  context   one session at --short and one at --long tokens, in the same engine and pool. The
            bound the long step should meet: t(short) + 2 x (extra bytes) / read bandwidth, the
            extra bytes being the profile's minimum bytes of a decode step (every phase) at
            --long minus at --short, the bandwidth measured in the same run
            (_shared/roofline_probe.py)
  pool      one session at --pool-context tokens in a pool of 1x and of 4x the pages it needs
  host      --batch sessions at --short decoding together: the engine's host time (planning,
            applying results) plus the executor's (moving the plan to the devices, fetching
            outputs), beside the device program's (launch included: XLA:CPU runs part of a
            program before the call returns, so launch and work do not separate here)
  merge     the short step as the engine runs it, and the same step with each shard's partial
            projected alone, no collective (wrong unless S = 1, timed only); share = the
            difference / the step, per round (the two were interleaved step by step within it),
            reported as the median over the rounds with its min and max
  gathers   the short step with XLA's all-gathers, flat (one collective over every shard) and
            staged, beside the engine's (`auto`: on CPU the in-process gather where it can run,
            cp_runtime.parallel.collectives)

The pool is synthetic (random values in every page; sessions whose page tables cover their
length), as in `bench profile`: a million-token context costs seconds, not a prefill.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import statistics

from cp_runtime.benchmarks._shared.bench_parser import TPU_PAGES, BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import check_not_below_page, length, positive_int

__all__ = ["build_parser", "parse_args", "main"]

QUICK = {"long": ("1m", "128k"), "pool_context": ("128k", "32k"), "rounds": ("15", "3"),
         "steps": ("8", "4")}


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("decode", "Decode step vs context, pool size, batch host time and merge "
                                  "share, interleaved in one run.",
                        quick="a shorter long context and pool context, fewer rounds and steps",
                        quick_values=QUICK, check=_check)
    p.add_argument("--short", type=length, default=8 << 10, metavar="N",
                   help="short context (tokens)")
    p.add_argument("--long", type=length, metavar="N", help="long context, tokens")
    p.add_argument("--pool-context", type=length, metavar="N",
                   help="context of the 1x vs 4x pool comparison, tokens")
    p.add_argument("--batch", type=positive_int, default=8,
                   help="sessions decoding together for the host-time measurement")
    p.add_argument("--rounds", type=positive_int, help="interleaved rounds")
    p.add_argument("--roofline-mib", type=positive_int, default=None,
                   help="read-bandwidth array size, all devices together (unset: by backend)")
    p.add_argument("--steps", type=positive_int,
                   help="decode steps per configuration and round, their median the round's "
                        "figure")
    p.add_shared(model="small", shards=16, kv_cache_dtype="fp8_e4m3", weight_dtype=True,
                 page_size=64, out="out", progress=True, why={"page_size": TPU_PAGES})
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    check_not_below_page(parser, "--short", args.short, args.page_size)
    if not args.short < args.long:
        parser.error(f"--short {args.short} must be below --long {args.long}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for `--shards` set up, then
    `--out` created."""
    return build_parser().parse_args(argv)


class Bench:
    """An engine over a synthetic pool and its sessions, each decoding one token per step."""

    def __init__(self, model, params, args, contexts: list[int], pool_factor: int = 1):
        from cp_runtime.benchmarks._shared.profile_steps import fill_pool, synthetic_session
        from cp_runtime.cache.layout import cdiv
        from cp_runtime.config import RuntimeConfig
        from cp_runtime.engine import Engine, LocalExecutor

        ps = args.page_size
        pages = pool_factor * sum(cdiv(n + 2 * ps, ps) for n in contexts)
        rt = RuntimeConfig(model=model.name, kv_cache_dtype=args.kv_cache_dtype, page_size=ps,
                           num_shards=args.shards, pages_per_shard=cdiv(pages, args.shards) + 2,
                           chunk_size=max(ps, 1024), max_batch=max(8, args.batch),
                           weight_dtype=args.weight_dtype)
        self.executor = LocalExecutor(model, rt, params)
        self.engine = Engine(model, rt, self.executor)
        fill_pool(self.executor)
        self.sessions = [synthetic_session(self.engine, n + ps, n, model.vocab_size)
                         for n in contexts]
        self.contexts = contexts

    def step(self, which: list[int]) -> tuple[float, float]:
        """One decode step of the sessions `which`: (host s, device s), the executor's host
        work (transfers, fetch) counted as host."""
        from cp_runtime.benchmarks._shared.profile_steps import rewind
        from cp_runtime.engine.requests import Generate, SamplingParams

        for i in which:
            rewind(self.sessions[i], self.contexts[i])
            self.engine.submit(Generate(id=("decode", i), session=self.sessions[i].id,
                                        sampling=SamplingParams(max_tokens=1)))
        self.engine.step()
        t = self.engine.timings[-1]
        executor_host = self.executor.last_host_s
        return t.host_s + executor_host, t.device_s - executor_host


def _local_only(merge, o, lse, project, axis_name, ws, gathers):
    """combine() stand-in: this shard's partial projected alone, no collective."""
    return project(o)


def _round(configs: dict, rounds: dict, steps: int, rng: random.Random) -> None:
    """One round: `steps` steps of every configuration (a step -> (host s, device s)), one step
    each in a shuffled order; each configuration's median step is kept by name."""
    samples = {name: [] for name in configs}
    for _ in range(steps):
        for name in rng.sample(list(configs), len(configs)):
            samples[name].append(configs[name]())
    for name, got in samples.items():
        for part, index in (("host", 0), ("device", 1)):
            rounds.setdefault((name, part), []).append(statistics.median(s[index] for s in got))
        rounds.setdefault((name, "step"), []).append(statistics.median(sum(s) for s in got))


def _spread(values: list[float]) -> dict:
    return {"min_ms": 1e3 * min(values), "median_ms": 1e3 * statistics.median(values),
            "max_ms": 1e3 * max(values)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    from tqdm import tqdm

    from cp_runtime.benchmarks._shared.profile_work import phase_work, step_shape
    from cp_runtime.benchmarks._shared.roofline_probe import measure_roofline
    from cp_runtime.config import load_model_config
    from cp_runtime.engine.step import make_step
    from cp_runtime.weights.params import init_params

    model = load_model_config(args.model)
    params = init_params(model, seed=0)
    # Only the read bandwidth enters the bound: a token matmul keeps the roofline's cost low.
    roof = measure_roofline(jax.devices()[:args.shards], mem_mib=args.roofline_mib,
                            matmul_n=64)
    main_bench = Bench(model, params, args, [args.short, args.long] + [args.short] * args.batch)
    pools = {f: Bench(model, params, args, [args.pool_context], pool_factor=f) for f in (1, 4)}
    ex = main_bench.executor
    merged_step = ex._step
    tensors = ex.weight_tensors
    variants = {
        "without merge": make_step(model, ex.runtime, ex.pool_spec, ex.mesh, ex.kernels,
                                   tensors, combine_fn=_local_only),
        **{f"{mode} gathers": make_step(model, dataclasses.replace(ex.runtime, gathers=mode),
                                        ex.pool_spec, ex.mesh, ex.kernels, tensors)
           for mode in ("flat", "staged")}}

    def short_step_with(name):
        ex._step = variants[name]
        try:
            return main_bench.step([0])
        finally:
            ex._step = merged_step

    configs = {
        f"context {args.short}": lambda: main_bench.step([0]),
        f"context {args.long}": lambda: main_bench.step([1]),
        "pool 1x": lambda: pools[1].step([0]),
        "pool 4x": lambda: pools[4].step([0]),
        f"batch {args.batch}": lambda: main_bench.step(list(range(2, 2 + args.batch))),
        **{name: functools.partial(short_step_with, name) for name in variants},
    }
    for run in configs.values():              # compile every shape before timing any
        run()
    rounds: dict = {}
    rng = random.Random(0)
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round", disable=args.no_progress):
        _round(configs, rounds, args.steps, rng)

    rows = [{"configuration": name, "part": part, **_spread(v)}
            for (name, part), v in rounds.items()]
    print_table(rows, ["configuration", "part", "min_ms", "median_ms", "max_ms"],
                title=f"decode steps, {model.name}, S={args.shards}, {args.kv_cache_dtype}, "
                      f"{args.rounds} interleaved rounds x {args.steps} steps, "
                      f"{machine()['backend']} ({machine()['cpu_count']} cores)")

    def median(name, part="step"):
        return statistics.median(rounds[(name, part)])

    page_kw = dict(page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
                   shards=args.shards, param_bytes=4)
    work = {n: sum(w.bytes for w in phase_work(model, step_shape("decode", n, 1024),
                                              **page_kw).values())
            for n in (args.short, args.long)}
    extra_s = (work[args.long] - work[args.short]) / (roof["read_gb_per_s"] * 1e9)
    short, long = median(f"context {args.short}"), median(f"context {args.long}")
    with_merge = median(f"context {args.short}", "device")
    # Paired by round: drift between rounds (a shared machine) cancels.
    shares = [(w - wo) / w for w, wo in zip(rounds[(f"context {args.short}", "device")],
                                             rounds[("without merge", "device")])]
    checks = {
        "long_step_ms": 1e3 * long, "short_step_ms": 1e3 * short,
        "extra_bytes": work[args.long] - work[args.short],
        "read_gb_per_s": roof["read_gb_per_s"],
        "long_bound_ms": 1e3 * (short + 2 * extra_s),
        "long_over_bound": long / (short + 2 * extra_s),
        "pool_4x_over_1x": median("pool 4x") / median("pool 1x"),
        "batch_host_ms": 1e3 * median(f"batch {args.batch}", "host"),
        "batch_device_ms": 1e3 * median(f"batch {args.batch}", "device"),
        "merge_share": statistics.median(shares),
        "merge_share_min": min(shares), "merge_share_max": max(shares),
        "gathers_flat_over_engine": median("flat gathers", "device") / with_merge,
        "gathers_staged_over_engine": median("staged gathers", "device") / with_merge,
    }
    print_table([{"check": k, "value": v} for k, v in checks.items()], ["check", "value"],
                title="against the targets: long_over_bound <= 1, pool_4x_over_1x <= 1.10, "
                      "batch_host_ms <= 2, merge_share <= 0.10")
    write_json(args.out / "decode.json",
               {"machine": machine(), "args": {k: v for k, v in vars(args).items()},
                "rows": rows, "checks": checks, "roofline": roof})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
