"""Where the shards' attention partials meet: every merge variant of cp_runtime/parallel/merge.py,
its bytes moved per token and device (from the collectives it issues, for a model's real head
count and widths) and its collectives timed on S devices in one run (ratios are what matter on
a noisy machine).

    cp-runtime bench merge                          # glm-5.2 widths, writes out/merge.json
    cp-runtime bench merge --model deepseek-v3.2
    cp-runtime bench merge --quick                  # 5 timed calls per variant and shape, not 20
    cp-runtime bench merge --prefill-tokens 256     # the full chunk (about 18 GB at glm-5.2)

Bytes per token per device, ring algorithms over S devices, f32 values (4 bytes):
    all-gather of n values in total    (S-1)/S * n      reduce-scatter of n    (S-1)/S * n
    all-reduce (psum) of n             2 (S-1)/S * n    all-to-all of n        (S-1)/S * n
Timing: `combine` itself runs inside shard_map with the output projection replaced by a sum over
the heads broadcast to the hidden width (the same output shape, no weight: the real W_uv and
o_proj of GLM-5.2 replicated on 16 CPU devices would not fit this machine), so what is timed
is each variant's collectives plus elementwise work. all_gather's gather runs flat (one
collective over every shard), as the byte counts above assume; `bench collectives` compares
flat and staged gathers.

Two shapes are timed: a decode step of 8 tokens, and a prefill chunk of Q tokens. all_gather
leaves every device with every shard's partials, S x Q x H x (Dv + 1) f32, so over the S devices
of one process the chunk costs S^2 x Q x H x (Dv + 1) x 4 bytes (glm-5.2 at S = 16: 34 MB per
token, 8.6 GB at Q = 256, about 18 GB of peak RSS with the inputs and temporaries). Unless
`--prefill-tokens` is given, Q is the largest multiple of 8 up to 256 whose gathered partials fit
`--gather-gib` (1 GiB: Q = 24 at glm-5.2, S = 16, 2.2 GB of peak RSS in all; the whole 256 for
the toy models); the output says which Q ran and what its gathered partials take. Per-token
bytes do not depend on Q; the times are per call, for that Q.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import finite_positive_float, length, positive_int

__all__ = ["VARIANTS", "bytes_per_token", "build_parser", "parse_args", "main"]

# (merge, weights) pairs that run; head_scatter and head_exchange need split weights,
# hidden_psum whole ones.
VARIANTS = (("gather_psum", "replicated"), ("all_to_all", "replicated"),
            ("all_gather", "replicated"), ("hidden_psum", "replicated"),
            ("gather_psum", "sharded"), ("all_to_all", "sharded"), ("all_gather", "sharded"),
            ("head_scatter", "sharded"), ("head_exchange", "sharded"))
DECODE_TOKENS = 8
PREFILL_TOKENS = 256                  # the chunk timed when its gathered partials fit
QUICK = {"repeats": ("20", "5")}


def bytes_per_token(merge: str, weights: str, *, heads: int, value_dim: int, hidden: int,
                    shards: int) -> float:
    """Bytes one device sends (= receives) per token for the merge and output projection."""
    s, f32 = shards, 4
    ring = (s - 1) / s
    lse_gather = ring * s * heads * f32                     # every shard's lse of every head
    latent = heads * value_dim * f32
    hidden_reduce = 2 * ring * hidden * f32
    if merge == "hidden_psum":
        return lse_gather + hidden_reduce
    padded_heads = -(-heads // s) * s
    if merge == "head_scatter":
        return lse_gather + ring * padded_heads * value_dim * f32 + hidden_reduce
    if merge == "head_exchange":                  # one all-to-all of the packed [o | lse]
        return ring * padded_heads * (value_dim + 1) * f32 + hidden_reduce
    packed = heads * (value_dim + 1) * f32
    moved = {"gather_psum": lse_gather + 2 * ring * latent,
             "all_to_all": 2 * ring * packed,             # all-to-all, then all-gather
             "all_gather": ring * s * packed}[merge]     # every shard's partials, everywhere
    return moved + (hidden_reduce if weights == "sharded" else 0)


def gathered_bytes(tokens: int, *, heads: int, value_dim: int, shards: int) -> int:
    """Bytes all_gather leaves on the S devices of this process together: each holds every
    shard's partials and lse, S x tokens x heads x (value_dim + 1) f32."""
    return shards * shards * tokens * heads * (value_dim + 1) * 4


def prefill_tokens(*, heads: int, value_dim: int, shards: int, budget_bytes: int) -> int:
    """The prefill chunk timed: the largest multiple of 8 up to PREFILL_TOKENS whose gathered
    partials fit `budget_bytes` (at least 8)."""
    per_token = gathered_bytes(1, heads=heads, value_dim=value_dim, shards=shards)
    return max(8, min(PREFILL_TOKENS, budget_bytes // per_token) // 8 * 8)


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("merge", "Every merge variant: bytes per token and its collectives timed "
                                 "in one run.",
                        quick="fewer timed calls", quick_values=QUICK)
    p.add_argument("--repeats", type=positive_int,
                   help="timed calls per variant and shape, the median reported")
    p.add_argument("--prefill-tokens", type=length, default=None,
                   help=f"tokens of the timed prefill chunk (unset: up to {PREFILL_TOKENS}, as "
                        "many as fit --gather-gib)")
    p.add_argument("--gather-gib", type=finite_positive_float, default=1.0,
                   help="GiB the prefill chunk's gathered partials may take, all devices "
                        "together (sets the chunk unless --prefill-tokens)")
    p.add_shared(model="glm-5.2", shards=16, out="out", progress=True)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with the devices for `--shards` set up, then
    `--out` created."""
    return build_parser().parse_args(argv)


def _time(fn, *args, repeats: int) -> float:
    """Median milliseconds of fn(*args) over `repeats` calls, after one warm-up."""
    fn(*args).block_until_ready()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        samples.append(time.perf_counter() - t0)
    return 1000 * statistics.median(samples)


def _combine_program(mesh, merge: str, weights: str, hidden: int):
    """jit(shard_map): partials o [S, T, H, Dv], lse [S, T, H] -> output [T, hidden]."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from cp_runtime.parallel.merge import combine
    from cp_runtime.weights.shards import WeightShards

    ws = WeightShards("cp" if weights == "sharded" else None)

    def project(o):                       # [T, H', Dv] -> [T, hidden], no weight (module doc)
        return jnp.broadcast_to(o.sum((-2, -1))[..., None], (*o.shape[:-2], hidden))

    def body(o, lse):
        return combine(merge, o[0], lse[0], project, "cp", ws, gathers="flat")

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("cp"), P("cp")), out_specs=P(),
                                 check_vma=False))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cp_runtime.config import load_model_config

    model = load_model_config(args.model)
    h, dv, hid = model.num_attention_heads, model.kv_lora_rank, model.hidden_size
    q = args.prefill_tokens or prefill_tokens(heads=h, value_dim=dv, shards=args.shards,
                                              budget_bytes=int(args.gather_gib * (1 << 30)))
    tokens = {f"decode B={DECODE_TOKENS}": DECODE_TOKENS, f"prefill chunk Q={q}": q}
    gathered = gathered_bytes(q, heads=h, value_dim=dv, shards=args.shards)
    sizing = (f"The prefill chunk's gathered partials (all_gather): {gathered / (1 << 30):.2f} "
              "GiB over the devices" + ("" if args.prefill_tokens else
                                        f", Q sized to fit {args.gather_gib:g} GiB") + ".")
    print(sizing)
    mesh = jax.make_mesh((args.shards,), ("cp",))
    programs = {v: _combine_program(mesh, *v, hid) for v in VARIANTS}
    rows = []
    for merge, weights in VARIANTS:
        rows.append({"merge": merge, "weights": weights,
                     "bytes_per_token": round(bytes_per_token(
                         merge, weights, heads=h, value_dim=dv, hidden=hid,
                         shards=args.shards))})
    for label, n in tokens.items():
        key = jax.random.key(0)
        o = jax.random.normal(key, (args.shards, n, h, dv), jnp.float32)
        lse = jax.random.normal(key, (args.shards, n, h), jnp.float32)
        o, lse = (jax.device_put(x, NamedSharding(mesh, P("cp"))) for x in (o, lse))
        # Interleave the variants within each repeat round, so drift hits all alike.
        samples = {v: [] for v in VARIANTS}
        for _ in range(3):
            for v in VARIANTS:
                samples[v].append(_time(programs[v], o, lse,
                                        repeats=max(args.repeats // 3, 1)))
        for row, v in zip(rows, VARIANTS):
            row[f"{label} ms"] = statistics.median(samples[v])
    smallest = min(rows, key=lambda r: r["bytes_per_token"])
    for row in rows:
        row["bytes vs smallest"] = row["bytes_per_token"] / smallest["bytes_per_token"]
    print_table(rows, ["merge", "weights", "bytes_per_token", "bytes vs smallest",
                       *(f"{label} ms" for label in tokens)],
                title=f"merge variants, {model.name} (H={h}, Dv={dv}, hidden={hid}), "
                      f"S={args.shards}, {machine()['backend']} ({machine()['cpu_count']} cores)")
    write_json(args.out / "merge.json",
               {"model": model.name, "shards": args.shards, "tokens": tokens,
                "gathered_bytes": gathered, "sizing": sizing, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
