"""The vocabulary of the tpu7x-16 model (hand_model/tpu_model.py): the rates of one device
(`Hardware`, `tpu7x_16`), one term of a step and its time (`Term`), the runtime choices the
model is evaluated at (`Setup`, DESIGNS, WIRE_BYTES), and the kernels' terms taken from their
`cost()` functions (indexer scores, selected-page attention, cache writes). Pure arithmetic over
shapes (no JAX device work, nothing measured).

Slice: 16 JAX devices = 8 TPU7x (Ironwood) chips x 2 TensorCores, on 2 hosts. Per chip (Cloud
TPU's TPU7x page): 2307 TFLOP/s bf16, 4614 TFLOP/s fp8, 192 GiB HBM, 2 TensorCores; HBM 7.37
TB/s and ICI 1.2 TB/s bidirectional (Google's Ironwood announcement). A device gets half of each.

A term is one kernel or collective of a step, per device: its HBM bytes, flops and ICI bytes
sent, and the collectives it issues. Its time:

    term time   = max(HBM bytes / HBM rate, flops / MXU rate, ICI bytes / ICI rate) + latency

Max within a term: each kernel streams pages through a double-buffered DMA ring, so its HBM
traffic and MXU work overlap. How a step's terms add up (serial, overlapped) and which terms a
design has: hand_model/tpu_designs.py.

Assumptions (each a flag or a constant below):
  * Weights fp8 (--weight-dtype), so projection matmuls run at the fp8 rate; the indexer (bf16
    keys) and attention (fp8 pages upcast to bf16 queries in VMEM) run at the bf16 rate, except
    a prefill chunk's indexer with --indexer-scores fp8 (q and keys rounded to e4m3, the
    runtime's choice on a TPU), which runs at the fp8 rate.
  * Activations cross the ICI in f32 (--wire-dtype): what the runtime sends on the CPU. On a
    TPU it sends the q rows, merge partials and psums of [R, hidden] in bf16 (runtime field
    wire_dtype), closer to --wire-dtype bf16 (which also halves the indexer q, kept f32).
  * The KV cache is sharded by page round-robin, so a query's selected pages and a sequence's
    context spread evenly: each device owns ceil((K + 1) / S) of a query's K + 1 pages and
    ceil(pages / S) of its context.
  * Kernel costs are their `cost()` upper bounds, except prefill attention: `sparse_prefill.cost`
    assumes a query block's union of pages is qb * N (no two queries share a page); its page
    reads and flops scale linearly with the union U, so they are scaled to
    U = min(--prefill-union x N, qb x N, pages it can read). The upper bound is its own row.
  * Collectives: ring algorithms at --ici-fraction of one device's one-way ICI share (1.2 TB/s
    bidirectional per chip / 2 directions / 2 TensorCores = 300 GB/s), plus --collective-us per
    collective (an assumed latency, not a published figure).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cp_runtime.aot.roofline import TPU7X_CHIP
from cp_runtime.config import (INDEXER_SCORES_CHOICES, ROW_ATTENTION_MODES, ModelConfig,
                               RuntimeConfig)
from cp_runtime.dtypes import dtype_bytes, indexer_cache_dtype, latent_cache_dtype
from cp_runtime.kernels import cache_write, indexer, sparse_decode, sparse_prefill
from cp_runtime.kernels.storage import cdiv
from cp_runtime.weights.shards import MLP_ROWS

__all__ = ["Hardware", "Term", "Setup", "DESIGNS", "WIRE_BYTES", "INDEXER_SCORES", "GB", "TFLOP",
           "HOST_LINK_BYTES_PER_S", "tpu7x_16"]

GB, TFLOP = 1e9, 1e12
# A chip's host link, pages of a host-held latent cache staged eight at a time: measured 12.0
# GB/s on a TPU v5e (`cp-runtime bench host_pages`; docs/notes/2026-12-07-host-latent-cache.md, "The
# latent cache in host memory"); no TPU7x figure is known here, so a TPU7x chip is taken to have the
# same, shared by its two devices.
HOST_LINK_BYTES_PER_S = 12.0e9
DESIGNS = ("gather_q", "gather_kv", "sequence")
WIRE_BYTES = {"f32": 4, "bf16": 2}
INDEXER_SCORES = tuple(c for c in INDEXER_SCORES_CHOICES if c != "auto")   # as resolved


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
    host_bytes_per_s: float = 0.0   # host memory <-> HBM, pages of a host-held latent cache

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
                    collective_latency_s=collective_us * 1e-6,
                    host_bytes_per_s=HOST_LINK_BYTES_PER_S * per)


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

    def times(self, n: int) -> "Term":
        """The term of n such kernels or collectives (n layers of one kind)."""
        return dataclasses.replace(self, hbm_bytes=n * self.hbm_bytes, flops=n * self.flops,
                                   ici_bytes=n * self.ici_bytes,
                                   collectives=n * self.collectives)

    @property
    def is_collective(self) -> bool:
        """A collective sends ICI bytes or pays latency; a kernel moves HBM bytes and flops."""
        return self.ici_bytes > 0 or self.collectives > 0

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
    """The runtime choices the model is evaluated at.

    wire_bytes: bytes per activation element on the interconnect, in every activation
    collective (q heads, indexer q, merge partials and lse, the weight-shard all-reduce, the
    designs' all-to-alls and gathers of activations). 4: f32, what the runtime sends on the
    CPU; 2: bf16, near what it sends on a TPU. prefill_design: how a prefill chunk's work is
    split over the devices (DESIGNS; hand_model/tpu_designs.py's docstring); decode always
    runs `gather_q`. row_attention: how gather_kv's split rows attend (the runtime field's
    modes; auto decides as the runtime does). mlp_rows: how gather_kv's split rows reach the
    MLP (Strategy.mlp_rows: "fp8" on a TPU). indexer_scores: how a prefill chunk's
    indexer scores its keys (Strategy.indexer_scores: "fp8" on a TPU; decode keeps the
    cache's bf16).
    """

    kv_cache_dtype: str = "fp8_e4m3"
    page_size: int = 16
    chunk_size: int = 8192
    weight_bytes: int = 1                      # fp8 weights
    key_block_pages: int = RuntimeConfig.key_block_pages
    query_block: int = RuntimeConfig.query_block
    prefill_union: float = 2.0                 # a query block's union of pages, in units of N
    wire_bytes: int = 4                        # f32 activations on the ICI (the program's now)
    mlp_rows: str = "wire"                     # a split chunk's MLP rows: "wire" or "fp8"
    indexer_scores: str = "cache"              # a prefill chunk's indexer: "cache" or "fp8"
    prefill_design: str = "gather_q"
    row_attention: str = "auto"                # gather_kv's split rows: RuntimeConfig's field
    latent_memory: str = "device"              # RuntimeConfig.latent_memory: "device", "host"

    def __post_init__(self):
        if self.prefill_design not in DESIGNS:
            raise ValueError(f"prefill_design {self.prefill_design!r}: not one of {DESIGNS}")
        if self.row_attention not in ROW_ATTENTION_MODES:
            raise ValueError(f"row_attention {self.row_attention!r}: not one of "
                             f"{ROW_ATTENTION_MODES}")
        if self.mlp_rows not in MLP_ROWS:
            raise ValueError(f"mlp_rows {self.mlp_rows!r}: not one of {MLP_ROWS}")
        if self.indexer_scores not in INDEXER_SCORES:
            raise ValueError(f"indexer_scores {self.indexer_scores!r}: not one of "
                             f"{INDEXER_SCORES}")
        if self.wire_bytes not in WIRE_BYTES.values():
            raise ValueError(f"wire_bytes {self.wire_bytes}: not one of "
                             f"{sorted(WIRE_BYTES.values())} (bf16, f32)")
        if self.page_size <= 0 or self.chunk_size <= 0:
            raise ValueError(f"page_size {self.page_size}, chunk_size {self.chunk_size}: "
                             "must be positive")

    @property
    def weight_precision(self) -> str:
        return "fp8" if self.weight_bytes == 1 else "bf16"


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), dtype)


def _kernel_term(name: str, cost: dict) -> Term:
    return Term(name, hbm_bytes=cost["bytes"], flops=cost["flops"])


# -- kernels --------------------------------------------------------------------------------
def _indexer(model: ModelConfig, hw: Hardware, setup: Setup, batch: int, queries: int,
             local_pages: int) -> Term:
    """One call of the indexer kernel over one device's `local_pages` pages per sequence; a
    prefill chunk's (queries > 1) in fp8 where `setup.indexer_scores` says so: q and keys
    e4m3 with a scale per key, at the fp8 rate."""
    ps, di, hi = setup.page_size, model.index_head_dim, model.index_n_heads
    fp8 = setup.indexer_scores == "fp8" and queries > 1
    values = jnp.float8_e4m3fn if fp8 else None
    cost = indexer.cost(_spec((batch, queries, hi, di), values or jnp.bfloat16),
                        _spec((batch, queries, hi), jnp.float32),
                        _spec((batch * local_pages + 1, ps, di),
                              values or indexer_cache_dtype(setup.kv_cache_dtype)),
                        _spec((batch, local_pages), jnp.int32),
                        _spec((batch, queries), jnp.int32),
                        k_scale=_spec((batch, local_pages, ps), jnp.float32) if fp8 else None,
                        num_shards=hw.devices, key_block_pages=setup.key_block_pages)
    return dataclasses.replace(_kernel_term("indexer scores", cost),
                               precision="fp8" if fp8 else "bf16")


def _attention_args(model: ModelConfig, setup: Setup, batch: int, queries: int, heads: int,
                    cache_pages: int, n: int) -> tuple:
    ps, d = setup.page_size, model.latent_dim
    return (_spec((batch, queries, heads, d), jnp.bfloat16),
            _spec((batch * cache_pages + 1, ps, d), latent_cache_dtype(setup.kv_cache_dtype)),
            _spec((batch, queries, n), jnp.int32), _spec((batch, queries, n), jnp.int32),
            _spec((batch, queries), jnp.int32))


def _selected(model: ModelConfig, setup: Setup, pages: int) -> int:
    """K: the top-K pages a query selects, at most the pages there are."""
    return min(model.index_topk // setup.page_size, pages)


def _owned(model: ModelConfig, hw: Hardware, setup: Setup, pages: int) -> int:
    """Entries of one query's list (own page + top-K) that one device owns."""
    return cdiv(_selected(model, setup, pages) + 1, hw.devices)


def _decode_attention(model, hw, setup, batch: int, local_pages: int, pages: int) -> Term:
    """One layer's sparse_decode.cost: every head of `batch` queries over their owned entries."""
    n = _owned(model, hw, setup, pages)
    cost = sparse_decode.cost(*_attention_args(model, setup, batch, 1,
                                               model.num_attention_heads, local_pages, n),
                              value_dim=model.kv_lora_rank)
    return _kernel_term("selected-page attention", cost)


def _prefill_attention(model: ModelConfig, setup: Setup, *, queries: int, heads: int,
                       cache_pages: int, entries: int, union: float | None) -> Term:
    """One layer's sparse_prefill.cost: `queries` queries of `gather_q` heads, each over `entries`
    entries of a `cache_pages`-page cache. The cost counts U = qb * N pages per query block
    (qb: the kernel's block, setup.query_block or less where VMEM halves it); its page reads and
    flops are linear in U (cost at N minus cost at 0), so they are scaled to the assumed union
    U = min(union * N, qb * N, cache_pages). union=None keeps the kernel's upper bound."""

    def cost(n: int) -> dict:
        return sparse_prefill.cost(*_attention_args(model, setup, 1, queries, heads,
                                                    cache_pages, n),
                                   value_dim=model.kv_lora_rank, query_block=setup.query_block)

    full, fixed = cost(entries), cost(0)
    u_max = full["blocks"]["q"][0] * entries
    u = u_max if union is None else min(union * entries, u_max, cache_pages)
    scale = u / u_max
    scaled = {k: fixed[k] + (full[k] - fixed[k]) * scale for k in ("bytes", "flops")}
    return _kernel_term("selected-page attention", scaled)


def _gathered_pages(model: ModelConfig, setup: Setup, pages: int) -> Term:
    """HBM traffic of one layer's all-gathered latent cache of `pages` pages, beside the
    kernel's page reads: 2 x C x D x c (written as it arrives, read again to forward it),
    C = pages x page size."""
    c = dtype_bytes(latent_cache_dtype(setup.kv_cache_dtype))
    return Term("selected-page attention",
                hbm_bytes=2 * pages * setup.page_size * model.latent_dim * c)


def _cache_writes(model, hw, setup, rows: int, *, full: bool) -> Term:
    """One layer's new rows, each written once by the device owning its page: rows / S per
    device, latent rows in every layer and indexer keys in full ones."""
    ps, per_device = setup.page_size, cdiv(rows, hw.devices)
    term = _kernel_term("cache writes", cache_write.cost(
        _spec((2, ps, model.latent_dim), latent_cache_dtype(setup.kv_cache_dtype)),
        _spec((per_device, model.latent_dim), jnp.bfloat16)))
    if full:
        term += _kernel_term("cache writes", cache_write.cost(
            _spec((2, ps, model.index_head_dim), indexer_cache_dtype(setup.kv_cache_dtype)),
            _spec((per_device, model.index_head_dim), jnp.bfloat16)))
    return term
