"""What lockstep dispatch costs per step: the same decode steps (tiny model, short context) on
the local executor and through the Ray executor (H worker processes of D devices), in one run.

    cp-runtime bench dispatch                   # table, and out/dispatch.json
    cp-runtime bench dispatch --quick           # 10 timed steps instead of 50

Needs Ray (the ray extra: pip install 'cp-runtime[ray]').

For each executor: the step as the engine sees it (plan to host outputs), the step as the
devices see it (inside the process that runs it), and their difference, the dispatch overhead.
Through Ray the overhead is the plan's trip to every worker and rank 0's outputs' trip back,
over each channel the executor has: plain actor calls, and a persistent socket per worker.
A no-op round trip on each channel is timed too (what dispatch costs with no step at all).

The device-side step through Ray is slower than the local one on a CPU for a reason that has
nothing to do with dispatch: its collectives cross processes (gloo) instead of threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import print_table, write_json
from cp_runtime.cli.args import length, positive_int
from cp_runtime.optional import require

__all__ = ["build_parser", "parse_args", "main"]

CHANNELS = ("actor", "socket")
QUICK = {"steps": ("50", "10")}


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("dispatch", "Per-step cost of lockstep dispatch: Ray executor vs local, "
                                    "decode steps of a tiny model.",
                        quick="fewer timed steps", quick_values=QUICK, check=_check)
    p.add_argument("--hosts", type=positive_int, default=2,
                   help="Ray worker processes (--shards / --hosts devices each)")
    p.add_argument("--context", type=length, default=256,
                   help="tokens in the session before the timed decode steps")
    p.add_argument("--batch", type=positive_int, default=1, help="sessions decoded per step")
    p.add_argument("--steps", type=positive_int,
                   help="timed decode steps per executor and channel, the median reported")
    p.add_shared(model="tiny", shards=16, kv_cache_dtype="f32", weight_dtype=True, page_size=16,
                 gathers=True, out="out", progress=True,
                 why={"kv_cache_dtype": "dispatch time does not depend on it; f32 is the tiny "
                                        "model's own dtype"})
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    if args.shards % args.hosts:
        parser.error(f"--shards {args.shards} is not a multiple of --hosts {args.hosts}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for `--shards` set up, then
    `--out` created."""
    return build_parser().parse_args(argv)


def _sessions(engine, args) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(0)
    ids = []
    for _ in range(args.batch):
        s = engine.create_session()
        engine.extend(s.id, rng.integers(0, engine.model.vocab_size, args.context).tolist())
        ids.append(s.id)
    return ids


def _decode_steps(engine, ids: list[str], steps: int, worker_s) -> tuple[list, list]:
    """(engine-side seconds, device-side seconds) of `steps` decode steps, after 3 warm-ups."""
    walls, devices = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        engine.decode(ids, [1] * len(ids))
        wall = time.perf_counter() - t0
        if i >= 3:
            walls.append(wall)
            devices.append(worker_s())
    return walls, devices


def _row(name: str, walls: list, devices: list, noop: list | None) -> dict:
    ms = lambda xs: 1e3 * statistics.median(xs)                        # noqa: E731
    over = [w - d for w, d in zip(walls, devices)]
    return {"executor": name, "step_ms": ms(walls), "device_ms": ms(devices),
            "overhead_ms": ms(over), "overhead_p90_ms": 1e3 * sorted(over)[int(0.9 * len(over))],
            "noop_roundtrip_ms": ms(noop) if noop else None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require("ray", "cp-runtime bench dispatch", "ray")        # before any work
    from cp_runtime.config import RuntimeConfig
    from cp_runtime.engine import Engine
    from cp_runtime.engine.executor import LocalExecutor
    from cp_runtime.model.source import WeightsSource

    source = WeightsSource(model=args.model, seed=0)
    loaded = source.load()
    pages = -(-(args.context + args.steps + 8) // args.page_size) * args.batch
    runtime = RuntimeConfig(model=loaded.config.name, kv_cache_dtype=args.kv_cache_dtype,
                            page_size=args.page_size, num_shards=args.shards,
                            pages_per_shard=max(4, -(-pages // args.shards) + 2),
                            chunk_size=max(64, args.page_size), max_batch=max(8, args.batch),
                            gathers=args.gathers, weight_dtype=args.weight_dtype)
    rows = []

    # Local: the executor's run() is the device step; its overhead is plan -> device arrays.
    local = LocalExecutor(loaded.config, runtime, loaded.weights)
    inner = {"s": 0.0}
    run = local.run

    def timed_run(plan):
        t0 = time.perf_counter()
        try:
            return run(plan)
        finally:
            inner["s"] = time.perf_counter() - t0

    local.run = timed_run
    engine = Engine(loaded.config, runtime, local)
    ids = _sessions(engine, args)
    walls, devices = _decode_steps(engine, ids, args.steps, lambda: inner["s"])
    rows.append(_row("local", walls, devices, None))
    del engine, local

    import ray

    from cp_runtime.cluster.ray_executor import RayExecutor

    ray.init(num_cpus=args.hosts + 1, include_dashboard=False, logging_level="warning",
             log_to_driver=False)
    try:
        executor = RayExecutor(source, runtime, hosts=args.hosts,
                               devices_per_host=args.shards // args.hosts, platform="cpu")
        engine = Engine(executor.model, runtime, executor)
        ids = _sessions(engine, args)
        for channel in CHANNELS:
            executor.use_channel(channel)
            walls, devices = _decode_steps(engine, ids, args.steps,
                                           lambda: executor.last_worker_s)
            noop = [executor.noop_roundtrip() for _ in range(args.steps)]
            rows.append(_row(f"ray/{channel}", walls, devices, noop))
        executor.close()
    finally:
        ray.shutdown()

    columns = ["executor", "step_ms", "device_ms", "overhead_ms", "overhead_p90_ms",
               "noop_roundtrip_ms"]
    print_table(rows, columns, title=f"dispatch per decode step: {args.model}, context "
                                     f"{args.context}, batch {args.batch}, S={args.shards} "
                                     f"({args.hosts} Ray workers x {args.shards // args.hosts}"
                                     f" devices), median of {args.steps} steps")
    if args.out:
        path = write_json(f"{args.out}/dispatch.json",
                          {"benchmark": "dispatch", "args": vars(args), "rows": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
