"""How fast a host-held latent cache's pages reach HBM and go back (runtime field
`latent_memory = "host"`, cp_runtime.cache.host_pages), on the machine it runs on.

    cp-runtime bench host_pages                 # table, and out/host_pages.json
    cp-runtime bench host_pages --quick         # a smaller buffer, fewer shapes and calls

On the first device: a buffer of `--pages` pages in words (GLM-5.2's fp8 pages of 64 x 640 are
u32[16, 640], 40 KiB) in the device's pinned host memory where it has one (a TPU); on a CPU,
whose host memory is the device's own, in that memory, so each copy is a copy within RAM.
`read_pages` stages `--counts` random pages, `--groups` of them a loop step (the runtime's
`GROUP` among them), and `write_pages` writes as many back; each is timed as the median of
`--repeats` calls less the same program copying nothing (count 0), so what is left is the
copies. One contiguous slice of as many pages gives the link's rate without per-page copies.
The staged pages are checked against the buffer's (`--no-progress` is accepted for the
benchmarks' common flags; there is no progress to show).
"""

from __future__ import annotations

import argparse
import statistics
import time

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import machine, print_table, write_json
from cp_runtime.cli.args import positive_int, positive_int_list

__all__ = ["build_parser", "parse_args", "main"]

QUICK = {"pages": ("16384", "1024"), "counts": ("66,1056", "66"),
         "groups": ("1,4,8,16,32", "1,8"), "repeats": ("20", "3")}


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("host_pages", "Pages of a host-held latent cache staged into HBM and "
                                      "written back: GB/s by pages per loop step.",
                        quick="a smaller buffer, fewer shapes and calls", quick_values=QUICK,
                        check=_check)
    p.add_argument("--pages", type=positive_int, help="pages in the host buffer")
    p.add_argument("--counts", type=positive_int_list, metavar="N[,N...]",
                   help="pages staged per call (66: a GLM-5.2 decode step's share of a "
                        "device at B = 32 on 16 devices, a layer)")
    p.add_argument("--groups", type=positive_int_list, metavar="K[,K...]",
                   help="pages copied per loop step")
    p.add_argument("--page-rows", type=positive_int, default=16,
                   help="32-bit rows of a page's words (16: 64 fp8 rows)")
    p.add_argument("--page-lanes", type=positive_int, default=640,
                   help="lanes of a page (640: GLM-5.2's latent row)")
    p.add_argument("--repeats", type=positive_int, help="timed calls, the median reported")
    p.add_shared(out="out", progress=True)
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    if max(args.counts) >= args.pages:
        parser.error(f"--counts {max(args.counts)} must be fewer than --pages {args.pages} "
                     "(the last page is the sentinel)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), then `--out` created."""
    return build_parser().parse_args(argv)


def _median_s(fn, *args, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from cp_runtime.cache import host_pages

    mesh = Mesh(np.array(jax.devices()[:1]), ("cp",))
    on_device = NamedSharding(mesh, PartitionSpec())
    on_host = host_pages.host_sharding(on_device)
    shape = (args.pages, args.page_rows, args.page_lanes)
    page_bytes = args.page_rows * args.page_lanes * 4
    rng = np.random.default_rng(0)
    words = jax.device_put(rng.integers(0, 2**32, shape, dtype=np.uint32), on_host)
    rows = []
    for group in args.groups:
        read = jax.jit(lambda w, s, n, group=group: host_pages.read_pages(w, s, n, group)
                       .sum(dtype=jnp.uint32))
        write = jax.jit(lambda w, p, s, n, group=group: host_pages.write_pages(w, p, s, n, group),
                        donate_argnums=(0,), out_shardings=on_host)
        for count in args.counts:
            slots = rng.choice(args.pages - 1, count, replace=False).astype(np.int32)
            slots_d = jax.device_put(slots, on_device)
            staged = jax.jit(lambda w, s, group=group: host_pages.read_pages(
                w, s, jnp.int32(s.shape[0]), group))(words, slots_d)
            if not np.array_equal(np.asarray(staged[:count]), np.asarray(words)[slots]):
                raise RuntimeError(f"staged pages differ from the buffer's (group {group})")
            copy = _median_s(read, words, slots_d, jnp.int32(count), repeats=args.repeats)
            empty = _median_s(read, words, slots_d, jnp.int32(0), repeats=args.repeats)
            pages = jax.device_put(np.ones((count,) + shape[1:], np.uint32), on_device)
            words, back = _timed_writes(write, words, pages, slots_d, count, args.repeats)
            rows.append({"group": group, "pages": count, "read_ms": 1e3 * copy,
                         "empty_ms": 1e3 * empty,
                         "read_gb_s": _rate(count * page_bytes, copy - empty),
                         "write_gb_s": _rate(count * page_bytes, back)})
    contiguous = jax.jit(lambda w, n=max(args.counts): _to_device(
        jax.lax.dynamic_slice_in_dim(w, 1, n, 0)).sum(dtype=jnp.uint32))
    slice_s = _median_s(contiguous, words, repeats=args.repeats)
    where = words.sharding.memory_kind or "device"
    print_table(rows, ["group", "pages", "read_ms", "empty_ms", "read_gb_s", "write_gb_s"],
                title=f"{machine()['device_kind']}: pages of {page_bytes // 1024} KiB in "
                      f"{where} memory, {args.pages} of them ({args.pages * page_bytes / 1e9:.2f}"
                      f" GB)")
    print(f"one contiguous slice of {max(args.counts)} pages: "
          f"{max(args.counts) * page_bytes / slice_s / 1e9:.3g} GB/s")
    write_json(args.out / "host_pages.json",
               {"memory_kind": where, "page_bytes": page_bytes, "pages": args.pages,
                "rows": rows, "contiguous_gb_s": max(args.counts) * page_bytes / slice_s / 1e9})
    return 0


def _rate(nbytes: int, seconds: float) -> float | None:
    """GB/s, or None where the copies took no measurable time beside the empty program's
    (a noisy machine: the difference of two medians came out at or below zero)."""
    return nbytes / seconds / 1e9 if seconds > 0 else None


def _to_device(x):
    """x in device memory, from the host's where it is there (inside a jitted program)."""
    import jax
    if jax.typeof(x).memory_space == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def _timed_writes(write, words, pages, slots, count: int, repeats: int):
    """Median seconds of writing `count` pages back, less a write of none; the buffer (donated
    by each call) and those seconds."""
    import jax
    import jax.numpy as jnp
    samples = {count: [], 0: []}
    for n in (count, 0):
        words = write(words, pages, slots, jnp.int32(n))            # compile, warm
        for _ in range(repeats):
            t0 = time.perf_counter()
            words = write(words, pages, slots, jnp.int32(n))
            jax.block_until_ready(words)
            samples[n].append(time.perf_counter() - t0)
    return words, statistics.median(samples[count]) - statistics.median(samples[0])
