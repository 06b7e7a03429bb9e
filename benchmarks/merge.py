"""Time the two merge collectives of cp_runtime/merge.py on S devices, decode- and prefill-like
shapes, in one run (ratios are what matter on a noisy machine).

    cp-runtime bench merge                   # writes out/merge.json
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import time

from cp_runtime.benchmarks.common import init_shard_devices, machine, print_table, write_json
from cp_runtime.cli_args import HelpFormatter, add_out, add_shards, check_out_dir, positive_int

__all__ = ["build_parser", "parse_args", "main"]

SHAPES = {"decode B=8 H=64": (8, 1, 64), "prefill Q=256 H=16": (1, 256, 16)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cp-runtime bench merge", formatter_class=HelpFormatter,
                                description="gather_psum vs all_to_all merge of (o, lse) partials.")
    add_shards(p, 16)
    p.add_argument("--value-dim", type=positive_int, default=512, help="latent width (kv_lora)")
    p.add_argument("--repeats", type=positive_int, default=30,
                   help="timed calls per merge (the median is reported)")
    add_out(p, "out")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for `--shards` set up, then
    `--out` created."""
    parser = build_parser()
    args = parser.parse_args(argv)
    init_shard_devices(parser, args.shards)
    check_out_dir(parser, args.out)
    return args


def _time(fn, *args, repeats: int) -> float:
    fn(*args)[0].block_until_ready()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)[0].block_until_ready()
        samples.append(time.perf_counter() - t0)
    return 1000 * statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cp_runtime.merge import MERGES

    mesh = jax.make_mesh((args.shards,), ("cp",))
    rows = []
    for label, (b, q, h) in SHAPES.items():
        key = jax.random.key(0)
        o = jax.random.normal(key, (args.shards, b, q, h, args.value_dim), jnp.float32)
        lse = jax.random.normal(key, (args.shards, b, q, h), jnp.float32)
        o, lse = (jax.device_put(x, NamedSharding(mesh, P("cp"))) for x in (o, lse))
        row = {"shape": label}
        for name, merge in MERGES.items():
            fn = jax.jit(jax.shard_map(functools.partial(lambda m, a, b: m(a[0], b[0], "cp"),
                                                         merge),
                                       mesh=mesh, in_specs=(P("cp"), P("cp")),
                                       out_specs=(P(), P()), check_vma=False))
            row[f"{name}_ms"] = _time(fn, o, lse, repeats=args.repeats)
        row["all_to_all / gather_psum"] = row["all_to_all_ms"] / row["gather_psum_ms"]
        rows.append(row)
    print_table(rows, ["shape", "gather_psum_ms", "all_to_all_ms", "all_to_all / gather_psum"],
                title=f"merge collectives, S={args.shards}, Dv={args.value_dim}, "
                      f"{machine()['backend']} ({machine()['cpu_count']} cores)")
    write_json(pathlib.Path(args.out) / "merge.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
