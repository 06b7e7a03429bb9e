"""Kernel sheet: per Pallas kernel and cache dtype, its launch shape and cost next to its measured
agreement with the XLA reference.

    cp-runtime bench kernels                      # small shapes, interpret mode on CPU
    cp-runtime bench kernels --size full          # model-sized shapes (default on a TPU)
    cp-runtime bench kernels --quick              # small shapes on any backend
    cp-runtime bench kernels --kernels decode --kv-cache-dtypes fp8_e4m3 --out out/decode

Columns: grid, block shapes and VMEM footprint come from each kernel module's `cost()`, as do the
HBM bytes and flops of one call (upper bounds: every selected page distinct and visible). The
agreement columns run the kernel (TPU interpret mode, or --mode compiled) and its reference on
the same random inputs: max |kernel - reference| and rel-L2 over finite entries (the JSON adds,
for the cache write, the number of differing bytes, which must be 0). The ms column times one call
after compilation; in interpret mode it measures the CPU simulation, not the kernel.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.cli.args import comma_list
from cp_runtime.kernels import cache_write, indexer, reference, sparse_decode, sparse_prefill

__all__ = ["Shapes", "SIZES", "run", "build_parser", "parse_args", "main"]

CACHE_DTYPES = {
    "bf16": jnp.bfloat16,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
}
KERNELS = ("write", "indexer", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class Shapes:
    batch: int          # B sequences
    seq_pages: int      # pages per sequence (all full)
    page_size: int      # ps
    queries: int        # Q prefill queries per sequence (at its end)
    query_block: int    # prefill queries per grid step
    heads: int          # H attention heads
    dim: int            # D cached row width
    value_dim: int      # V
    selected: int       # N pages selected per query
    index_heads: int    # Hi
    index_dim: int      # Di
    key_block_pages: int
    num_shards: int     # the indexer runs as shard 0 of this many

    def __post_init__(self):
        if self.selected > self.seq_pages:
            raise ValueError(f"{self.selected=} must be at most {self.seq_pages=}")
        if self.queries > self.seq_pages * self.page_size:
            raise ValueError(f"{self.queries=} exceed the {self.seq_pages * self.page_size} "
                             "tokens of a sequence")


SIZES = {
    # Seconds per kernel in interpret mode on a laptop-class CPU.
    "small": Shapes(batch=2, seq_pages=8, page_size=16, queries=8, query_block=4, heads=4,
                    dim=256, value_dim=128, selected=4, index_heads=4, index_dim=128,
                    key_block_pages=2, num_shards=2),
    # DeepSeek-V3.2-like per-shard shapes: 512 + 64 latent padded to 640 lanes, 2048-token top-k.
    "full": Shapes(batch=4, seq_pages=512, page_size=64, queries=256, query_block=64, heads=16,
                   dim=640, value_dim=512, selected=32, index_heads=64, index_dim=128,
                   key_block_pages=8, num_shards=8),
}


@dataclasses.dataclass(frozen=True)
class Case:
    kernel: Callable      # the Pallas kernel (takes interpret=)
    ref: Callable         # its XLA reference
    cost: Callable        # the kernel module's cost()
    args: tuple
    statics: dict


def _pool(rng, s: Shapes, width: int, dtype):
    """T[B * seq_pages + 1, ps, width]: sequence b's page p at slot b * seq_pages + p."""
    pages = s.batch * s.seq_pages
    return jnp.asarray(rng.standard_normal((pages + 1, s.page_size, width)),
                       jnp.float32).astype(dtype)


def _selection(rng, s: Shapes, q_pos: np.ndarray):
    """i32[B, Q, N] slots and pages: each query's own page plus N - 1 earlier ones at random."""
    b, nq = q_pos.shape
    pages = np.zeros((b, nq, s.selected), np.int32)
    for i in range(b):
        for j in range(nq):
            own = q_pos[i, j] // s.page_size
            earlier = rng.permutation(own)[:s.selected - 1]
            chosen = np.concatenate([[own], earlier])
            pages[i, j, :len(chosen)] = chosen
            pages[i, j, len(chosen):] = own  # short lists repeat the own page (counted twice)
    slots = pages + s.seq_pages * np.arange(b, dtype=np.int32)[:, None, None]
    return jnp.asarray(slots), jnp.asarray(pages)


def _attention_case(rng, s: Shapes, dtype, nq: int, kernel, module) -> Case:
    tokens = s.seq_pages * s.page_size
    q_pos = np.broadcast_to(np.arange(tokens - nq, tokens, dtype=np.int32), (s.batch, nq))
    slots, pages = _selection(rng, s, q_pos)
    q = jnp.asarray(rng.standard_normal((s.batch, nq, s.heads, s.dim)), jnp.bfloat16)
    args = (q, _pool(rng, s, s.dim, dtype), slots, pages, jnp.asarray(q_pos))
    statics = dict(value_dim=s.value_dim, scale=s.dim ** -0.5, query_block=s.query_block)
    return Case(kernel, reference.sparse_attention, module.cost, args, statics)


def _indexer_case(rng, s: Shapes, dtype) -> Case:
    tokens = s.seq_pages * s.page_size
    q_pos = np.broadcast_to(np.arange(tokens - s.queries, tokens, dtype=np.int32),
                            (s.batch, s.queries))
    # Shard 0 owns logical pages 0, S, 2S, ...: slot of local page j is that logical page's slot.
    local = np.arange(0, s.seq_pages, s.num_shards, dtype=np.int32)
    local_pages = local[None] + s.seq_pages * np.arange(s.batch, dtype=np.int32)[:, None]
    q = jnp.asarray(rng.standard_normal((s.batch, s.queries, s.index_heads, s.index_dim)),
                    jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((s.batch, s.queries, s.index_heads)) / s.index_heads,
                    jnp.float32)
    args = (q, w, _pool(rng, s, s.index_dim, dtype), jnp.asarray(local_pages),
            jnp.asarray(q_pos), jnp.int32(0))
    statics = dict(num_shards=s.num_shards, key_block_pages=s.key_block_pages)
    return Case(indexer.indexer_page_scores, reference.indexer_page_scores, indexer.cost, args,
                statics)


def _write_case(rng, s: Shapes, dtype) -> Case:
    cache = _pool(rng, s, s.dim, dtype)
    rows = s.batch * s.queries
    flat = rng.permutation(s.batch * s.seq_pages * s.page_size)[:rows]
    new = jnp.asarray(rng.standard_normal((rows, s.dim)), jnp.bfloat16)
    args = (cache, new, jnp.asarray(flat // s.page_size, jnp.int32),
            jnp.asarray(flat % s.page_size, jnp.int32))
    return Case(cache_write.write_kv, reference.write_kv, cache_write.cost, args, {})


def make_case(name: str, rng, s: Shapes, dtype) -> Case:
    if name == "write":
        return _write_case(rng, s, dtype)
    if name == "indexer":
        return _indexer_case(rng, s, dtype)
    if name == "prefill":
        return _attention_case(rng, s, dtype, s.queries, sparse_prefill.sparse_prefill,
                               sparse_prefill)
    if name == "decode":
        return _attention_case(rng, s, dtype, 1, sparse_decode.sparse_decode, sparse_decode)
    raise ValueError(f"unknown kernel {name!r}; choices: {', '.join(KERNELS)}")


def _differing_bytes(out, ref) -> int:
    return int((np.asarray(out).view(np.uint8) != np.asarray(ref).view(np.uint8)).sum())


def _agreement(out, ref) -> dict:
    """max abs error and rel-L2 over the finite reference entries of all outputs."""
    num = den = max_abs = 0.0
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
        finite = np.isfinite(r)
        if (np.isfinite(o) != finite).any():  # a -inf (or NaN) where the reference has none
            return {"max_abs_err": float("inf"), "rel_l2": float("inf")}
        err = o[finite] - r[finite]
        max_abs = max(max_abs, float(np.abs(err).max(initial=0.0)))
        num += float((err ** 2).sum())
        den += float((r[finite] ** 2).sum())
    return {"max_abs_err": max_abs, "rel_l2": (num / den) ** 0.5 if den else 0.0}


def measure(name: str, dtype_name: str, s: Shapes, *, interpret: bool, seed: int) -> dict:
    case = make_case(name, np.random.default_rng(seed), s, CACHE_DTYPES[dtype_name])
    ref = jax.block_until_ready(case.ref(*case.args, **case.statics))
    jax.block_until_ready(case.kernel(*case.args, **case.statics, interpret=interpret))  # compile
    start = time.perf_counter()
    out = jax.block_until_ready(case.kernel(*case.args, **case.statics, interpret=interpret))
    seconds = time.perf_counter() - start
    cost = case.cost(*case.args, **case.statics)
    row = {"kernel": name, "cache_dtype": dtype_name, **cost, "call_ms": seconds * 1e3,
           **_agreement(out, ref)}
    if name == "write":
        row["differing_bytes"] = _differing_bytes(out, ref)
    return row


def machine() -> dict:
    return {"processor": platform.processor() or platform.machine(),
            "uname": " ".join(platform.uname()), "python": platform.python_version(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()[:1]] + [f"x{jax.device_count()}"]}


def _blocks(blocks: dict) -> str:
    return ", ".join(f"{k} {'x'.join(map(str, v))}" for k, v in blocks.items())


def print_table(rows: list[dict], mode: str) -> None:
    header = (f"{'kernel':<8} {'cache':<9} {'grid':<9} {'VMEM KiB':>9} {'HBM MB':>9} "
              f"{'MFLOP':>10} {'max|err|':>9} {'rel-L2':>9} {mode + ' ms':>14}  blocks")
    print(header)
    print("-" * len(header))
    for r in rows:
        grid = "x".join(map(str, r["grid"]))
        print(f"{r['kernel']:<8} {r['cache_dtype']:<9} {grid:<9} {r['vmem_bytes'] / 2**10:>9.1f} "
              f"{r['bytes'] / 1e6:>9.3f} {r['flops'] / 1e6:>10.2f} {r['max_abs_err']:>9.2e} "
              f"{r['rel_l2']:>9.2e} {r['call_ms']:>14.1f}  {_blocks(r['blocks'])}")


def run(kernels, dtypes, s: Shapes, *, interpret: bool, seed: int,
        progress: bool = True) -> list[dict]:
    todo = [(k, d) for k in kernels for d in dtypes]
    rows = []
    for i, (k, d) in enumerate(todo, 1):
        if progress:
            print(f"[{i}/{len(todo)}] {k} {d}", file=sys.stderr, flush=True)
        rows.append(measure(k, d, s, interpret=interpret, seed=seed))
    return rows


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("kernels", __doc__,
                        quick="small shapes on any backend (on a CPU, what runs anyway)",
                        check=_check)
    p.add_argument("--kernels", type=comma_list(str, choices=KERNELS), default=",".join(KERNELS),
                   metavar="K[,K...]", help=f"kernels to run, from: {', '.join(KERNELS)}")
    # The shared --kv-cache-dtypes flag, limited to the dtypes these kernels store.
    p.add_argument("--kv-cache-dtypes", type=comma_list(str, choices=list(CACHE_DTYPES)),
                   default=",".join(CACHE_DTYPES), metavar="D[,D...]",
                   help=f"cache dtypes, from: {', '.join(CACHE_DTYPES)}")
    p.add_argument("--size", choices=list(SIZES), default=None,
                   help="shape preset (unset: full on a TPU, small elsewhere and with --quick); "
                        + "; ".join(f"{k}: {v}" for k, v in SIZES.items()))
    p.add_argument("--mode", choices=("interpret", "compiled"), default=None,
                   help="run the kernels in TPU interpret mode or compiled (TPU only); "
                        "unset: compiled on a TPU, interpret elsewhere")
    # --no-progress: the [i/n] line per kernel on stderr
    p.add_shared(seed="the inputs", out="out", progress=True)
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    """`--mode` and `--size` resolved for this backend."""
    on_tpu = jax.default_backend() == "tpu"
    args.mode = args.mode or ("compiled" if on_tpu else "interpret")
    if args.mode == "compiled" and not on_tpu:
        parser.error(f"--mode compiled: needs a TPU backend; this one is "
                     f"{jax.default_backend()!r}")
    args.size = args.size or ("full" if on_tpu and not args.quick else "small")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with `--out` created and `--mode` resolved
    for this backend."""
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode, size = args.mode, args.size
    shapes = SIZES[size]
    info = machine()
    print(f"machine: {info['processor']} | {info['uname']}")
    print(f"jax {info['jax']} backend {info['backend']} ({', '.join(info['devices'])}); "
          f"{mode} mode, size {size}")
    rows = run(args.kernels, args.kv_cache_dtypes, shapes, interpret=mode == "interpret",
               seed=args.seed, progress=not args.no_progress)
    print_table(rows, mode)
    out = args.out / "kernels.json"
    out.write_text(json.dumps({"machine": info, "mode": mode, "size": size,
                               "shapes": dataclasses.asdict(shapes), "results": rows},
                              indent=2))
    print(f"wrote {out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
