"""A model of GLM-5.2 on a tpu7x-16 slice: 1M-token prefill time and decode ms/step at 128K and
1M context, batch 1 and 32. Pure arithmetic over shapes (no JAX device work, nothing measured).

    cp-runtime bench tpu_model                    # prints the tables (docs/performance.md)
    cp-runtime bench tpu_model --out out/         # and writes out/tpu_model.json

Slice: 16 JAX devices = 8 TPU7x (Ironwood) chips x 2 TensorCores, on 2 hosts. Per chip (Cloud
TPU's TPU7x page): 2307 TFLOP/s bf16, 4614 TFLOP/s fp8, 192 GiB HBM, 2 TensorCores; HBM 7.37
TB/s and ICI 1.2 TB/s bidirectional (Google's Ironwood announcement). A device gets half of each.

Per step and per device, each term is a kernel or a collective:

    term                        HBM bytes                     flops                 ICI bytes
    weights + projections       projection_work / S           projection_work / S   -
    indexer scores              F x indexer.cost              F x indexer.cost      -
    selected-page attention     L x sparse_{decode,prefill}.cost                    -
    cache writes                L x cache_write.cost (latent) + F x (indexer keys)  -
    top-k all-gather            -                             -                     F x (S-1) R K 8
    q heads all-gather          -                             -                     L x q rows, F x idx q
    attention merge             -                             -                     L x head_scatter
    weight-shard all-reduce     -                             -                     2L x 2(S-1)/S R hid 2
    collective latency          (number of collectives on the critical path) x latency

(L layers, F full-indexer layers, S = 16 devices, R = query rows in the step, K = top-K pages.)

    term time  = max(HBM bytes / HBM rate, flops / MXU rate, ICI bytes / ICI rate)
    step time  = sum of term times;   prefill = sum over its chunk steps

Max within a term: each kernel streams pages through a double-buffered DMA ring, so its HBM
traffic and MXU work overlap. Sum across terms: the terms of a layer depend on each other (scores
-> top-K -> attention -> merge -> projections) and layers run in order, so nothing overlaps them.
The sum is therefore an upper bound for perfect kernels and a lower bound for real ones (no
kernel reaches its peak rate; elementwise work - norms, RoPE, softmax, top-K - is not counted).

Assumptions (each a flag or a constant below):
  * Weights are split evenly over the 16 devices as the runtime splits them with weights =
    "sharded" (cp_runtime/weights/layout.py; GLM-5.2's ~743 B parameters cannot be replicated
    on 96 GiB devices). Even split = no expert load imbalance (optimistic at batch 1, where 8
    experts per layer are active). The small feature-split gathers (q_a, kv_a, indexer k and
    weights, router logits) are not counted.
  * Weights fp8 (--weight-dtype), so projection matmuls run at the fp8 rate; the indexer (bf16
    keys) and attention (fp8 pages upcast to bf16 queries in VMEM) run at the bf16 rate.
  * The KV cache is sharded by page round-robin, so a query's selected pages and a sequence's
    context spread evenly: each device owns ceil((K + 1) / S) of a query's K + 1 pages and
    ceil(pages / S) of its context.
  * Kernel costs are their `cost()` upper bounds, except prefill attention: `sparse_prefill.cost`
    assumes a query block's union of pages is qb * N (no two queries share a page); its page
    reads and flops scale linearly with the union U, so they are scaled to
    U = min(--prefill-union x N, qb x N, local pages). The upper bound is printed as its own row.
  * Collectives: ring algorithms at --ici-fraction of one device's one-way ICI share (1.2 TB/s
    bidirectional per chip / 2 directions / 2 TensorCores = 300 GB/s), plus --collective-us per
    collective (an assumed latency, not a published figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from cp_runtime.benchmarks.args import BenchmarkParser
from cp_runtime.benchmarks.common import print_table
from cp_runtime.benchmarks.throughput import matmul_weights, projection_work
from cp_runtime.cache.capacity import bytes_per_token
from cp_runtime.cli.args import (finite_nonnegative_float, finite_positive_float, length_list,
                                 positive_int, positive_int_list)
from cp_runtime.config import ModelConfig, RuntimeConfig, load_model_config
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype
from cp_runtime.kernels import cache_write, indexer, sparse_decode, sparse_prefill
from cp_runtime.kernels.storage import cdiv

__all__ = ["Hardware", "Term", "Setup", "tpu7x_16", "decode_terms", "prefill_terms",
           "chunk_terms", "hbm_use", "scenarios", "build_parser", "main"]

GB, TFLOP = 1e9, 1e12
QUICK = {"compiler_layers": ("4", "1")}

# Per-chip figures. Cloud TPU docs, "TPU7x (Ironwood)" (docs.cloud.google.com/tpu/docs/tpu7x):
# peak bf16 2307 and fp8 4614 TFLOP/s, 192 GiB HBM, 2 TensorCores per chip. HBM bandwidth and
# ICI: Google's Ironwood announcement (7.37 TB/s; 1.2 TB/s bidirectional ICI).
TPU7X_CHIP = {"bf16_flops": 2307 * TFLOP, "fp8_flops": 4614 * TFLOP, "hbm_bytes": 192 * 2**30,
              "hbm_bytes_per_s": 7.37e12, "ici_bidir_bytes_per_s": 1.2e12, "cores": 2}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Rates of ONE device (a TensorCore, what JAX calls a device), in bytes/s and flop/s."""

    name: str
    devices: int
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float
    hbm_bytes: float
    ici_bytes_per_s: float          # one direction, what a ring collective sends at
    collective_latency_s: float

    def peak(self, precision: str) -> float:
        return {"bf16": self.bf16_flops, "fp8": self.fp8_flops}[precision]


def tpu7x_16(*, ici_fraction: float = 1.0, collective_us: float = 10.0) -> Hardware:
    """tpu7x-16: 8 chips, 16 devices. A device gets half a chip's HBM, MXU and ICI."""
    c = TPU7X_CHIP
    per = 1 / c["cores"]
    return Hardware("tpu7x-16", devices=8 * c["cores"], hbm_bytes_per_s=c["hbm_bytes_per_s"] * per,
                    bf16_flops=c["bf16_flops"] * per, fp8_flops=c["fp8_flops"] * per,
                    hbm_bytes=c["hbm_bytes"] * per,
                    # bidirectional / 2 directions, then half per TensorCore
                    ici_bytes_per_s=c["ici_bidir_bytes_per_s"] / 2 * per * ici_fraction,
                    collective_latency_s=collective_us * 1e-6)


@dataclasses.dataclass(frozen=True)
class Term:
    """One kernel or collective of a step, per device: HBM bytes, flops, ICI bytes sent."""

    name: str
    hbm_bytes: float = 0.0
    flops: float = 0.0
    precision: str = "bf16"         # which MXU rate the flops run at
    ici_bytes: float = 0.0
    collectives: int = 0            # each pays the hardware's collective latency

    def __add__(self, other: "Term") -> "Term":
        return dataclasses.replace(self, hbm_bytes=self.hbm_bytes + other.hbm_bytes,
                                   flops=self.flops + other.flops,
                                   ici_bytes=self.ici_bytes + other.ici_bytes,
                                   collectives=self.collectives + other.collectives)

    def parts(self, hw: Hardware) -> dict[str, float]:
        """Seconds each resource needs for this term."""
        return {"HBM": self.hbm_bytes / hw.hbm_bytes_per_s,
                "MXU": self.flops / hw.peak(self.precision),
                "ICI": self.ici_bytes / hw.ici_bytes_per_s,
                "latency": self.collectives * hw.collective_latency_s}

    def seconds(self, hw: Hardware) -> float:
        """max of the overlapping resources (HBM, MXU, ICI) plus the latency, which doesn't."""
        p = self.parts(hw)
        return max(p["HBM"], p["MXU"], p["ICI"]) + p["latency"]

    def bound(self, hw: Hardware) -> str:
        p = self.parts(hw)
        return max(p, key=p.get) if any(p.values()) else "-"


@dataclasses.dataclass(frozen=True)
class Setup:
    """The runtime choices the model is evaluated at."""

    kv_cache_dtype: str = "fp8_e4m3"
    page_size: int = 16
    chunk_size: int = 8192
    weight_bytes: int = 1                      # fp8 weights
    key_block_pages: int = RuntimeConfig.key_block_pages
    query_block: int = RuntimeConfig.query_block
    prefill_union: float = 2.0                 # a query block's union of pages, in units of N
    act_bytes: int = 2                         # bf16 activations on the wire and as queries

    @property
    def weight_precision(self) -> str:
        return "fp8" if self.weight_bytes == 1 else "bf16"


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), dtype)


def _kernel_term(name: str, cost: dict, calls: int) -> Term:
    return Term(name, hbm_bytes=calls * cost["bytes"], flops=calls * cost["flops"])


def _projections(model: ModelConfig, hw: Hardware, setup: Setup, tokens: int,
                 logit_rows: int) -> Term:
    """Weights read and matmuls of one step, split evenly over the devices (see module doc)."""
    w = projection_work(model, tokens, logit_rows=logit_rows, param_bytes=setup.weight_bytes,
                        replicas=1).scaled(1 / hw.devices)
    return Term("weights + projections", hbm_bytes=w.bytes, flops=w.flops,
                precision=setup.weight_precision)


def _indexer(model: ModelConfig, hw: Hardware, setup: Setup, batch: int, queries: int,
             local_pages: int) -> Term:
    """F calls of the indexer kernel over one device's `local_pages` pages per sequence."""
    ps, di, hi = setup.page_size, model.index_head_dim, model.index_n_heads
    cost = indexer.cost(_spec((batch, queries, hi, di), jnp.bfloat16),
                        _spec((batch, queries, hi), jnp.float32),
                        _spec((batch * local_pages + 1, ps, di),
                              indexer_cache_dtype(setup.kv_cache_dtype)),
                        _spec((batch, local_pages), jnp.int32),
                        _spec((batch, queries), jnp.int32),
                        num_shards=hw.devices, key_block_pages=setup.key_block_pages)
    return _kernel_term("indexer scores", cost, model.num_full_layers)


def _attention_args(model: ModelConfig, setup: Setup, batch: int, queries: int,
                    local_pages: int, n: int) -> tuple:
    ps, d = setup.page_size, model.latent_dim
    return (_spec((batch, queries, model.num_attention_heads, d), jnp.bfloat16),
            _spec((batch * local_pages + 1, ps, d), latent_cache_dtype(setup.kv_cache_dtype)),
            _spec((batch, queries, n), jnp.int32), _spec((batch, queries, n), jnp.int32),
            _spec((batch, queries), jnp.int32))


def _owned(model: ModelConfig, hw: Hardware, setup: Setup, pages: int) -> int:
    """Entries of one query's list (own page + top-K) that one device owns."""
    return cdiv(min(model.index_topk // setup.page_size, pages) + 1, hw.devices)


def _decode_attention(model, hw, setup, batch: int, local_pages: int, pages: int) -> Term:
    n = _owned(model, hw, setup, pages)
    cost = sparse_decode.cost(*_attention_args(model, setup, batch, 1, local_pages, n),
                              value_dim=model.kv_lora_rank)
    return _kernel_term("selected-page attention", cost, model.num_hidden_layers)


def _prefill_attention(model, hw, setup, queries: int, local_pages: int, pages: int, *,
                       union: float | None) -> Term:
    """sparse_prefill.cost counts U = qb * N pages per query block; its page reads and flops are
    linear in U (cost at N minus cost at 0), so they are scaled to the assumed union
    U = min(union * N, qb * N, local_pages). union=None keeps the kernel's upper bound."""
    n = _owned(model, hw, setup, pages)
    qb = min(setup.query_block, queries)

    def cost(entries: int) -> dict:
        return sparse_prefill.cost(*_attention_args(model, setup, 1, queries, local_pages,
                                                    entries),
                                   value_dim=model.kv_lora_rank, query_block=setup.query_block)

    full, fixed = cost(n), cost(0)
    u_max = qb * n
    u = u_max if union is None else min(union * n, u_max, local_pages)
    scale = u / u_max
    scaled = {k: fixed[k] + (full[k] - fixed[k]) * scale for k in ("bytes", "flops")}
    return _kernel_term("selected-page attention", scaled, model.num_hidden_layers)


def _cache_writes(model, hw, setup, rows: int) -> Term:
    """Each new row is written once, by the device owning its page: rows / S per device."""
    ps, per_device = setup.page_size, cdiv(rows, hw.devices)
    latent = cache_write.cost(_spec((2, ps, model.latent_dim),
                                    latent_cache_dtype(setup.kv_cache_dtype)),
                              _spec((per_device, model.latent_dim), jnp.bfloat16))
    keys = cache_write.cost(_spec((2, ps, model.index_head_dim),
                                  indexer_cache_dtype(setup.kv_cache_dtype)),
                            _spec((per_device, model.index_head_dim), jnp.bfloat16))
    return (_kernel_term("cache writes", latent, model.num_hidden_layers)
            + _kernel_term("cache writes", keys, model.num_full_layers))


def _collectives(model: ModelConfig, hw: Hardware, setup: Setup, rows: int,
                 pages: int) -> list[Term]:
    """Bytes each device sends per step (ring algorithms: an all-gather sends (S-1) shards, an
    all-reduce 2 (S-1)/S of the array), and how many collectives wait on each other.

    top-k all-gather  per full layer: scores f32 + pages i32 [R, K] of every shard
                      (selection.global_top_pages)
    q heads           per layer: all-gather of the query rows f32[R, H, D_lat] (each device
                      projects its own heads, every device attends with all of them); per
                      full layer also the indexer's q f32[R, Hi, Di]
    attention merge   per layer: all-gather lse f32[R, H], reduce-scatter o f32[R, H, kv_lora]
                      over heads (merge.merge_to_own_heads: `head_scatter`, the runtime's
                      default with split weights)
    weight shards     per layer: all-reduce of the attention and the MLP outputs, bf16[R, hid]
    """
    s, h = hw.devices, model.num_attention_heads
    k = min(model.index_topk // setup.page_size, pages)
    ring = 2 * (s - 1) / s
    topk = Term("top-k all-gather", ici_bytes=model.num_full_layers * (s - 1) * rows * k * 8,
                collectives=2 * model.num_full_layers)
    one_way = (s - 1) / s
    heads = Term("q heads all-gather", ici_bytes=one_way * rows * 4 * (
        model.num_hidden_layers * h * model.latent_dim
        + model.num_full_layers * model.index_n_heads * model.index_head_dim),
        collectives=model.num_hidden_layers + model.num_full_layers)
    merge = Term("attention merge", ici_bytes=model.num_hidden_layers * (
        (s - 1) * rows * h * 4 + one_way * rows * h * model.kv_lora_rank * 4),
        collectives=2 * model.num_hidden_layers)
    shards = Term("weight-shard all-reduce", ici_bytes=model.num_hidden_layers * 2 * ring * rows
                  * model.hidden_size * setup.act_bytes,
                  collectives=2 * model.num_hidden_layers)
    return [topk, heads, merge, shards]


def _split_latency(terms: list[Term]) -> list[Term]:
    """Move every term's collective count into one 'collective latency' row, so each ICI row
    shows its bandwidth time and the (assumed) latency stays visible on its own."""
    count = sum(t.collectives for t in terms)
    return ([dataclasses.replace(t, collectives=0) for t in terms]
            + [Term("collective latency", collectives=count)])


def decode_terms(model: ModelConfig, hw: Hardware, setup: Setup, *, context: int,
                 batch: int) -> list[Term]:
    """One decode step: `batch` sequences of `context` cached tokens each add one token."""
    pages = cdiv(context + 1, setup.page_size)
    local = cdiv(pages, hw.devices)
    return _split_latency([
        _projections(model, hw, setup, batch, batch),
        _indexer(model, hw, setup, batch, 1, local),
        _decode_attention(model, hw, setup, batch, local, pages),
        _cache_writes(model, hw, setup, batch),
        *_collectives(model, hw, setup, batch, pages)])


def prefill_terms(model: ModelConfig, hw: Hardware, setup: Setup, *, length: int,
                  union: float | None = -1.0) -> list[Term]:
    """A chunked prefill of one `length`-token sequence, summed over its chunk steps. Each step
    sees the pages up to its last token (an upper bound for its earlier queries: < chunk /
    length extra). union=-1 takes setup.prefill_union; None the kernel's upper bound."""
    union = setup.prefill_union if union == -1.0 else union
    totals: dict[str, Term] = {}
    for start in range(0, length, setup.chunk_size):
        end = min(start + setup.chunk_size, length)
        for t in chunk_terms(model, hw, setup, start=start, end=end, union=union):
            totals[t.name] = totals[t.name] + t if t.name in totals else t
    return _split_latency(list(totals.values()))


def chunk_terms(model: ModelConfig, hw: Hardware, setup: Setup, *, start: int, end: int,
                union: float | None) -> list[Term]:
    """One prefill chunk step: queries start..end of one sequence, its lm head on one row."""
    q, pages = end - start, cdiv(end, setup.page_size)
    local = cdiv(pages, hw.devices)
    return [_projections(model, hw, setup, q, 1), _indexer(model, hw, setup, 1, q, local),
            _prefill_attention(model, hw, setup, q, local, pages, union=union),
            _cache_writes(model, hw, setup, q), *_collectives(model, hw, setup, q, pages)]


def hbm_use(model: ModelConfig, hw: Hardware, setup: Setup, *, tokens: int) -> float:
    """Bytes per device: the weight share (all experts, embedding and lm_head) plus the cache of
    `tokens` cached tokens in all (cp_runtime.cache.capacity's bytes per token)."""
    weights = (matmul_weights(model, experts=model.n_routed_experts)
               + 2 * model.vocab_size * model.hidden_size) * setup.weight_bytes
    return (weights + tokens * bytes_per_token(model, setup.kv_cache_dtype)) / hw.devices


def scenarios(prefill_lengths: list[int], contexts: list[int], batches: list[int]) -> list[dict]:
    """The (kind, length, batch, union) cases of the report, prefill first."""
    out = [{"kind": "prefill", "length": n, "batch": 1, "union": -1.0} for n in prefill_lengths]
    out.append({"kind": "prefill", "length": max(prefill_lengths), "batch": 1, "union": None})
    out += [{"kind": "decode", "length": c, "batch": b, "union": None}
            for c in contexts for b in batches]
    return out


def _label(case: dict) -> str:
    n = case["length"]
    size = f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"
    if case["kind"] == "prefill":
        return f"prefill {size}" + (" (union upper bound)" if case["union"] is None else "")
    return f"decode {size} B={case['batch']}"


def evaluate(model: ModelConfig, hw: Hardware, setup: Setup, case: dict) -> dict:
    """Terms, time and HBM use of one case."""
    if case["kind"] == "prefill":
        terms = prefill_terms(model, hw, setup, length=case["length"], union=case["union"])
        tokens = case["length"]
    else:
        terms = decode_terms(model, hw, setup, context=case["length"], batch=case["batch"])
        tokens = (case["length"] + 1) * case["batch"]
    seconds = sum(t.seconds(hw) for t in terms)
    use = hbm_use(model, hw, setup, tokens=tokens)
    worst = max(terms, key=lambda t: t.seconds(hw))
    rate = (case["length"] if case["kind"] == "prefill" else case["batch"]) / seconds
    return {
        "case": _label(case), **case, "seconds": seconds, "tokens_per_s": rate,
        "largest_term": worst.name, "hbm_gb_per_device": use / GB,
        "fits": use <= hw.hbm_bytes,
        "terms": [{"term": t.name, "hbm_gb": t.hbm_bytes / GB, "tflop": t.flops / TFLOP,
                   "ici_gb": t.ici_bytes / GB, "collectives": t.collectives,
                   "ms": t.seconds(hw) * 1e3, "bound": t.bound(hw)} for t in terms],
    }


# -- command line ---------------------------------------------------------------------------
def build_parser() -> BenchmarkParser:
    p = BenchmarkParser(
        "tpu_model", __doc__.split("\n\n")[0] + "\n\n    cp-runtime bench tpu_model --out out/",
        quick="the hand model is arithmetic and instant either way; with --compiler, a "
              "one-layer cut",
        quick_values=QUICK)
    p.add_argument("--prefill-lengths", type=length_list, default=[8192, 1 << 20],
                   help="prefill lengths (k/m suffixes)")
    p.add_argument("--contexts", type=length_list, default=[128 << 10, 1 << 20],
                   help="decode context lengths (k/m suffixes)")
    p.add_argument("--batches", type=positive_int_list, default=[1, 32],
                   help="decode batch sizes")
    p.add_argument("--weight-dtype", choices=("fp8", "bf16"), default="fp8",
                   help="weight storage; fp8 also runs the projections at the fp8 MXU rate")
    p.add_argument("--prefill-union", type=finite_positive_float, default=2.0,
                   help="pages a prefill query block reads, in units of one query's selection")
    p.add_argument("--ici-fraction", type=finite_positive_float, default=1.0,
                   help="fraction of the per-device one-way ICI rate a collective achieves")
    p.add_argument("--collective-us", type=finite_nonnegative_float, default=10.0,
                   help="latency of one collective in microseconds (an assumption)")
    p.add_argument("--compiler", action="store_true",
                   help="also compile the runtime's decode step and a prefill chunk for "
                        "tpu7x-16 (needs the tpu extra) and print the hand model beside the "
                        "compiler's flops, bytes and time estimate, term by term")
    p.add_argument("--compiler-layers", type=positive_int,
                   help="with --compiler: cut the model to its first N layers, for compile time")
    # --no-progress: the --compiler progress lines on stderr
    p.add_shared(model="glm-5.2", kv_cache_dtype="fp8_e4m3", page_size=16, chunk_size=8192,
                 out=None, progress=True,
                 why={"chunk_size": "docs/performance.md's tables model 8K-token prefill steps",
                      "out": "unset, the tables are printed and no JSON is written"})
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked (usage errors exit 2), with `--out` created (`args.out`: a Path, None
    without one)."""
    return build_parser().parse_args(argv)


def _time(seconds: float) -> str:
    """4 significant digits in s, ms or us, whichever keeps the number between 1 and 1000."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return "0" if seconds == 0 else f"{seconds * 1e6:.2g} us"


def _print(results: list[dict], hw: Hardware, setup: Setup, model: ModelConfig) -> None:
    print(f"{model.name} on {hw.name}: {hw.devices} devices, per device "
          f"{hw.hbm_bytes_per_s / 1e12:.3g} TB/s HBM, {hw.bf16_flops / TFLOP:.4g} / "
          f"{hw.fp8_flops / TFLOP:.4g} TFLOP/s bf16 / fp8, {hw.hbm_bytes / 2**30:.4g} GiB, "
          f"ICI {hw.ici_bytes_per_s / GB:.4g} GB/s one way, {hw.collective_latency_s * 1e6:.3g} "
          f"us per collective")
    print(f"cache {setup.kv_cache_dtype}, page {setup.page_size}, chunk {setup.chunk_size}, "
          f"weights {setup.weight_precision}, prefill union {setup.prefill_union:g} N")
    print()
    print_table([{**r, "time": _time(r["seconds"]), "tok/s": r["tokens_per_s"],
                  "HBM GB/dev": r["hbm_gb_per_device"], "fits": "yes" if r["fits"] else "NO"}
                 for r in results],
                ["case", "time", "tok/s", "largest_term", "HBM GB/dev", "fits"], title="summary")
    for r in results:
        print()
        print_table([{**t, "time": _time(t["ms"] / 1e3)} for t in r["terms"]]
                    + [{"term": "total", "time": _time(r["seconds"])}],
                    ["term", "hbm_gb", "tflop", "ici_gb", "collectives", "time", "bound"],
                    title=r["case"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = load_model_config(args.model)
    hw = tpu7x_16(ici_fraction=args.ici_fraction, collective_us=args.collective_us)
    setup = Setup(kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size,
                  chunk_size=args.chunk_size, weight_bytes=1 if args.weight_dtype == "fp8" else 2,
                  prefill_union=args.prefill_union)
    results = [evaluate(model, hw, setup, c)
               for c in scenarios(args.prefill_lengths, args.contexts, args.batches)]
    _print(results, hw, setup, model)
    compared = _compare_with_compiler(args, model, hw, setup) if args.compiler else None
    if args.out is not None:
        path = args.out / "tpu_model.json"
        path.write_text(json.dumps({"model": model.name, "hardware": dataclasses.asdict(hw),
                                    "setup": dataclasses.asdict(setup), "results": results,
                                    "compiler": compared}, indent=2))
        print(f"\nwrote {path}")
    return 0


def _compare_with_compiler(args, model: ModelConfig, hw: Hardware, setup: Setup) -> dict:
    """The hand model beside the TPU compiler's figures (benchmarks/tpu_compiler.py)."""
    from cp_runtime.aot.topology import has_libtpu
    from cp_runtime.benchmarks import tpu_compiler

    if not has_libtpu():
        raise SystemExit("cp-runtime bench tpu_model: --compiler needs libtpu; install the "
                         "tpu extra: pip install -e '.[tpu]'")
    out = tpu_compiler.compare(model, hw, setup, layers=args.compiler_layers,
                               context=args.contexts[0], batch=args.batches[0],
                               decode_terms=decode_terms, chunk_terms=chunk_terms,
                               progress=lambda m: args.no_progress or print(
                                   m, file=sys.stderr, flush=True))
    print()
    print_table(out["rows"], ["program", "term", "hand GFLOP", "compiler GFLOP", "flops x",
                              "hand GB", "compiler GB", "bytes x", "hand ms", "compiler ms",
                              "differs"],
                title=f"hand model vs the TPU compiler: {out['model']} cut to {out['layers']} "
                      f"layers on {out['topology']}, {out['weights']} weights "
                      f"(x = compiler / hand; named where off by more than "
                      f"{tpu_compiler.TOLERANCE:.0%})")
    for term, why in out["differing_terms"].items():
        print(f"  differs: {term}: {why}")
    return out


if __name__ == "__main__":
    sys.exit(main())
