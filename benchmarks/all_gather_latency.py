"""What one all-gather costs as the shards grow: XLA's, flat and in stages, and the native
in-process gather (cp_runtime.parallel.collectives), all in one run. A decode step's collectives
carry a few hundred bytes, so this times latency, not bytes.

    cp-runtime bench collectives                    # S = 2, 4, 8, 16; writes out/collectives.json
    cp-runtime bench collectives --shards 16 --depth 16
    cp-runtime bench collectives --quick            # 5 rounds instead of 30

Each program chains `--depth` gather-then-reduce calls over a small array of each shard (each
reduces the gathered copies to one, so the next call depends on it), and the same program with
one call; per call = (t(depth) - t(1)) / (depth - 1), which removes the program's launch. Flat is
one all-gather over every shard; staged is `tree_stages(S)` grouped all-gathers (S = 16: groups
of 4, then across the groups), so per call counts every stage; native is one in-process gather
(kernels/native_gather.py; left out, with a warning, where its library cannot be built). The
programs run interleaved in a shuffled order every round, and each figure is the median over
`--rounds` rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import positive_int

__all__ = ["build_parser", "parse_args", "main"]

MODES = ("flat", "staged", "native")
QUICK = {"rounds": ("30", "5")}


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("collectives", "Latency of one small all-gather (XLA's flat and staged, "
                                       "and the in-process one) as the shard count grows, in "
                                       "one run.",
                        quick="fewer timed rounds", quick_values=QUICK, check=_check)
    p.add_argument("--depth", type=positive_int, default=9,
                   help="chained collectives in the long program (at least 2)")
    p.add_argument("--values", type=positive_int, default=66,
                   help="f32 values each shard contributes (66: a decode merge's packed "
                        "partials of `small`)")
    p.add_argument("--rounds", type=positive_int,
                   help="timed rounds, each running every program once")
    p.add_shared(shard_counts="2,4,8,16", out="out", progress=True,
                 why={"shard_counts": "the sweep: how latency grows with the shard count"})
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    if args.depth < 2:
        parser.error(f"--depth {args.depth} must be at least 2")
    args.shards = sorted(set(args.shards))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for the largest of `--shards`
    set up, then `--out` created."""
    return build_parser().parse_args(argv)


def _program(shards: int, mode: str, calls: int, values: int):
    """(jitted program, its input): `calls` chained gather-then-reduce calls on `shards`
    devices, each shard holding f32[values]."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cp_runtime.parallel.collectives import gather_reduce

    mesh = jax.make_mesh((shards,), ("cp",), devices=jax.devices()[:shards])

    def body(x):
        x = x[0]
        for _ in range(calls):
            x = gather_reduce(x, "cp", lambda every: every.mean(0), mode)
        return x[None]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"),
                                check_vma=False))
    x = jax.device_put(jnp.ones((shards, values), jnp.float32), NamedSharding(mesh, P("cp")))
    run(x).block_until_ready()                                   # compile outside the timing
    return run, x


def _seconds(run, x) -> float:
    t0 = time.perf_counter()
    run(x).block_until_ready()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    from cp_runtime.kernels.native_gather import native_status
    from cp_runtime.parallel.collectives import tree_stages

    def applies(shards: int, mode: str) -> bool:
        if mode == "staged":
            return len(tree_stages(shards)) > 1
        return mode == "flat" or native_status() == "native"

    cases = [(s, mode) for s in args.shards for mode in MODES if applies(s, mode)]
    programs = {(s, mode, calls): _program(s, mode, calls, args.values)
                for s, mode in cases for calls in (1, args.depth)}
    samples = {key: [] for key in programs}
    rng = random.Random(0)
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round", disable=args.no_progress):
        for key in rng.sample(list(programs), len(programs)):
            samples[key].append(_seconds(*programs[key]))
    rows = []
    for s, mode in cases:
        one, deep = (statistics.median(samples[(s, mode, c)]) for c in (1, args.depth))
        rows.append({"shards": s, "mode": mode,
                     "stages": "x".join(map(str, tree_stages(s) if mode == "staged" else (s,))),
                     "program_1_ms": 1e3 * one,
                     "per_collective_ms": 1e3 * (deep - one) / (args.depth - 1)})
    print_table(rows, ["shards", "mode", "stages", "program_1_ms", "per_collective_ms"],
                title=f"one gather-then-reduce of {args.values} f32 per shard, median of "
                      f"{args.rounds} rounds, {machine()['backend']} "
                      f"({machine()['cpu_count']} cores)")
    write_json(args.out / "collectives.json",
               {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
