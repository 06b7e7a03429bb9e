"""Time the two merge collectives of cp_runtime/merge.py on S devices, decode- and prefill-like
shapes, in one run (ratios are what matter on a noisy machine).

    cp-runtime bench merge
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from cp_runtime.benchmarks.common import init_cpu_devices, machine, print_table, write_json

__all__ = ["build_parser", "main"]

SHAPES = {"decode B=8 H=64": (8, 1, 64), "prefill Q=256 H=16": (1, 256, 16)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cp-runtime bench merge",
                                description="gather_psum vs all_to_all merge of (o, lse) partials.")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--value-dim", type=int, default=512, help="latent width (kv_lora)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default="out/merge.json")
    return p


def _time(fn, *args, repeats: int) -> float:
    fn(*args)[0].block_until_ready()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)[0].block_until_ready()
        samples.append(time.perf_counter() - t0)
    return 1000 * statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_cpu_devices(args.shards)
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
    write_json(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
