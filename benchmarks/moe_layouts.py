"""One device's routed experts of a prefill half-chunk, with the experts split over S devices
in g groups (runtime field `expert_groups`): each group holds E / g whole experts, each of its
S / g devices a slice of their inner features. g = 1 is every device a slice of every expert,
so every device runs every (token, expert) pair; g = S splits by expert. The rows reach every
device as the runtime's do (all-gathered, fp8), so the collectives are the same in every
layout; what changes is each device's own work: its group's pairs are sorted out of all T k,
gathered, run through the expert kernel (kernels/expert_matmul.py) and summed back by token,
by the runtime's own functions (cp_runtime.model.expert_groups, moe.expert_rows).

    cp-runtime bench moe_layouts              # on a TPU: timed; elsewhere: the check only
    cp-runtime bench moe_layouts --tpu7x      # compiled for one TPU7x device and priced, with
                                              # a decode step's
    cp-runtime bench moe_layouts --quick      # the check at the smallest shapes

The check (interpret mode, small shapes): the S devices' sums, added, are the same in every
layout, to bf16 rounding (each device's partial sum leaves its kernel in bf16). Timed: device
0 (group 0) at the model's shapes, wall clock, best of 3 runs of 5 calls. Priced: device 0's
program compiled for TPU7x, its XLA cycles and kernels at their roofline (the runtime's
figures, cp_runtime.aot), and the hand model of what XLA:TPU leaves unpriced (the SparseCore
gathers: `with_unpriced_ms`).

A grouped device runs its pairs in passes of `--capacity-factor` times their even share
(T k / g; the runtime's is 1.25): the routing here is uniform, so one pass takes them, and a
pass more runs only for a group over that share (the timed table says how many ran).
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from cp_runtime.benchmarks._shared.bench_parser import BenchmarkParser
from cp_runtime.benchmarks._shared.results import print_table, write_json
from cp_runtime.cli.args import finite_positive_float, positive_int
from cp_runtime.kernels import expert_matmul, fp8_rows
from cp_runtime.kernels.fp8_rows import Fp8Rows
from cp_runtime.model.expert_groups import routed_in_group, rows_per_pass
from cp_runtime.model.moe import EXPERTS, expert_rows
from cp_runtime.weights.format import SCALE_SUFFIX

__all__ = ["build_parser", "parse_args", "main", "layouts", "routed_experts"]

BLOCK = 128                     # the fp8 checkpoints' scale block, both ways
QUICK = {"tokens": ("16384", "64")}


def build_parser() -> BenchmarkParser:
    p = BenchmarkParser("moe_layouts", "One device's routed experts of a prefill half-chunk "
                                       "with the experts split in groups: checked, timed on "
                                       "a TPU, priced for TPU7x.",
                        quick="the check only, at the smallest shapes", quick_values=QUICK,
                        check=_check)
    p.add_argument("--tokens", type=positive_int,
                   help="tokens of the half-chunk (every device sees all of them)")
    p.add_argument("--groups", default="1,4,16",
                   help="comma-separated group counts, each dividing --shards")
    p.add_argument("--capacity-factor", type=finite_positive_float, default=1.25,
                   help="a grouped device's rows a pass: this times its even share of the "
                        "pairs")
    p.add_argument("--decode-batch", type=positive_int, default=1,
                   help="tokens of the decode step --tpu7x prices beside the half-chunk")
    p.add_argument("--tpu7x", action="store_true",
                   help="compile device 0's program for one TPU7x device and price it (needs "
                        "the tpu extra)")
    p.add_shared(model="glm-5.2", shards=16, out="out", progress=True, devices=False)
    return p


def _check(parser: BenchmarkParser, args: argparse.Namespace) -> None:
    try:
        args.group_counts = [int(g) for g in args.groups.split(",")]
    except ValueError:
        parser.error(f"--groups {args.groups}: not a list of whole numbers")
    if any(g <= 0 or args.shards % g for g in args.group_counts):
        parser.error(f"--groups {args.groups}: each must divide --shards {args.shards}")
    if not 1 <= args.capacity_factor <= 16:
        parser.error(f"--capacity-factor {args.capacity_factor}: must be between 1 and 16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2) before `--out` is created."""
    return build_parser().parse_args(argv)


def layouts(experts: int, inner: int, shards: int, groups: list[int], pairs: int,
            factor: float) -> list[dict]:
    """Per group count g: a device's experts (E / g), inner features (inner g / S) and rows a
    pass (`expert_groups.rows_per_pass` at `factor`: all T k pairs where g = 1)."""
    out = []
    for g in groups:
        rows = rows_per_pass(pairs, g, factor)
        out.append(dict(groups=g, slices=shards // g, experts=experts // g,
                        inner=inner * g // shards, rows=rows))
    return out


def routed_experts(x8, x_scales, chosen, weights, gate, gate_s, up, up_s, down, down_s, *,
                   group: int, rows: int, interpret: bool = False):
    """A device's sum bf16[T, hidden] over the pairs of its group's experts, as the runtime's
    MoE runs a prefill's fp8 rows in expert groups: x8 f8[T, hidden] with x_scales f32[T, 1],
    chosen i32[T, k] (global expert ids), weights f32[T, k]; its stacks gate/up
    f8[E_g, hidden, inner_d], down f8[E_g, inner_d, hidden] with their block scales; the
    group's pairs sorted by expert, `rows` a pass (`expert_groups.routed_in_group`)."""
    p = {}
    for proj, w, s in (("gate", gate, gate_s), ("up", up, up_s), ("down", down, down_s)):
        p[EXPERTS.format(proj)], p[EXPERTS.format(proj) + SCALE_SUFFIX] = w, s
    matmul = functools.partial(expert_matmul.grouped_matmul, interpret=interpret)
    out = jnp.zeros(x8.shape, jnp.bfloat16)
    run = expert_rows(p, out, matmul, Fp8Rows(x8, x_scales))
    n = gate.shape[0]
    return routed_in_group(chosen, weights, group * n, n, run, out, capacity=rows)[0]


def _rows(rng, t: int, k: int, experts: int, hidden: int):
    """A half-chunk's MLP rows as the runtime gathers them (fp8_rows: fp8 values, an f32
    scale a row), each token's k distinct experts (uniform) and routing weights."""
    rows = fp8_rows.quantize(jnp.asarray(rng.standard_normal((t, hidden)), jnp.float32))
    chosen = np.argsort(rng.random((t, experts)), axis=1)[:, :k].astype(np.int32)
    return rows.values, rows.scales, chosen, rng.random((t, k)).astype(np.float32)


def _stacks(rng, experts: int, hidden: int, inner: int, block: int) -> list[np.ndarray]:
    def w(shape):
        return (rng.standard_normal(shape) * 0.5).astype(jnp.float8_e4m3fn)

    def s(shape):
        return (0.01 + 0.02 * rng.random((shape[0], shape[1] // block, shape[2] // block))
                ).astype(np.float32)

    gate, up, down = (w((experts, hidden, inner)), w((experts, hidden, inner)),
                      w((experts, inner, hidden)))
    return [gate, s(gate.shape), up, s(up.shape), down, s(down.shape)]


def _device_stacks(stacks: list[np.ndarray], layout: dict, device: int, block: int) -> list:
    """Device `device`'s part of whole stacks: its group's experts, its slice of their inner
    features (the gate and up's columns, the down's rows), with their scales."""
    group, part = divmod(device, layout["slices"])
    ex = slice(group * layout["experts"], (group + 1) * layout["experts"])
    f = slice(part * layout["inner"], (part + 1) * layout["inner"])
    fs = slice(f.start // block, f.stop // block)
    gate, gate_s, up, up_s, down, down_s = stacks
    return [jnp.asarray(a) for a in (gate[ex][:, :, f], gate_s[ex][:, :, fs], up[ex][:, :, f],
                                     up_s[ex][:, :, fs], down[ex][:, f], down_s[ex][:, fs])]


def check(args) -> dict:
    """Every device of every layout in interpret mode at small shapes: the S devices' sums,
    added in f32, against the first layout's."""
    rng = np.random.default_rng(1)
    t, k, experts, hidden, inner, block = args.tokens, 4, 2 * args.shards, 64, 16 * args.shards, 16
    x8, x_scales, chosen, weights = (jnp.asarray(a) for a in _rows(rng, t, k, experts, hidden))
    stacks = _stacks(rng, experts, hidden, inner, block)
    totals = {}
    for layout in layouts(experts, inner, args.shards, args.group_counts, t * k, 1e9):
        totals[layout["groups"]] = sum(
            np.asarray(routed_experts(x8, x_scales, chosen, weights,
                                      *_device_stacks(stacks, layout, d, block),
                                      group=d // layout["slices"], rows=t * k, interpret=True),
                       np.float32) for d in range(args.shards))
    first = totals[args.group_counts[0]]
    scale = float(np.abs(first).max())
    return {"shape": dict(tokens=t, k=k, experts=experts, hidden=hidden, inner=inner,
                          shards=args.shards),
            "max_abs_diff": {g: float(np.abs(v - first).max()) for g, v in totals.items()},
            "max_abs": scale}


def _model_shapes(args) -> tuple[int, int, int, int]:
    from cp_runtime.config import load_model_config

    cfg = load_model_config(args.model)
    return (cfg.num_experts_per_tok, cfg.n_routed_experts, cfg.hidden_size,
            cfg.moe_intermediate_size)


def _device_zero_args(rng, t, k, experts, hidden, layout):
    x8, x_scales, chosen, weights = _rows(rng, t, k, experts, hidden)
    stacks = _stacks(rng, layout["experts"], hidden, layout["inner"], BLOCK)
    return [jnp.asarray(a) for a in (x8, x_scales, chosen, weights, *stacks)], chosen


def timed(args) -> list[dict]:
    """Device 0 of each layout at the model's shapes, wall clock on this backend."""
    k, experts, hidden, inner = _model_shapes(args)
    t = args.tokens
    rng = np.random.default_rng(0)
    out = []
    for layout in layouts(experts, inner, args.shards, args.group_counts, t * k,
                          args.capacity_factor):
        operands, chosen = _device_zero_args(rng, t, k, experts, hidden, layout)
        f = jax.jit(functools.partial(routed_experts, group=0, rows=layout["rows"]))
        jax.block_until_ready(f(*operands))
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(5):
                result = f(*operands)
            jax.block_until_ready(result)
            best = min(best, (time.perf_counter() - t0) / 5)
        pairs = int((chosen // layout["experts"] == 0).sum())
        out.append(dict(layout, pairs=pairs, passes=math.ceil(pairs / layout["rows"]),
                        ms=1e3 * best))
    return out


def priced(args) -> list[dict]:
    """Device 0 of each layout compiled for one TPU7x device and priced: a prefill half-chunk
    of --tokens, and a decode step of --decode-batch tokens (whose k pairs a token may all
    land in one group: a grouped device's rows are all of them)."""
    from cp_runtime.aot.topology import compile_only_devices

    device = compile_only_devices("tpu7x-16")[0]
    k, experts, hidden, inner = _model_shapes(args)
    out = []
    for step, t in (("prefill", args.tokens), ("decode", args.decode_batch)):
        for layout in layouts(experts, inner, args.shards, args.group_counts, t * k,
                              args.capacity_factor):
            out.append(dict(step=step, tokens=t, **layout,
                            **_priced_program(device, t, k, hidden, layout)))
    return out


def _priced_program(device, t: int, k: int, hidden: int, layout: dict) -> dict:
    """`routed_experts` of device 0 at these shapes, compiled for `device` and priced as the
    runtime's figures price a step (cp_runtime.aot: phases' figures of the whole module, its
    XLA cycles and its kernels at their roofline, and the hand model of the work XLA:TPU
    leaves unpriced)."""
    from cp_runtime.aot import phases
    from cp_runtime.aot.roofline import TPU7X_DEVICE, compiler_clock_hz, phase_time

    clock = compiler_clock_hz(device)
    e, m = layout["experts"], layout["inner"]
    stacks = 2 * [((e, hidden, m), jnp.float8_e4m3fn),
                  ((e, hidden // BLOCK, m // BLOCK), jnp.float32)]
    specs = [((t, hidden), jnp.float8_e4m3fn), ((t, 1), jnp.float32), ((t, k), jnp.int32),
             ((t, k), jnp.float32), *stacks, ((e, m, hidden), jnp.float8_e4m3fn),
             ((e, m // BLOCK, hidden // BLOCK), jnp.float32)]
    f = functools.partial(routed_experts, group=0, rows=layout["rows"])
    with jax.default_device(device):
        text = jax.jit(f).lower(*(jax.ShapeDtypeStruct(*s) for s in specs)).compile().as_text()
    total = phases.PhaseFigures()
    for figures in phases.layer_figures(text, clock).values():
        total.add(figures)
    time_ = phase_time(total, TPU7X_DEVICE, clock)
    return dict(priced_ms=1e3 * (time_.xla_s + time_.kernel_s), kernels_ms=1e3 * time_.kernel_s,
                kernel_gb=total.kernel_bytes / 1e9, sparsecore_gb=total.sparsecore_bytes / 1e9,
                unpriced_tc_ms=1e3 * time_.unpriced_tc_s, waits_ms=1e3 * time_.unpriced_waits_s,
                with_unpriced_ms=1e3 * time_.with_unpriced_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    payload = {"model": args.model, "tokens": args.tokens, "shards": args.shards,
               "capacity_factor": args.capacity_factor}
    if args.quick or jax.default_backend() != "tpu":
        payload["check"] = check(args if args.quick else argparse.Namespace(
            **{**vars(args), "tokens": 64}))
        print(f"check ({payload['check']['shape']}): largest |sum - {args.group_counts[0]}"
              f" group(s)'s| {payload['check']['max_abs_diff']} of {payload['check']['max_abs']:.3g}")
    if jax.default_backend() == "tpu" and not args.quick:
        payload["timed"] = timed(args)
        print_table(payload["timed"], ["groups", "experts", "inner", "rows", "pairs", "passes",
                                       "ms"],
                    f"device 0, {args.model}, {args.tokens} tokens, "
                    f"{jax.devices()[0].device_kind}:")
    if args.tpu7x:
        payload["priced"] = priced(args)
        print_table(payload["priced"], ["step", "tokens", "groups", "experts", "inner", "rows",
                                        "priced_ms", "kernel_gb", "sparsecore_gb", "waits_ms",
                                        "with_unpriced_ms"],
                    f"device 0 of {args.shards}, {args.model}, compiled for TPU7x (ms):")
    write_json(f"{args.out}/moe_layouts.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
