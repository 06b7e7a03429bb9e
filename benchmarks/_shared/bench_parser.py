"""The argument base every benchmark's command line builds on, so that the flags they share
are added, defaulted under `--quick` and checked the same way everywhere (the flags themselves
are defined once, in cp_runtime.cli.args):

    p = BenchmarkParser("decode", "Decode step vs context ...", quick="fewer rounds",
                        quick_values=QUICK, check=_check)
    p.add_argument("--rounds", type=positive_int, help="interleaved rounds")   # in QUICK
    p.add_shared(model="small", shards=16, page_size=64, out="out", progress=True,
                 why={"page_size": TPU_PAGES})
    args = p.parse_args(argv)

A QUICK table maps a flag's dest to (its default, its --quick value[, why that value]), both
as typed on a command line: such a flag defaults to None and its help names both values; an
explicit flag wins over both. `parse_args` fills them in, checks what the shared flags imply,
runs the benchmark's own `check`, and only then sets up devices and creates `--out`, so a bad
flag is a usage error (exit 2) before any work or any directory.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from cp_runtime.cli.args import (HelpFormatter, add_backend, add_checkpoint, add_chunk_size,
                                 add_gathers, add_kv_cache_dtype, add_kv_cache_dtypes, add_model,
                                 add_no_progress, add_out, add_page_size, add_pages_per_shard,
                                 add_shard_counts, add_shards, add_weight_dtype, add_weights,
                                 check_out_dir, check_page_size, check_page_size_for_model)
from cp_runtime.parallel.devices import init_cpu_devices

__all__ = ["BY_QUICK", "BenchmarkParser", "TPU_PAGES", "apply_quick", "init_shard_devices",
           "quick_help"]

# A shared flag's value in add_shared for a flag whose default the QUICK table gives.
BY_QUICK = object()
# The reason for the 64-token pages several benchmarks default to.
TPU_PAGES = "64-token pages, as the TPU deployment configs use"


def init_shard_devices(parser: argparse.ArgumentParser, shards: int) -> None:
    """init_cpu_devices(shards) for a benchmark's `--shards`; too few devices is a usage error
    (parser.error exits 2) rather than a traceback."""
    try:
        init_cpu_devices(shards)
    except ValueError as e:
        parser.error(f"--shards {shards}: {e}")


def quick_help(values: dict[str, tuple[str, ...]], dest: str) -> str:
    """The help's note on a flag that `--quick` changes: 'unset: 8k,128k; --quick: 8k'."""
    default, quick, *why = values[dest]
    return f"unset: {default}; --quick: {quick}" + "".join(f"; {w}" for w in why)


def apply_quick(parser: argparse.ArgumentParser, args: argparse.Namespace,
                values: dict[str, tuple[str, ...]]) -> None:
    """Fill each flag of `values` (dest -> (default, --quick value), as typed on a command
    line) that was left unset: its --quick value under `--quick`, else its default, parsed by
    the flag's own type. An explicit flag wins over both."""
    actions = {a.dest: a for a in parser._actions}
    for dest, (default, quick, *_) in values.items():
        if getattr(args, dest) is None:
            kind = actions[dest].type or str
            setattr(args, dest, kind(quick if args.quick else default))


def _switch(add: Callable) -> Callable:
    """A flag with no default to choose (`name=True` adds it) as a (parser, on, why) adder."""
    return lambda p, on, why: add(p) if on else None


def _add_seed(p: argparse.ArgumentParser, what: str, why: str | None) -> None:
    p.add_argument("--seed", type=int, default=0, help=f"seed of {what}")


# The shared flags add_shared knows, in the order help lists them: name -> (parser, value, why).
SHARED_FLAGS: dict[str, Callable] = {
    "model": add_model,
    "checkpoint": _switch(add_checkpoint),
    "shards": add_shards,
    "shard_counts": add_shard_counts,
    "kv_cache_dtype": add_kv_cache_dtype,
    "kv_cache_dtypes": lambda p, default, why: add_kv_cache_dtypes(p, default),
    "weight_dtype": _switch(add_weight_dtype),
    "weights": _switch(add_weights),
    "page_size": add_page_size,
    "pages_per_shard": add_pages_per_shard,
    "chunk_size": add_chunk_size,
    "backend": add_backend,
    "gathers": _switch(add_gathers),
    "seed": _add_seed,
    "out": add_out,
    "progress": _switch(add_no_progress),
}


class BenchmarkParser(argparse.ArgumentParser):
    """`cp-runtime bench NAME`'s parser: `--quick` with its help, the QUICK table's flags
    defaulted by it, the shared flags added by add_shared and checked by parse_args. `check`
    (parser, args) holds the benchmark's own checks; `prog` replaces the command's name."""

    def __init__(self, name: str, description: str, quick: str, *,
                 quick_values: dict[str, tuple[str, ...]] | None = None,
                 check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
                 prog: str | None = None):
        self.quick_values = quick_values or {}       # read by add_argument, -h's included
        self.check = check
        self.shared: set[str] = set()
        self.devices = self.whole_chunks = False
        super().__init__(prog=prog or f"cp-runtime bench {name}", description=description,
                         formatter_class=HelpFormatter)
        self.add_argument("--quick", action="store_true", help=quick)

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        """argparse's, and a flag of the QUICK table defaults to None, its help naming both
        of its values."""
        action = super().add_argument(*args, **kwargs)
        if action.dest in self.quick_values:
            action.default = None
            action.help = f"{action.help} ({quick_help(self.quick_values, action.dest)})"
        elif action.default is BY_QUICK:
            raise ValueError(f"{action.dest}: BY_QUICK, and not in the QUICK table")
        return action

    def add_shared(self, *, why: dict[str, str] | None = None, devices: bool = True,
                   whole_chunks: bool = False, **flags) -> None:
        """Add the shared flags named (SHARED_FLAGS' keys), each given its default (BY_QUICK:
        the QUICK table's) or True for a flag without one; `seed` names what it seeds. `why`
        says why a default differs from the common one. devices: `--shards` virtual devices
        are set up here (False: they are a server's); whole_chunks: `--chunk-size` must be a
        multiple of `--page-size`."""
        unknown = flags.keys() - SHARED_FLAGS.keys()
        if unknown:
            raise TypeError(f"not a shared flag: {', '.join(sorted(unknown))}")
        for name, add in SHARED_FLAGS.items():
            if name in flags:
                add(self, flags[name], (why or {}).get(name))
                self.shared.add(name)
        self.devices, self.whole_chunks = devices, whole_chunks

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        """The flags, `--quick` applied and checked (usage errors exit 2): the shared flags,
        then the benchmark's own check; then the devices for the most `--shards` are set up
        and `--out` is created."""
        parsed = super().parse_args(args, namespace)
        apply_quick(self, parsed, self.quick_values)
        self._check_shared(parsed)
        if self.check is not None:
            self.check(self, parsed)
        self._set_up(parsed)
        return parsed

    def _check_shared(self, args: argparse.Namespace) -> None:
        """A page holds a multiple of 16 tokens and (without --checkpoint, whose config
        replaces --model) a whole share of --model's selection; a chunk whole pages."""
        if "page_size" not in self.shared:
            return
        check_page_size(self, args.page_size)
        if "model" in self.shared and not getattr(args, "checkpoint", None):
            check_page_size_for_model(self, args.model, args.page_size)
        if self.whole_chunks and args.chunk_size % args.page_size:
            self.error(f"--chunk-size {args.chunk_size}: not a multiple of --page-size "
                       f"{args.page_size}")

    def _set_up(self, args: argparse.Namespace) -> None:
        """The side effects, once every flag is checked: devices, then `--out` (made a Path)."""
        shards = getattr(args, "shards", None)
        if self.devices and shards is not None:
            init_shard_devices(self, max(shards) if isinstance(shards, list) else shards)
        if "out" in self.shared:
            args.out = check_out_dir(self, args.out)          # a Path, or None for no output
