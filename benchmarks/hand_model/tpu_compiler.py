"""The hand model of `bench tpu_model` beside what the TPU compiler makes of the same programs.

    cp-runtime bench tpu_model --compiler                  # glm-5.2 cut to 4 layers
    cp-runtime bench tpu_model --compiler --compiler-layers 2 --contexts 128k --batches 1

For one decode step (the first --contexts and --batches) and one prefill chunk (the last chunk
of that context), on the model cut to its first N layers at full width: the runtime's own
programs are compiled for tpu7x-16 (cp_runtime.aot; sharded bf16 weights, so the hand model is
evaluated with bf16 weights too), and so is each Pallas kernel alone at the shapes the program
calls it with. The compiler's figures per term:

    indexer scores / selected-page attention / cache writes
                        the kernel compiled alone x its calls (F or L per step)
    rest of the step    the whole program minus those kernels: projections, norms, RoPE,
                        top-K, the merge and collectives' local work, sampling

beside the hand model's term (its `rest` is weights + projections; its collectives move no HBM
bytes and no flops). Every term whose flops or bytes differ by more than 20% is named, with why
where the cause is known. The compiler's time estimate (`optimal_seconds`) is shown where it
gives one; it gives none (a negative placeholder) for some custom calls.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot.deploy import CompilePlan, compile_plan
from cp_runtime.aot.programs import cut_model
from cp_runtime.aot.report import compile_figures
from cp_runtime.aot.topology import compile_only_devices
from cp_runtime.config import ModelConfig, RuntimeConfig
from cp_runtime.dtypes import indexer_cache_dtype, latent_cache_dtype
from cp_runtime.kernels import cache_write, indexer, sparse_decode, sparse_prefill
from cp_runtime.kernels.storage import cdiv

__all__ = ["TOLERANCE", "compare", "KNOWN_CAUSES"]

TOLERANCE = 0.20
KERNEL_TERMS = ("indexer scores", "selected-page attention", "cache writes")
# Differences whose cause is understood (the compiler sees the kernels' cost() upper bounds).
KNOWN_CAUSES = {
    "selected-page attention": "the kernel's estimate counts every selected page as read on "
                               "every shard; the hand model counts the pages a shard owns "
                               "(1/S of them); a prefill block's union is qb x N in the "
                               "estimate, --prefill-union x N in the model",
    "indexer scores": "the estimate reads whole key blocks of the page table's width for "
                      "every query block; the hand model the pages up to the chunk's end",
    "cache writes": "the estimate moves whole tiles of every row on every shard (the "
                    "sentinel's included in the grid); the hand model one row's bytes, once, "
                    "on its owner; the compiler adds the XLA grouping (sort, scatter)",
    "rest of the step": "XLA's own count of the dense layers and of the glue, the experts' "
                        "kernel at its cost bound (every visit a whole row tile, min(E, N) "
                        "experts read) and the expert rows' [T*k, hidden] copies, which the "
                        "hand model does not count",
}


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _kernel_calls(model: ModelConfig, runtime: RuntimeConfig, rows: int, queries: int,
                  table_width: int) -> dict[str, list]:
    """term -> [(name, jitted fn, args, calls per step)] at the program's per-shard shapes."""
    ps, p = runtime.page_size, runtime.pages_per_shard
    lat = latent_cache_dtype(runtime.kv_cache_dtype)
    idx = indexer_cache_dtype(runtime.kv_cache_dtype)
    h, d, n = model.num_attention_heads, model.latent_dim, model.index_topk // ps + 1
    hi, di = model.index_n_heads, model.index_head_dim
    att_args = (_sds((rows, queries, h, d), jnp.bfloat16), _sds((p + 1, ps, d), lat),
                _sds((rows, queries, n), jnp.int32), _sds((rows, queries, n), jnp.int32),
                _sds((rows, queries), jnp.int32))
    statics = dict(value_dim=model.kv_lora_rank, scale=model.softmax_scale)
    if queries == 1:
        attention = jax.jit(lambda *a: sparse_decode.sparse_decode(*a, **statics))
    else:
        attention = jax.jit(lambda *a: sparse_prefill.sparse_prefill(
            *a, query_block=runtime.query_block, **statics))
    idx_args = (_sds((rows, queries, hi, di), jnp.bfloat16), _sds((rows, queries, hi),
                                                                  jnp.float32),
                _sds((p + 1, ps, di), idx), _sds((rows, table_width // runtime.num_shards),
                                                 jnp.int32),
                _sds((rows, queries), jnp.int32), _sds((), jnp.int32))
    scores = jax.jit(lambda *a: indexer.indexer_page_scores(
        *a, num_shards=runtime.num_shards, key_block_pages=runtime.key_block_pages))

    def write(width, dtype):
        shape = (p + 1, ps, width)
        bound = cache_write.tiles_bound(rows, queries,
                                        cache_write.write_tile_rows(shape, dtype))
        fn = jax.jit(lambda c, x, s, o: cache_write.write_kv(c, x, s, o, max_tiles=bound),
                     donate_argnums=(0,))
        m = rows * queries
        return fn, (_sds(shape, dtype), _sds((m, width), jnp.bfloat16), _sds((m,), jnp.int32),
                    _sds((m,), jnp.int32))

    lw, lw_args = write(d, lat)
    iw, iw_args = write(di, idx)
    layers, full = model.num_hidden_layers, model.num_full_layers
    return {"indexer scores": [("indexer", scores, idx_args, full)],
            "selected-page attention": [("attention", attention, att_args, layers)],
            "cache writes": [("latent write", lw, lw_args, layers),
                             ("key write", iw, iw_args, full)]}


def _place(args, device):
    sharding = SingleDeviceSharding(device)
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args)


def _compiler_terms(program: dict, calls: dict[str, list], device) -> dict[str, dict]:
    out, kernel_total = {}, {"flops": 0.0, "bytes": 0.0, "seconds": 0.0}
    for term, kernels in calls.items():
        agg = {"flops": 0.0, "bytes": 0.0, "seconds": 0.0}
        for name, fn, args, count in kernels:
            r = compile_figures(name, fn, _place(args, device), {}, device)
            if not r["compiled"]:
                raise RuntimeError(f"{name} did not compile: {r['error']}")
            agg["flops"] += count * r["flops"]
            agg["bytes"] += count * r["bytes_accessed"]
            t = r["optimal_seconds"]
            agg["seconds"] = None if t is None or agg["seconds"] is None else (
                agg["seconds"] + count * t)
        out[term] = agg
        for k in kernel_total:
            kernel_total[k] = (None if kernel_total[k] is None or agg[k] is None
                               else kernel_total[k] + agg[k])
    whole = program["optimal_seconds"]
    rest_s = (None if whole is None or kernel_total["seconds"] is None
              else whole - kernel_total["seconds"])
    out["rest of the step"] = {"flops": program["flops"] - kernel_total["flops"],
                               "bytes": program["bytes_accessed"] - kernel_total["bytes"],
                               "seconds": rest_s}
    out["whole step"] = {"flops": program["flops"], "bytes": program["bytes_accessed"],
                         "seconds": whole}
    return out


def _hand_terms(terms, hw) -> dict[str, dict]:
    by_name = {t.name: t for t in terms}
    out = {}
    for term in KERNEL_TERMS:
        t = by_name[term]
        out[term] = {"flops": t.flops, "bytes": t.hbm_bytes, "seconds": t.seconds(hw)}
    rest = by_name["weights + projections"]
    out["rest of the step"] = {"flops": rest.flops, "bytes": rest.hbm_bytes,
                               "seconds": rest.seconds(hw)}
    out["whole step"] = {"flops": sum(t.flops for t in terms),
                         "bytes": sum(t.hbm_bytes for t in terms),
                         "seconds": sum(t.seconds(hw) for t in terms)}
    return out


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _rows(label: str, hand: dict, comp: dict) -> list[dict]:
    rows = []
    for term in (*KERNEL_TERMS, "rest of the step", "whole step"):
        h, c = hand[term], comp[term]
        fr, br = _ratio(c["flops"], h["flops"]), _ratio(c["bytes"], h["bytes"])
        off = [what for what, r in (("flops", fr), ("bytes", br))
               if r is not None and abs(r - 1) > TOLERANCE]
        rows.append({"program": label, "term": term,
                     "hand GFLOP": h["flops"] / 1e9, "compiler GFLOP": c["flops"] / 1e9,
                     "flops x": fr, "hand GB": h["bytes"] / 1e9,
                     "compiler GB": c["bytes"] / 1e9, "bytes x": br,
                     "hand ms": h["seconds"] * 1e3,
                     "compiler ms": None if c["seconds"] is None else c["seconds"] * 1e3,
                     "differs": ", ".join(off) if off else ""})
    return rows


def compare(model: ModelConfig, hw, setup, *, layers: int, context: int, batch: int,
            decode_terms, chunk_terms, progress=print) -> dict:
    """Rows of the comparison (see the module docstring) for a decode step and a prefill
    chunk; `decode_terms` / `chunk_terms` are the hand model's functions."""
    cut = cut_model(model, layers)
    setup = dataclasses.replace(setup, weight_bytes=2)           # the compiled weights: bf16
    plan = CompilePlan(model=model.name, layers=layers, kv_cache_dtype=setup.kv_cache_dtype,
                       page_size=setup.page_size, chunk_size=setup.chunk_size,
                       max_batch=batch, context=context, weight_dtype="bf16",
                       programs=("decode", "prefill_logits"))
    progress(f"compiling {cut.name} ({layers} layers) decode and prefill chunk for tpu7x-16")
    result = compile_plan(plan)
    programs = {p["name"]: p for p in result["programs"]}
    for name, p in programs.items():
        if not p["compiled"]:
            raise RuntimeError(f"{name} did not compile: {p['error']}")
    runtime = RuntimeConfig(model=cut.name, kv_cache_dtype=setup.kv_cache_dtype,
                            page_size=setup.page_size, num_shards=result["devices"],
                            pages_per_shard=result["pages_per_shard"],
                            chunk_size=setup.chunk_size, max_batch=batch)
    width = (cdiv(cdiv(context, setup.page_size), runtime.num_shards) + 1) * runtime.num_shards
    device = compile_only_devices(result["topology"])[0]
    progress("compiling each kernel alone at the programs' shapes")
    decode_c = _compiler_terms(programs["decode"], _kernel_calls(cut, runtime, batch, 1, width),
                               device)
    chunk_c = _compiler_terms(programs["prefill_logits"],
                              _kernel_calls(cut, runtime, 1, setup.chunk_size, width), device)
    decode_h = _hand_terms(decode_terms(cut, hw, setup, context=context, batch=batch), hw)
    chunk_h = _hand_terms(chunk_terms(cut, hw, setup, start=max(context - setup.chunk_size, 0),
                                      end=context, union=setup.prefill_union), hw)
    rows = (_rows(f"decode {context:,} B={batch}", decode_h, decode_c)
            + _rows(f"prefill chunk {setup.chunk_size} at {context:,}", chunk_h, chunk_c))
    named = sorted({r["term"] for r in rows if r["differs"] and r["term"] != "whole step"})
    return {"model": cut.name, "layers": layers, "topology": result["topology"],
            "weights": "sharded bf16", "rows": rows,
            "differing_terms": {t: KNOWN_CAUSES.get(t, "") for t in named}}
