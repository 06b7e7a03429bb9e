"""The figures `cp-runtime bench chip` (benchmarks/chip.py) divides by and plans with: the chip's
measured peaks, JAX's compiles counted, how many layers of a model fit beside a pool, and the
floors of a prefill and a decode step (the formulas are chip.py's module docstring).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.monitoring
import jax.numpy as jnp

from cp_runtime.benchmarks._shared.minimum_work import (Work, decode_step_work, prefill_work,
                                                        projection_work)
from cp_runtime.cache.capacity import bytes_per_token
from cp_runtime.cache.layout import cdiv
from cp_runtime.config import ModelConfig
from cp_runtime.weights.format import SCALE_SUFFIX, DeviceTensor, model_bytes
from cp_runtime.weights.sharding import EXPERT_STACKS

__all__ = ["Compiles", "RESERVE_FRACTION", "activation_bytes", "cut_model", "decode_floor",
           "fit_layers", "measure_peaks", "pool_bytes", "prefill_floor", "weight_read_bytes"]

# Of a device's memory, what is kept free beside weights and pool at the least (the same
# share `cp-runtime capacity` reserves for activations).
RESERVE_FRACTION = 0.10
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"


# -- compiles -------------------------------------------------------------------------------
class Compiles:
    """Counts XLA compiles (JAX's backend-compile events: every program, the step's and the
    small ones) and sums their seconds with tracing and lowering, from `jax.monitoring`,
    while installed."""

    def __init__(self):
        self.programs, self.seconds, self.backend_seconds = 0, 0.0, 0.0

    def _listen(self, event: str, duration: float, **_) -> None:
        if event == _BACKEND:
            self.programs += 1
            self.backend_seconds += duration
        if event in (_TRACE, _LOWER, _BACKEND):
            self.seconds += duration

    def install(self) -> "Compiles":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def uninstall(self) -> None:
        try:
            jax.monitoring.unregister_event_duration_listener(self._listen)
        except Exception:                 # noqa: BLE001 - gone already
            pass

    def snapshot(self) -> tuple[int, float]:
        return self.programs, self.seconds


# -- the chip's peaks -----------------------------------------------------------------------
def _mean_seconds(fn, *args, repeats: int) -> float:
    """Mean seconds of `fn(*args)` over `repeats` calls issued back to back (after a
    compiling, warming call), waited for at the end."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats


def measure_peaks(*, matmul_n: int, matmul_dtype, copy_bytes: int, repeats: int) -> dict:
    """The default device's matmul FLOP/s (an [n, n] @ [n, n] in `matmul_dtype`, f32
    accumulation: 2 n^3 / mean seconds) and HBM bandwidth (an f32 array of `copy_bytes`:
    copy = x + 1, read and written, 2 * bytes / mean seconds; read = its sum, bytes / mean
    seconds). `hbm_gb_per_s` is the larger of the two (a decode step mostly reads)."""
    n = matmul_n
    a = jax.jit(lambda: jnp.full((n, n), 0.01, matmul_dtype))()
    b = jax.jit(lambda: jnp.full((n, n), 0.02, matmul_dtype))()
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32)
                 .astype(matmul_dtype))
    mm_s = _mean_seconds(mm, a, b, repeats=repeats)
    del a, b
    x = jax.jit(lambda: jnp.ones((max(1, copy_bytes // 4),), jnp.float32))()
    nbytes = x.nbytes
    copy_s = _mean_seconds(jax.jit(lambda x: x + 1.0), x, repeats=repeats)
    read_s = _mean_seconds(jax.jit(lambda x: jnp.sum(x)), x, repeats=repeats)
    del x
    copy, read = 2 * nbytes / copy_s / 1e9, nbytes / read_s / 1e9
    return {"matmul_n": n, "matmul_dtype": jnp.dtype(matmul_dtype).name, "repeats": repeats,
            "matmul_ms": 1e3 * mm_s, "matmul_tflop_per_s": 2 * n ** 3 / mm_s / 1e12,
            "copy_bytes": nbytes, "copy_ms": 1e3 * copy_s, "hbm_copy_gb_per_s": copy,
            "read_ms": 1e3 * read_s, "hbm_read_gb_per_s": read,
            "hbm_gb_per_s": max(copy, read)}


# -- what fits ------------------------------------------------------------------------------
def cut_model(model: ModelConfig, layers: int) -> ModelConfig:
    """The model's first `layers` layers at full width."""
    from cp_runtime.aot.programs import cut_model as cut
    return cut(model, layers)


def activation_bytes(model: ModelConfig, chunk: int) -> int:
    """A rough bound on one prefill chunk's live temporaries, in f32, one layer at a time:
    per token the hidden state eight times over, q and the attention output of every head
    twice, the indexer's q heads twice and the MLP's rows (the dense MLP's three projections,
    or each routed expert's row in and its three projections, with the shared experts'), plus
    the indexer's k best (score and position) and one key block's scores."""
    hid, h = model.hidden_size, model.num_attention_heads
    mlp = 3 * model.intermediate_size
    if model.n_routed_experts:
        mlp = max(mlp, model.num_experts_per_tok * (hid + 3 * model.moe_intermediate_size)
                  + 3 * model.n_shared_experts * model.moe_intermediate_size)
    per_token = (8 * hid + 2 * h * (model.qk_head_dim + model.v_head_dim)
                 + 2 * model.index_n_heads * model.index_head_dim + mlp
                 + 2 * model.index_topk + 64 * 64)
    return 4 * chunk * per_token


def pool_bytes(model: ModelConfig, kv_cache_dtype: str, pages: int, page_size: int) -> int:
    """The pool's bytes: `pages` pages and the sentinel page, each layer's latent rows and each
    full layer's indexer keys (cp_runtime.cache.capacity.bytes_per_token)."""
    return (pages + 1) * page_size * bytes_per_token(model, kv_cache_dtype)


def fit_layers(model: ModelConfig, *, weight_dtype: str, kv_cache_dtype: str, memory: int,
               pages: int, page_size: int, chunk: int, layers: int | None = None) -> dict:
    """How many leading layers of `model` (full width) fit in `memory` bytes beside a pool of
    `pages` pages: the most N with weights(N) + pool(N) + reserve <= memory, reserve = the
    larger of RESERVE_FRACTION of memory and activation_bytes(chunk); at least one. `layers`
    given: that many, and whether they fit."""
    reserve = max(int(RESERVE_FRACTION * memory), activation_bytes(model, chunk))

    def need(n: int) -> tuple[int, int]:
        cut = cut_model(model, n)
        return model_bytes(cut, weight_dtype), pool_bytes(cut, kv_cache_dtype, pages, page_size)

    chosen = layers
    if chosen is None:
        chosen = 1
        for n in range(1, model.num_hidden_layers + 1):
            w, p = need(n)
            if w + p + reserve > memory:
                break
            chosen = n
    w, p = need(chosen)
    return {"layers": chosen, "auto": layers is None, "memory_bytes": memory,
            "weight_bytes": w, "pool_bytes": p, "reserve_bytes": reserve,
            "fits": w + p + reserve <= memory}


# -- floors ---------------------------------------------------------------------------------
def weight_read_bytes(tensors: dict[str, DeviceTensor], model: ModelConfig, tokens: int,
                      logit_rows: int) -> int:
    """Bytes of weights a step of `tokens` tokens reads, as the device holds them (values and
    block scales): every tensor once, but the embedding (its `tokens` rows), the lm head (none
    without logit rows) and each routed-expert stack (min(E, tokens * k) of its E experts)."""
    total = 0
    experts = min(model.n_routed_experts, tokens * model.num_experts_per_tok)
    for name, t in tensors.items():
        size = t.nbytes_per_device
        base = name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        if base.endswith("embed_tokens.weight"):
            if model.tie_word_embeddings and logit_rows:
                total += size
            else:
                total += min(size, tokens * size // max(t.local[0], 1))
        elif base.endswith("lm_head.weight"):
            total += size if logit_rows else 0
        elif base.endswith(EXPERT_STACKS) and model.n_routed_experts:
            total += size * experts // model.n_routed_experts
        else:
            total += size
    return total


@dataclasses.dataclass(frozen=True)
class Floor:
    """A step's least work and the seconds it takes at the chip's measured peaks."""

    flops: float
    bytes: float
    mxu_s: float
    hbm_s: float

    def as_dict(self, prefix: str) -> dict:
        return {f"{prefix}_flops": self.flops, f"{prefix}_bytes": self.bytes,
                f"{prefix}_mxu_ms": 1e3 * self.mxu_s, f"{prefix}_hbm_ms": 1e3 * self.hbm_s}


def _floor(work: Work, peaks: dict) -> Floor:
    return Floor(work.flops, work.bytes, work.flops / (peaks["matmul_tflop_per_s"] * 1e12),
                 work.bytes / (peaks["hbm_gb_per_s"] * 1e9))


def prefill_floor(model: ModelConfig, peaks: dict, *, context: int, chunk: int,
                  page_size: int, kv_cache_dtype: str, weight_bytes: int) -> Floor:
    """A prefill of `context` tokens from empty in `chunk`-token steps: flops =
    prefill_work(...).flops (minimum_work.py) of the model's first L - 1 layers (at least
    one), bytes = its cache work plus each chunk reading the weights once (`weight_bytes`, the
    stored bytes of a step's weights).

    Why L - 1: a prefill step returns its last row's logits at most, so XLA drops the last
    layer's attention and MLP but for that row and its cache write (cp_runtime.aot.cases);
    a 3-layer cut does two layers' work. Counting all L would set the floor above the work
    the chip runs (a 1-layer cut measured at twice its L-layer floor on a v5e)."""
    counted = cut_model(model, max(model.num_hidden_layers - 1, 1))
    work = prefill_work(counted, length=context, chunk=chunk, page_size=page_size,
                        kv_cache_dtype=kv_cache_dtype, shards=1, param_bytes=0)
    return _floor(work + Work(0, cdiv(context, chunk) * weight_bytes), peaks)


def decode_floor(model: ModelConfig, peaks: dict, tensors: dict[str, DeviceTensor], *,
                 batch: int, context: int, page_size: int, kv_cache_dtype: str) -> Floor:
    """One decode step of `batch` rows at `context` tokens each: the weights once
    (weight_read_bytes, with the lm head) and projection_work's flops for `batch` tokens, plus
    per row decode_step_work less its projection_work (the indexer's keys, the attended latent
    pages, the row's cache write: minimum_work.py)."""
    one = decode_step_work(model, context=context, page_size=page_size,
                           kv_cache_dtype=kv_cache_dtype, shards=1, param_bytes=0)
    proj1 = projection_work(model, 1, logit_rows=1, param_bytes=0, replicas=1)
    per_row = Work(one.flops - proj1.flops, one.bytes - proj1.bytes)
    proj = projection_work(model, batch, logit_rows=batch, param_bytes=0, replicas=1)
    weights = weight_read_bytes(tensors, model, batch, batch)
    return _floor(Work(proj.flops, weights) + per_row.scaled(batch), peaks)
