"""All-gather-then-reduce over the `cp` axis: flat, in stages ("tree"), or through the
in-process gather on CPU.

Both cross-shard meetings of a decode step have this shape: every shard's candidate pages are
gathered and ranked (`selection.global_top_pages`), every shard's attention partials are
gathered and merged (`merge.merge_all_gather`). Flat, that is one all-gather over all S shards. In
stages, the shards gather in groups (S = 16: groups of 4), each group reduces what it gathered,
and the next stage gathers the groups' results (the 4 groups' merges): one collective per stage,
each with fewer participants. The reduction must be one that can be applied to partial results
again (top-K of top-Ks; a merge of merges).

Why stages pay on CPU: every shard is a device thread, and an in-process collective is two
barriers at which each participant sleeps and is woken. On a few cores each in-process
collective's cost grows faster than its participants (two barriers, every device thread woken
at each): two stages of 4 cost less than one of 16 (`cp-runtime bench collectives`). Across
processes (gloo) a collective's rounds grow with its participants too, and staging gains more
there. On TPU one collective over the interconnect is cheaper than two, so `gather_reduce`
stages only on CPU (docs/notes/2026-12-01-cpu-collectives.md, "Staged gathers").

Cheaper still when every shard is a device of one process: the native in-process gather
(kernels/native_gather.py) meets at one barrier instead of XLA's two and wakes the waiting
devices with one call (docs/notes/2026-12-01-cpu-collectives.md, "The in-process gather").
`auto` takes it on CPU for small parts where it can run (one process, the library built), and
stages larger parts (a prefill chunk's candidates) and across processes.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
from jax import lax

from cp_runtime.config import GATHER_MODES
from cp_runtime.kernels import native_gather

__all__ = ["TREE_MIN_SHARDS", "NATIVE_MAX_BYTES", "tree_stages", "stage_groups",
           "gather_reduce_flat", "gather_reduce_staged", "gather_reduce_native", "gather_reduce"]

# Fewest shards at which `gather_reduce` stages on CPU: below 8 one collective is already cheap.
TREE_MIN_SHARDS = 8

# Largest part per shard that `auto` gathers in process on CPU. Every device copies out all S
# parts, and beyond this that costs more than the wake-ups it saves: at S = 16 on the
# development machine (`bench collectives --values`), 0.12 ms in process against 0.27 staged
# at 8 KiB a shard, 0.51 against 0.36 at 16 KiB, 0.90 against 0.58 at 32 KiB (a prefill
# chunk's candidates). A decode step's parts are far below it (`small` at B = 8: 1 KiB).
NATIVE_MAX_BYTES = 8 << 10

Reduce = Callable[[jax.Array], jax.Array]   # f[G, *shape] gathered -> f[*shape]


def tree_stages(num_shards: int) -> tuple[int, ...]:
    """Group sizes of the stages (their product is S): S's largest divisor not above its square
    root, then S over it (16 -> (4, 4), 8 -> (2, 4)); (S,), one stage, when that divisor is 1."""
    small = max(d for d in range(1, math.isqrt(num_shards) + 1) if num_shards % d == 0)
    return (num_shards,) if small == 1 else (small, num_shards // small)


def stage_groups(sizes: tuple[int, ...]) -> list[list[list[int]]]:
    """Each stage's groups of shard indices: writing a shard's index in the mixed radix `sizes`
    (first digit lowest), stage i groups the shards that differ only in digit i. After every
    stage has reduced its groups, each shard holds the reduction over all shards."""
    groups_of_stages = []
    stride = 1
    for size in sizes:
        groups = [[base + j * stride for j in range(size)]
                  for base in range(math.prod(sizes)) if (base // stride) % size == 0]
        groups_of_stages.append(groups)
        stride *= size
    return groups_of_stages


def gather_reduce_flat(x: jax.Array, axis_name: str, reduce: Reduce) -> jax.Array:
    """reduce(all-gather of x over every shard): one collective."""
    return reduce(lax.all_gather(x, axis_name))


def gather_reduce_staged(x: jax.Array, axis_name: str, reduce: Reduce) -> jax.Array:
    """The same result in the stages of `tree_stages(S)`, reducing after each (for an exact
    `reduce`, the same value; for a floating-point merge, up to rounding)."""
    sizes = tree_stages(lax.axis_size(axis_name))
    if len(sizes) == 1:
        return gather_reduce_flat(x, axis_name, reduce)
    for groups in stage_groups(sizes):
        x = reduce(lax.all_gather(x, axis_name, axis_index_groups=groups))
    return x


def gather_reduce_native(x: jax.Array, axis_name: str, reduce: Reduce) -> jax.Array:
    """reduce(the in-process gather of x): one barrier, CPU only (native_gather.usable)."""
    return reduce(native_gather.all_gather(x, axis_name))


def _cpu_gather_reduce(x: jax.Array, axis_name: str, reduce: Reduce) -> jax.Array:
    """`auto` on CPU: in process if it can and x is at most NATIVE_MAX_BYTES, else staged from
    TREE_MIN_SHARDS shards, else flat."""
    if x.nbytes <= NATIVE_MAX_BYTES and native_gather.usable(axis_name):
        return gather_reduce_native(x, axis_name, reduce)
    if lax.axis_size(axis_name) >= TREE_MIN_SHARDS:
        return gather_reduce_staged(x, axis_name, reduce)
    return gather_reduce_flat(x, axis_name, reduce)


def gather_reduce(x: jax.Array, axis_name: str, reduce: Reduce, mode: str = "auto"
                  ) -> jax.Array:
    """x f[*shape] of this shard -> reduce over every shard's x, f[*shape], the same on each.

    mode (config.GATHER_MODES): flat; staged; native (the in-process gather on CPU, flat
    elsewhere; refused where it cannot run); auto: on CPU native where it can run and x is at
    most NATIVE_MAX_BYTES, else staged from TREE_MIN_SHARDS shards, else flat; flat elsewhere.
    The platform is chosen when the program is lowered."""
    if mode not in GATHER_MODES:
        raise ValueError(f"gather mode {mode!r} is not one of {GATHER_MODES}")
    if mode == "staged":
        return gather_reduce_staged(x, axis_name, reduce)
    if mode == "flat" or lax.axis_size(axis_name) == 1:
        return gather_reduce_flat(x, axis_name, reduce)
    if mode == "native":
        if not native_gather.usable(axis_name):
            raise ValueError(
                "gathers 'native' needs every shard in this process, a mesh of the "
                f"{axis_name!r} axis alone and the built library (status: "
                f"{native_gather.native_status()}, processes: {jax.process_count()})")
        cpu = gather_reduce_native
    else:
        cpu = _cpu_gather_reduce
    return lax.platform_dependent(
        x, cpu=lambda v: cpu(v, axis_name, reduce),
        default=lambda v: gather_reduce_flat(v, axis_name, reduce))
