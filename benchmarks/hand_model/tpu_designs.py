"""The prefill designs of the tpu7x-16 model (benchmarks/hand_model/tpu_model.py): the layer
kinds and their weights, each design's collectives, a step's terms by layer kind
(`decode_groups`, `chunk_groups`), a chunked prefill's schedule (`prefill_schedule`), the
designs x chunk sizes sweep, the compute floor and the HBM use per device. Built on
benchmarks/hand_model/tpu_terms.py's terms.

Per step and per device, each term is a kernel or a collective. Every design has the kernels

    term                        HBM bytes                     flops
    weights + projections       projection_work / S           projection_work / S
    indexer scores              F x indexer.cost              F x indexer.cost
    selected-page attention     L x sparse_{decode,prefill}.cost
    cache writes                L x cache_write.cost (latent) + F x (indexer keys)

and its own collectives (ICI bytes each device sends; ring algorithms: an all-gather sends
(S-1)/S of the gathered array, an all-reduce 2 (S-1)/S of it):

  gather_q   weights split by heads: each device projects its H/S heads of q for all R rows,
             all-gathers them, attends its own pages with all H heads, and the partials merge
             by heads (runtime attention "gather_q"; decode always runs this way).
                 top-k all-gather         F x (S-1) R K 8
                 q heads all-gather       (S-1)/S R w (L H D + F Hi Di)
                 attention merge          L [(S-1) R H w + (S-1)/S R H Dv w]
                 weight-shard all-reduce  2L x 2(S-1)/S R hid w
  gather_kv  gather_q's split, but the pages go to the queries (runtime attention "gather_kv",
             which `auto` picks for long-context prefill chunks): one all-gather of the layer's
             latent cache, (S-1)/S C D c, replaces the q-heads gather and the merge; each
             device attends its H/S heads over all K+1 entries of every query. The residual
             stream is split by row between layers (runtime `residual` auto): the two
             all-reduces become a reduce-scatter of the heads' sums, an all-gather and a
             reduce-scatter around the MLP, and all-gathers of the rows' q_lora and cached
             row features, 3 (S-1)/S R hid w + (S-1)/S R (q_lora w + 4 (D + [F] (Di + Hi)))
             a layer, and the down projections run on each device's R/S rows; and, where the
             kernel's bound says it pays (runtime `row_attention` auto), each device attends
             all H heads of its R/S rows instead, the q heads and the outputs trading places
             by two all-to-alls, (S-1)/S R H/S (D + Dv) w a layer, or (longer chunks) from the
             head-split weights gathered whole, (S-1) x a device's part.
  sequence   tokens split: each device takes R/S of the chunk's rows and all-gathers each
             layer's attention weights; no merge and no weight-shard all-reduce, all-to-alls
             for the new cache rows, the top-k candidates and the experts.

(L layers, F full-indexer layers, H heads, S = 16 devices, R = query rows in the step, K = top-K
pages, C = context tokens a chunk sees, D = latent row, c its cache itemsize, Dv = kv_lora_rank,
w = bytes per activation element on the wire, --wire-dtype; the top-k candidates are 8 bytes,
score f32 + page i32, in every design.) The per-layer formulas are in _gather_q_collectives,
_gather_kv_collectives and _sequence_collectives; every collective also pays a latency.

    term time   = max(HBM bytes / HBM rate, flops / MXU rate, ICI bytes / ICI rate) + latency
    serial      = sum of the term times in every layer of every step    (summary, decode, terms)
    overlapped  = sum over steps and layers of max(compute, collectives)      (prefill designs)

Serial: the terms of a layer depend on each other (scores -> top-K -> attention -> merge ->
projections) and layers run in order. Overlapped: each layer's collectives run beside its
compute (the sum of max(HBM, MXU) of its kernels and projections), so a layer costs the longer
of the two: the best a schedule that overlaps them (the next layer's gathers during this
layer's matmuls, say) can reach. Both are lower bounds for real kernels (no kernel reaches its
peak rate; elementwise work - norms, RoPE, softmax, top-K - is not counted).

Assumptions (each a flag or a constant; the kernels' own in tpu_terms.py):
  * Weights are split evenly over the 16 devices as the runtime splits them with weights =
    "sharded" (cp_runtime/weights/sharding.py; GLM-5.2's ~743 B parameters cannot be replicated
    on 96 GiB devices). The routed experts split by inner features, so each device reads
    1/16 of every chosen expert: the split is even whatever the routing. The router is whole
    on every device (`layer_weights`' "router", not divided). The small feature-split
    gathers (q_a, kv_a, indexer k and weights) are not counted.
  * An all-gathered buffer (gather_kv's and sequence's latent pages, sequence's attention
    weights) costs each device 2x its size in HBM traffic besides what its consumer reads:
    written as it arrives, read again to forward it along the ring.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cp_runtime.benchmarks._shared.minimum_work import (attention_weights, attention_work,
                                                        indexer_weights, indexer_work,
                                                        matmul_weights, projection_work)
from cp_runtime.benchmarks.hand_model.tpu_terms import (DESIGNS, GB, TFLOP, Hardware, Setup, Term,
                                                        _cache_writes, _decode_attention,
                                                        _gathered_pages, _indexer, _owned,
                                                        _prefill_attention, _selected)
from cp_runtime.cache.capacity import bytes_per_token
from cp_runtime.config import ModelConfig
from cp_runtime.dtypes import dtype_bytes, indexer_cache_dtype, latent_cache_dtype
from cp_runtime.kernels.dispatch import MODEL_KERNELS
from cp_runtime.kernels.storage import cdiv
from cp_runtime.model.attention_modes import row_attention_mode
from cp_runtime.parallel.merge import resolve_merge
from cp_runtime.weights.shards import FUSED_GATHER_MAX_ROWS

__all__ = ["LayerGroup", "layer_kinds", "layer_weights", "down_projections", "layer_seconds",
           "decode_groups", "chunk_groups", "decode_terms", "prefill_terms", "prefill_schedule",
           "chunk_terms", "design_sweep", "compute_floor", "hbm_use"]


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """`count` layers of one kind in a step and the terms of ONE of them. Kind "step" holds
    what a step runs once (embedding rows, lm head; sequence's embedding reduce-scatter)."""

    kind: str
    count: int
    terms: tuple[Term, ...]


# -- layers ---------------------------------------------------------------------------------
def layer_kinds(model: ModelConfig) -> dict[str, int]:
    """{kind: number of layers}, kind = "<dense|moe>+<full|shared>" (its MLP and whether it
    runs the indexer), in the order the kinds first appear. GLM-5.2: dense+full 3, moe+full 18,
    moe+shared 57."""
    kinds: dict[str, int] = {}
    for layer in range(model.num_hidden_layers):
        mlp = "moe" if model.is_moe_layer(layer) else "dense"
        kind = f"{mlp}+{model.indexer_types[layer]}"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _is_moe(kind: str) -> bool:
    return kind.startswith("moe+")


def _is_full(kind: str) -> bool:
    return kind.endswith("+full")


def layer_weights(model: ModelConfig, kind: str, *, experts: int | None = None) -> dict[str, int]:
    """Matmul weight elements of ONE layer of `kind` (throughput.matmul_weights' terms; summed
    over the layers they are its total):

        attention  q_lora*hid + H*(nope+rope)*q_lora + (kv_lora+rope)*hid
                   + H*(nope+v)*kv_lora + hid*H*v
        indexer    Hi*Di*q_lora + Di*hid + Hi*hid             (full layers; 0 in shared ones)
        mlp        3*inter*hid (dense) or k*3*moe_inter*hid     (MoE: the routed experts)
        router     E*hid                                       (MoE; whole on every device)
        shared     shared*3*moe_inter*hid                      (MoE: the shared experts)

    `experts` replaces k (the routed experts per token), e.g. the experts a whole chunk reads.
    """
    mlp_kind, _, indexer_kind = kind.partition("+")
    if mlp_kind not in ("dense", "moe") or indexer_kind not in ("full", "shared"):
        raise ValueError(f"layer kind {kind!r}: not <dense|moe>+<full|shared>")
    hid = model.hidden_size
    routed = model.num_experts_per_tok if experts is None else experts
    expert = 3 * model.moe_intermediate_size * hid
    moe = _is_moe(kind)
    return {"attention": attention_weights(model),
            "indexer": indexer_weights(model) if _is_full(kind) else 0,
            "mlp": routed * expert if moe else 3 * model.intermediate_size * hid,
            "router": model.n_routed_experts * hid if moe else 0,
            "shared": model.n_shared_experts * expert if moe else 0}


def down_projections(model: ModelConfig, kind: str) -> int:
    """Weight elements of ONE layer's down projections from the hidden state, whole on every
    device (cp_runtime.weights.sharding; part of layer_weights' attention and indexer terms):
    (q_lora + kv_lora + rope) * hid, plus (Di + Hi) * hid in full layers."""
    width = model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim
    if _is_full(kind):
        width += model.index_head_dim + model.index_n_heads
    return width * model.hidden_size


def layer_seconds(terms, hw: Hardware) -> tuple[float, float]:
    """(compute, collectives) seconds of one layer's terms:

        compute     = sum over its kernels and projections of max(HBM time, MXU time)
        collectives = sum over its collectives of ICI time + latency
    """
    compute = collectives = 0.0
    for t in terms:
        p = t.parts(hw)
        if t.is_collective:
            collectives += p["ICI"] + p["latency"]
        else:
            compute += max(p["HBM"], p["MXU"])
    return compute, collectives


def _flatten(groups: list[LayerGroup]) -> list[Term]:
    """One term per name: each group's terms times its layer count, summed over the groups."""
    totals: dict[str, Term] = {}
    for g in groups:
        for t in g.terms:
            t = t.times(g.count)
            totals[t.name] = totals[t.name] + t if t.name in totals else t
    return list(totals.values())


def _summed(steps: list[list[LayerGroup]], hw: Hardware) -> dict:
    """The terms of `steps` (each a step's layer groups) summed by name, with the collective
    latency one row of its own (_split_latency), and their times:

        seconds   {term: sum over steps and layers of that term's time there} - each kernel at
                  its own bound in each layer of each step, not the bound of the totals
        by_kind   per layer kind and "step": layers, compute_s, collective_s, overlapped_s,
                  summed over the steps (_schedule)
        serial_s  sum of `seconds` = sum over by_kind of compute_s + collective_s
    """
    seconds: dict[str, float] = {}
    latency = 0.0
    by_kind: dict[str, dict] = {}
    for groups in steps:
        for g in groups:
            for t in g.terms:
                p = t.parts(hw)
                seconds[t.name] = (seconds.get(t.name, 0.0)
                                   + g.count * max(p["HBM"], p["MXU"], p["ICI"]))
                latency += g.count * p["latency"]
        for kind, row in _schedule(groups, hw).items():
            into = by_kind.setdefault(kind, {"layers": row["layers"], "compute_s": 0.0,
                                             "collective_s": 0.0, "overlapped_s": 0.0})
            for key in ("compute_s", "collective_s", "overlapped_s"):
                into[key] += row[key]
    seconds["collective latency"] = latency
    terms = _split_latency(_flatten([g for groups in steps for g in groups]))
    return {"terms": terms, "seconds": seconds, "by_kind": by_kind,
            "serial_s": sum(seconds.values())}


def _schedule(groups: list[LayerGroup], hw: Hardware) -> dict[str, dict]:
    """Per kind: its layers, and the step's compute, collective and overlapped seconds in them
    (count x one layer's; the "step" group's terms are never overlapped: compute + collectives).
    """
    out = {}
    for g in groups:
        compute, coll = layer_seconds(g.terms, hw)
        both = compute + coll if g.kind == "step" else max(compute, coll)
        out[g.kind] = {"layers": g.count, "compute_s": g.count * compute,
                       "collective_s": g.count * coll, "overlapped_s": g.count * both}
    return out


# -- projections ----------------------------------------------------------------------------
def _layer_projections(model: ModelConfig, hw: Hardware, setup: Setup, kind: str, tokens: int,
                       *, gathered: bool = False, rows_split: bool = False) -> Term:
    """One layer's matmuls over `tokens` tokens and the weights it reads, split evenly over the
    S devices (throughput.projection_work's formulas, one layer), but the router and the down
    projections, which every device holds and runs whole for its tokens (W' = W less the
    router R and the down projections P, `down_projections`):

        flops = tokens * ((2 * W'_tok + 2 * Di^2 * (Hi + 1) [full layers: Hadamard of q, k]) / S
                          + 2 * (R + P))
        bytes = pb * (W'_step / S + R + P)

    W_tok = layer_weights with k experts, W_step with min(E, tokens * k) (every expert some
    token may use), pb = weight bytes. gathered (the sequence design): the attention and
    indexer weights but P are all-gathered (2 x their bytes: written as they arrive, read again
    to forward them) and read whole by the matmuls, and the shared experts, kept whole on every
    device, are read whole: bytes = pb * (mlp_step / S + R + P + shared + 3 * (attention +
    indexer - P)), and every matmul runs on the device's own tokens / S only: flops = tokens *
    (2 * (W'_tok + R + P) + Hadamard) / S. rows_split (gather_kv with the residual stream split
    by row, the runtime's `residual` auto): each device runs P for its own tokens / S only:
    flops = tokens * ((2 * W'_tok + Hadamard + 2 * P) / S + 2 * R).
    """
    s, pb = hw.devices, setup.weight_bytes
    weights = layer_weights(model, kind)
    whole = weights["router"] + down_projections(model, kind)
    per_token = sum(weights.values()) - whole
    hadamard = 0
    if _is_full(kind) and model.index_hadamard:
        hadamard = 2 * model.index_head_dim ** 2 * (model.index_n_heads + 1)
    step = layer_weights(model, kind, experts=min(model.n_routed_experts,
                                                  tokens * model.num_experts_per_tok))
    if gathered:
        attention = step["attention"] + step["indexer"] - down_projections(model, kind)
        read = step["mlp"] / s + step["shared"] + 3 * attention
        flops = tokens * (2 * (per_token + whole) + hadamard) / s
    else:
        read = (sum(step.values()) - whole) / s
        down = down_projections(model, kind) if rows_split else 0
        flops = tokens * ((2 * per_token + hadamard + 2 * down) / s + 2 * (whole - down))
    return Term("weights + projections", hbm_bytes=pb * (read + whole), flops=flops,
                precision=setup.weight_precision)


def _step_projections(model: ModelConfig, hw: Hardware, setup: Setup, tokens: int,
                      logit_rows: int) -> Term:
    """What a step runs once, split over the S devices: the embedding rows it reads and the lm
    head over `logit_rows` rows (projection_work's remaining terms):

        flops = logit_rows * 2 * V * hid / S
        bytes = pb * (tokens * hid + V * hid [if logit_rows]) / S
    """
    hid, v = model.hidden_size, model.vocab_size
    rows = tokens * hid + (v * hid if logit_rows else 0)
    return Term("weights + projections", hbm_bytes=setup.weight_bytes * rows / hw.devices,
                flops=logit_rows * 2 * v * hid / hw.devices, precision=setup.weight_precision)


# -- collectives, by design -----------------------------------------------------------------
def _top_k_gather(model: ModelConfig, hw: Hardware, setup: Setup, rows: int,
                  pages: int) -> Term:
    """Full layers: every shard's top-K candidates, score f32 and page i32 packed into one
    array (selection.global_top_pages), (S-1) R K 8; one collective."""
    return Term("top-k all-gather",
                ici_bytes=(hw.devices - 1) * rows * _selected(model, setup, pages) * 8,
                collectives=1)


def _gather_q_collectives(model: ModelConfig, hw: Hardware, setup: Setup, kind: str, rows: int,
                          pages: int) -> list[Term]:
    """What each device sends in one layer of `kind` with weights split by heads and every head
    of q gathered (decode, and short prefill chunks), `rows` query rows over `pages` pages each:

    top-k all-gather         full layers: _top_k_gather
    q heads all-gather       the query rows [R, H, D] (each device projects its own heads, every
                             device attends with all of them): (S-1)/S R H D w; full layers
                             also the indexer's q [R, Hi, Di] in f32, (S-1)/S R Hi Di 4: in a
                             decode step in the same all-gather, q then in f32 too
                             (WeightShards.gather_heads), else in a second one
    attention merge          as `auto` picks (merge.resolve_merge): one all-to-all over heads of
                             the packed partials [o | lse] f32[R, H, Dv + 1], (S-1)/S R H
                             (Dv + 1) 4 (`head_exchange`); or, past EXCHANGE_MAX_BYTES with a
                             bf16 wire, an all-gather of the lse f32[R, H], (S-1) R H 4, and a
                             reduce-scatter of o over heads, (S-1)/S R H Dv w (`head_scatter`)
    weight-shard all-reduce  the attention and the MLP outputs [R, hid]: 2 x 2(S-1)/S R hid w

    The down projections' outputs need no gather: their weights are whole on every device.
    Collectives issued in a decode step: 4 per layer, 1 more per full layer.
    """
    s, h, w, full = hw.devices, model.num_attention_heads, setup.wire_bytes, _is_full(kind)
    one_way = (s - 1) / s
    terms = [_top_k_gather(model, hw, setup, rows, pages)] if full else []
    idx_q = model.index_n_heads * model.index_head_dim if full else 0
    joined = full and rows <= FUSED_GATHER_MAX_ROWS
    terms += [
        Term("q heads all-gather", ici_bytes=one_way * rows
             * ((4 if joined else w) * h * model.latent_dim + 4 * idx_q),
             collectives=1 + (full and not joined)),
        _merge_term(model, hw, setup, rows),
        Term("weight-shard all-reduce",
             ici_bytes=2 * 2 * one_way * rows * model.hidden_size * w, collectives=2)]
    return terms


def _merge_term(model: ModelConfig, hw: Hardware, setup: Setup, rows: int) -> Term:
    """The attention merge of _gather_q_collectives, as `auto` picks it."""
    s, h, dv = hw.devices, model.num_attention_heads, model.kv_lora_rank
    padded = cdiv(h, s) * s
    wire = "bf16" if setup.wire_bytes == 2 else "f32"
    if resolve_merge("auto", True, rows * h * (dv + 1) * 4, wire) == "head_scatter":
        return Term("attention merge", ici_bytes=(s - 1) * rows * h * 4
                    + (s - 1) / s * rows * padded * dv * setup.wire_bytes, collectives=2)
    return Term("attention merge", ici_bytes=(s - 1) / s * rows * padded * (dv + 1) * 4,
                collectives=1)


def _gather_kv_collectives(model: ModelConfig, hw: Hardware, setup: Setup, kind: str,
                           rows: int, pages: int) -> list[Term]:
    """One layer of the gather_kv design (weights split by heads; the pages go to the queries):

    top-k all-gather         full layers: _top_k_gather
    indexer q all-gather     full layers: [R, Hi, Di] in f32 whatever the wire (the selection
                             must be exact), (S-1)/S R Hi Di 4; with --indexer-scores fp8 its
                             e4m3 values, rounded before they cross, (S-1)/S R Hi Di
    KV all-gather            the layer's latent cache of the C = pages x ps tokens the chunk
                             sees: (S-1)/S C D c (c = the latent cache itemsize)
    with the residual stream split by row (R divisible by S; the runtime's `residual` auto):
    q heads all-to-all       where each device attends every head of its own rows trading
                             them (`_row_mode` "rows"): its H/S heads of every row for every
                             head of its rows, (S-1)/S R H/S D w
    outputs all-to-all       and the attention's outputs back to their heads' devices:
                             (S-1)/S R H/S Dv w
    head weights all-gather  or instead (`_row_mode` "weights") q_b, kv_b and o_proj (and in
                             full layers the indexer's wq_b) whole on every device, (S-1) x its
                             part, HEAD_WEIGHT_GATHERS (+ INDEXER_WEIGHT_GATHERS) collectives:
                             then no all-to-all, no heads' reduce-scatter, and no q_lora
                             gather (each device makes every q head of its rows, the
                             indexer's too, which are then gathered by row)
    heads' reduce-scatter    the heads' projections summed into each device's R/S rows:
                             (S-1)/S R hid w
    MLP all-gather +         the MLP's normed input to every device and its sums back:
      reduce-scatter         2 (S-1)/S R hid w; 2 collectives. With fp8 rows (--mlp-rows):
                             (S-1)/S R (hid + 4 (1 + [MoE] 2k)) + (S-1)/S R hid w, the rows'
                             values, their scales and routing (f32) in a third collective
    q_lora all-gather        each device's rows of q_lora: (S-1)/S R q_lora w (not where the
                             weights are gathered)
    row features all-gather  the cached latent row, and (full layers) the indexer's key and
                             head weights, in f32 (they feed the cache and the selection):
                             (S-1)/S R (D + [full] (Di + Hi)) 4
    else:
    weight-shard all-reduce  as heads: 2 x 2(S-1)/S R hid w; 2 collectives

    No q-heads gather and no merge: each device attends every head of its rows (its own H/S
    heads of every row where the rows are not split or that costs less) over every page.
    Collectives issued in a prefill chunk: 8 per layer where the rows trade their heads, 6
    where each device attends its heads, 3 with every row on every device, 2 more per full
    layer; 10 per layer where the weights are gathered, 4 more per full layer (wq_b and its
    scales).
    """
    s, w = hw.devices, setup.wire_bytes
    one_way = (s - 1) / s
    c = dtype_bytes(latent_cache_dtype(setup.kv_cache_dtype))
    terms = []
    if _is_full(kind):
        terms += [_top_k_gather(model, hw, setup, rows, pages),
                  Term("indexer q all-gather", ici_bytes=one_way * rows * model.index_n_heads
                       * model.index_head_dim * (1 if setup.indexer_scores == "fp8" else 4),
                       collectives=1)]
    terms.append(Term("KV all-gather", ici_bytes=one_way * pages * setup.page_size
                      * model.latent_dim * c, collectives=1))
    if rows % s:
        return terms + [Term("weight-shard all-reduce",
                             ici_bytes=2 * 2 * one_way * rows * model.hidden_size * w,
                             collectives=2)]
    features = model.latent_dim + (model.index_head_dim + model.index_n_heads
                                   if _is_full(kind) else 0)
    heads = cdiv(model.num_attention_heads, s)
    mode = _row_mode(model, hw, setup, rows, pages)
    if mode == "rows":
        terms += [
            Term("q heads all-to-all", ici_bytes=one_way * rows * heads * model.latent_dim * w,
                 collectives=1),
            Term("outputs all-to-all",
                 ici_bytes=one_way * rows * heads * model.kv_lora_rank * w, collectives=1)]
    if mode == "weights":
        local, gathers = _head_weight_bytes(model, hw, setup), HEAD_WEIGHT_GATHERS
        if _is_full(kind):
            local += _indexer_q_weight_bytes(model, hw, setup)
            gathers += INDEXER_WEIGHT_GATHERS
        terms.append(Term("head weights all-gather", ici_bytes=(s - 1) * local,      # written
                          hbm_bytes=2 * s * local, collectives=gathers))              # and read
    else:
        terms += [Term("heads' reduce-scatter",
                       ici_bytes=one_way * rows * model.hidden_size * w, collectives=1),
                  Term("q_lora all-gather", ici_bytes=one_way * rows * model.q_lora_rank * w,
                       collectives=1)]
    return terms + [
        _mlp_rows_collectives(model, hw, setup, kind, rows),
        Term("row features all-gather", ici_bytes=one_way * rows * features * 4,
             collectives=1)]


def _mlp_rows_collectives(model: ModelConfig, hw: Hardware, setup: Setup, kind: str,
                          rows: int) -> Term:
    """The split rows' MLP: its input all-gathered (on the wire, or as fp8 values beside each
    row's f32 scale and, in MoE layers, its k experts and weights) and its sums
    reduce-scattered on the wire."""
    one_way, hid, w = (hw.devices - 1) / hw.devices, model.hidden_size, setup.wire_bytes
    if setup.mlp_rows != "fp8":
        return Term("MLP all-gather + reduce-scatter", ici_bytes=2 * one_way * rows * hid * w,
                    collectives=2)
    side = 1 + (2 * model.num_experts_per_tok if _is_moe(kind) else 0)
    return Term("MLP all-gather + reduce-scatter",
                ici_bytes=one_way * rows * (hid + 4 * side + hid * w), collectives=3)


# The head-split weights' gathers a layer, as the compiled step issues them: q_b and kv_b, o_proj,
# each fp8 weight with its scales; and in a full layer the indexer's wq_b with its scales.
HEAD_WEIGHT_GATHERS = 6
INDEXER_WEIGHT_GATHERS = 2


def _head_weight_bytes(model: ModelConfig, hw: Hardware, setup: Setup) -> float:
    """A device's part of one layer's head-split attention weights (q_b, kv_b, o_proj)."""
    per_head = (model.qk_head_dim * model.q_lora_rank
                + (model.qk_nope_head_dim + model.v_head_dim) * model.kv_lora_rank
                + model.v_head_dim * model.hidden_size)
    return _split_bytes(per_head, model.num_attention_heads, hw, setup)


def _indexer_q_weight_bytes(model: ModelConfig, hw: Hardware, setup: Setup) -> float:
    """A device's part of a full layer's indexer wq_b."""
    return _split_bytes(model.index_head_dim * model.q_lora_rank, model.index_n_heads, hw,
                        setup)


def _split_bytes(per_head: int, heads: int, hw: Hardware, setup: Setup) -> float:
    """A device's part of weights split by head, `per_head` values a head (heads padded to a
    multiple of S), with their 128 x 128 block scales (f32) where fp8."""
    padded = cdiv(heads, hw.devices) * hw.devices
    scales = 4 / 128 ** 2 if setup.weight_bytes == 1 else 0
    return padded * per_head * (setup.weight_bytes + scales) / hw.devices


def _row_mode(model: ModelConfig, hw: Hardware, setup: Setup, rows: int, pages: int) -> str:
    """How a gather_kv chunk of `rows` rows over `pages` pages attends, as the runtime's
    `row_attention` (setup.row_attention) decides, at the kernel's bound, not the model's
    union: "heads" where its rows do not split (divisible by S), else the cheapest of each
    device's heads of every row, every head of its rows with q and outputs traded ("rows"),
    or with the head-split weights gathered ("weights")."""
    s = hw.devices
    if rows % s:
        return "heads"
    return row_attention_mode(
        setup.row_attention, rows=rows, heads=cdiv(model.num_attention_heads, s) * s,
        latent_dim=model.latent_dim, value_dim=model.kv_lora_rank, hidden=model.hidden_size,
        q_lora_rank=model.q_lora_rank, entries=_selected(model, setup, pages) + 1,
        every_pages=pages + s,
        page_size=setup.page_size, cache_dtype=latent_cache_dtype(setup.kv_cache_dtype),
        num_shards=s, wire_itemsize=setup.wire_bytes, query_block=setup.query_block,
        head_weight_bytes=int(_head_weight_bytes(model, hw, setup)),
        dequantised_elements=_dequantised_elements(model, hw, setup, rows // s))


def _dequantised_elements(model: ModelConfig, hw: Hardware, setup: Setup, rows: int) -> int:
    """The head-split weights' values that XLA dequantises once gathered whole, for a
    device's `rows` rows, as the runtime decides (`ModelKernels.dequantised_whole`; none unless
    fp8)."""
    if setup.weight_bytes != 1:
        return 0
    h = cdiv(model.num_attention_heads, hw.devices) * hw.devices
    shapes = {"self_attn.q_b_proj.weight": (h * model.qk_head_dim, model.q_lora_rank),
              "self_attn.kv_b_proj.weight": (h * (model.qk_nope_head_dim + model.v_head_dim),
                                             model.kv_lora_rank),
              "self_attn.o_proj.weight": (model.hidden_size, h * model.v_head_dim)}
    return sum(a * b for name, (a, b) in shapes.items()
               if MODEL_KERNELS.dequantised_whole(model, name, (a, b),
                                                  (cdiv(a, 128), cdiv(b, 128)), rows))


def _sequence_collectives(model: ModelConfig, hw: Hardware, setup: Setup, kind: str,
                          rows: int, pages: int) -> list[Term]:
    """One layer of the sequence design (each device takes R/S of the chunk's rows):

    weight all-gather        the layer's attention (and, full layers, indexer) weights but
                             the down projections (whole on every device): (S-1)/S pb
                             (attention + indexer - P)  (layer_weights, down_projections)
    KV all-gather            as gather_kv: (S-1)/S C D c
    new rows all-to-all      the chunk's new latent rows (and, full layers, indexer keys) to
                             the devices owning their pages: (S-1)/S R/S (D c [+ Di c_idx])
    indexer q all-gather     full layers: q [R, Hi, Di] and head weights [R, Hi] of every
                             token, (S-1)/S R (Hi Di + Hi) w; 2 collectives
    candidates all-to-all    full layers: each device's top-K [R, K] (score f32 + page i32)
                             to the query's owner, (S-1)/S R K 8; 2 collectives
    expert all-to-all        MoE layers: dispatch + combine, 2 (S-1)/S R/S k hid w
    dense MLP gather+scatter dense layers (MLP weights split): all-gather + reduce-scatter of
                             [R, hid], 2 (S-1)/S R hid w

    No merge and no weight-shard all-reduce. The shared experts are kept whole on every device
    (read whole: _layer_projections; their room: hbm_use), so they send nothing. Collectives
    issued: 5 per layer, 5 more per full layer, and one embedding reduce-scatter per step
    (_step_collectives).
    """
    s, w, hid = hw.devices, setup.wire_bytes, model.hidden_size
    one_way = (s - 1) / s
    full = _is_full(kind)
    c = dtype_bytes(latent_cache_dtype(setup.kv_cache_dtype))
    c_idx = dtype_bytes(indexer_cache_dtype(setup.kv_cache_dtype))
    weights = layer_weights(model, kind)
    row_bytes = model.latent_dim * c + (model.index_head_dim * c_idx if full else 0)
    terms = [
        Term("weight all-gather", ici_bytes=one_way * setup.weight_bytes
             * (weights["attention"] + weights["indexer"] - down_projections(model, kind)),
             collectives=1),
        Term("KV all-gather",
             ici_bytes=one_way * pages * setup.page_size * model.latent_dim * c, collectives=1),
        Term("new rows all-to-all", ici_bytes=one_way * rows / s * row_bytes,
             collectives=1 + full)]
    if full:
        hi = model.index_n_heads
        terms += [Term("indexer q all-gather",
                       ici_bytes=one_way * rows * (hi * model.index_head_dim + hi) * w,
                       collectives=2),
                  Term("candidates all-to-all",
                       ici_bytes=one_way * rows * _selected(model, setup, pages) * 8,
                       collectives=2)]
    if _is_moe(kind):
        terms.append(Term("expert all-to-all", ici_bytes=2 * one_way * rows / s
                          * model.num_experts_per_tok * hid * w, collectives=2))
    else:
        terms.append(Term("dense MLP gather + scatter",
                          ici_bytes=2 * one_way * rows * hid * w, collectives=2))
    return terms


def _step_collectives(model: ModelConfig, hw: Hardware, setup: Setup, rows: int) -> list[Term]:
    """Once per step, sequence design only: the embedding (split by vocab) reduce-scattered to
    the tokens' owners, (S-1)/S R hid w."""
    return [Term("embedding reduce-scatter", ici_bytes=(hw.devices - 1) / hw.devices * rows
                 * model.hidden_size * setup.wire_bytes, collectives=1)]


_COLLECTIVES = {"gather_q": _gather_q_collectives, "gather_kv": _gather_kv_collectives,
                "sequence": _sequence_collectives}


# -- steps ----------------------------------------------------------------------------------
def _groups(model: ModelConfig, hw: Hardware, setup: Setup, *, design: str, rows: int,
            pages: int, logit_rows: int, indexer_term: Term, attention: Term) -> list[LayerGroup]:
    """A step's layer groups: per kind, its projections, the indexer (full layers), attention,
    cache writes and the design's collectives; then the step's once-only terms."""
    groups = []
    for kind, count in layer_kinds(model).items():
        full = _is_full(kind)
        terms = [_layer_projections(model, hw, setup, kind, rows, gathered=design == "sequence",
                                    rows_split=design == "gather_kv" and rows % hw.devices == 0),
                 *([indexer_term] if full else []), attention,
                 _cache_writes(model, hw, setup, rows, full=full),
                 *_COLLECTIVES[design](model, hw, setup, kind, rows, pages)]
        groups.append(LayerGroup(kind, count, tuple(terms)))
    step = [_step_projections(model, hw, setup, rows, logit_rows)]
    if design == "sequence":
        step += _step_collectives(model, hw, setup, rows)
    return groups + [LayerGroup("step", 1, tuple(step))]


def decode_groups(model: ModelConfig, hw: Hardware, setup: Setup, *, context: int,
                  batch: int) -> list[LayerGroup]:
    """One decode step (the gather_q design, whatever setup.prefill_design says): `batch`
    sequences of `context` cached tokens each add one token."""
    pages = cdiv(context + 1, setup.page_size)
    local = cdiv(pages, hw.devices)
    return _groups(model, hw, setup, design="gather_q", rows=batch, pages=pages, logit_rows=batch,
                   indexer_term=_indexer(model, hw, setup, batch, 1, local),
                   attention=_decode_attention(model, hw, setup, batch, local, pages))


def chunk_groups(model: ModelConfig, hw: Hardware, setup: Setup, *, start: int, end: int,
                 union: float | None) -> list[LayerGroup]:
    """One prefill chunk step of setup.prefill_design: queries start..end of one sequence (T of
    them), each seeing the pages up to the chunk's end (an upper bound for its earlier queries:
    < chunk / length extra), its lm head on one row. Attention per layer:

        heads      all H heads of the T queries over the ceil((K+1)/S) entries a device owns,
                   in its ceil(pages/S) local pages
        gather_kv  H/S heads of the T queries over all K+1 entries of the gathered cache,
                   or all H heads of T/S queries where the rows attend (`_row_mode`)
        sequence   all H heads of T/S queries over all K+1 entries of the gathered cache

    the last two with the gathered cache's own HBM traffic (_gathered_pages): the same
    attention flops in all three (up to rounding and the union cap), split differently.
    """
    design, h, s = setup.prefill_design, model.num_attention_heads, hw.devices
    t, pages = end - start, cdiv(end, setup.page_size)
    local = cdiv(pages, s)
    if design == "gather_q":
        attention = _prefill_attention(model, setup, queries=t, heads=h, cache_pages=local,
                                       entries=_owned(model, hw, setup, pages), union=union)
    else:
        own_heads = (design == "gather_kv"
                     and _row_mode(model, hw, setup, t, pages) == "heads")
        queries, heads = (t, cdiv(h, s)) if own_heads else (cdiv(t, s), h)
        attention = (_prefill_attention(model, setup, queries=queries, heads=heads,
                                        cache_pages=pages,
                                        entries=_selected(model, setup, pages) + 1, union=union)
                     + _gathered_pages(model, setup, pages))
    return _groups(model, hw, setup, design=design, rows=t, pages=pages, logit_rows=1,
                   indexer_term=_indexer(model, hw, setup, 1, t, local), attention=attention)


def _split_latency(terms: list[Term]) -> list[Term]:
    """Move every term's collective count into one 'collective latency' row, so each ICI row
    shows its bandwidth time and the (assumed) latency stays visible on its own."""
    count = sum(t.collectives for t in terms)
    return ([dataclasses.replace(t, collectives=0) for t in terms]
            + [Term("collective latency", collectives=count)])


def decode_terms(model: ModelConfig, hw: Hardware, setup: Setup, *, context: int,
                 batch: int) -> list[Term]:
    """One decode step's terms, summed over its layers (decode_groups)."""
    return _split_latency(_flatten(decode_groups(model, hw, setup, context=context,
                                                 batch=batch)))


def chunk_terms(model: ModelConfig, hw: Hardware, setup: Setup, *, start: int, end: int,
                union: float | None) -> list[Term]:
    """One prefill chunk step's terms, summed over its layers (chunk_groups)."""
    return _flatten(chunk_groups(model, hw, setup, start=start, end=end, union=union))


def prefill_schedule(model: ModelConfig, hw: Hardware, setup: Setup, *, length: int,
                     union: float | None = -1.0) -> dict:
    """A chunked prefill of one `length`-token sequence in setup.chunk_size steps of
    setup.prefill_design: _summed's terms, seconds, by_kind and serial_s over its steps, and

        overlapped_s  sum over steps and layers of max(compute, collectives) (_schedule)

    union=-1 takes setup.prefill_union; None the kernel's upper bound.
    """
    union = setup.prefill_union if union == -1.0 else union
    steps = [chunk_groups(model, hw, setup, start=start,
                          end=min(start + setup.chunk_size, length), union=union)
             for start in range(0, length, setup.chunk_size)]
    out = _summed(steps, hw)
    return out | {"overlapped_s": sum(k["overlapped_s"] for k in out["by_kind"].values())}


def prefill_terms(model: ModelConfig, hw: Hardware, setup: Setup, *, length: int,
                  union: float | None = -1.0) -> list[Term]:
    """A chunked prefill's terms, summed over its chunk steps (prefill_schedule)."""
    return prefill_schedule(model, hw, setup, length=length, union=union)["terms"]


# -- the prefill designs, the compute floor and HBM use -------------------------------------
def hbm_use(model: ModelConfig, hw: Hardware, setup: Setup, *, tokens: int) -> float:
    """Bytes per device: the weight share (all experts, embedding and lm_head) plus the cache of
    `tokens` cached tokens in all (cp_runtime.cache.capacity's bytes per token in HBM: the
    indexer's alone where setup.latent_memory is "host"). The routers
    and the down projections are whole on every device: (S-1)/S of them more; the sequence
    design keeps the shared experts whole too. Transient buffers (a layer's gathered cache or
    attention weights) are not counted."""
    whole = {kind: layer_weights(model, kind)["router"] + down_projections(model, kind)
             for kind in layer_kinds(model)}
    if setup.prefill_design == "sequence":
        whole = {kind: n + layer_weights(model, kind)["shared"] for kind, n in whole.items()}
    replica = (hw.devices - 1) * sum(n * whole[kind] for kind, n in layer_kinds(model).items())
    weights = (matmul_weights(model, experts=model.n_routed_experts)
               + 2 * model.vocab_size * model.hidden_size + replica) * setup.weight_bytes
    cache = tokens * bytes_per_token(model, setup.kv_cache_dtype, setup.latent_memory)
    return (weights + cache) / hw.devices


def design_sweep(model: ModelConfig, hw: Hardware, setup: Setup, *, length: int,
                 chunks: list[int]) -> list[dict]:
    """The prefill of `length` tokens in every design x chunk size: ICI GB per device, compute,
    collective, serial and overlapped seconds, the layer kinds whose collectives take longer
    than their compute (`exposed`), and each kind's figures (prefill_schedule)."""
    rows = []
    for design in DESIGNS:
        for chunk in chunks:
            s = dataclasses.replace(setup, prefill_design=design, chunk_size=chunk)
            p = prefill_schedule(model, hw, s, length=length)
            kinds = p["by_kind"]
            rows.append({
                "design": design, "chunk_size": chunk,
                "ici_gb": sum(t.ici_bytes for t in p["terms"]) / GB,
                "compute_s": sum(k["compute_s"] for k in kinds.values()),
                "collective_s": sum(k["collective_s"] for k in kinds.values()),
                "serial_s": p["serial_s"], "overlapped_s": p["overlapped_s"],
                "exposed": [kind for kind, k in kinds.items()
                            if kind != "step" and k["collective_s"] > k["compute_s"]],
                "hbm_gb_per_device": hbm_use(model, hw, s, tokens=length) / GB,
                "by_kind": kinds})
    return rows


def compute_floor(model: ModelConfig, hw: Hardware, setup: Setup, *, length: int) -> dict:
    """Seconds of one `length`-token prefill's flops alone, per device, each at the peak MXU
    rate of its dtype: the work itself (benchmarks/throughput's counts: no kernel padding, no
    page union, no design), no HBM and no ICI, a floor no design goes below:

        indexer      indexer_work,   sum_t (t // ps) * ps pairs                      / S, bf16
        attention    attention_work, sum_t min(K, t // ps) * ps + t % ps + 1 pairs   / S, bf16
        projections  projection_work(length tokens, 1 logit row)        / S, the weights' dtype

    The indexer stays at the bf16 rate whatever `setup.indexer_scores`: the floor the targets
    were set from is that of the work as the cache holds it (bf16 keys).

    {part: {"tflop", "precision", "seconds"}} for the three parts and their "total".
    """
    ps, s, dtype = setup.page_size, hw.devices, setup.kv_cache_dtype
    t = np.arange(length, dtype=np.int64)
    k = model.index_topk // ps
    flops = {
        "indexer": (indexer_work(model, int(((t // ps) * ps).sum()), 0,
                                 kv_cache_dtype=dtype).flops, "bf16"),
        "attention": (attention_work(model, int((np.minimum(k, t // ps) * ps + t % ps + 1).sum()),
                                     0, page_size=ps, kv_cache_dtype=dtype).flops, "bf16"),
        "projections": (projection_work(model, length, logit_rows=1,
                                        param_bytes=setup.weight_bytes, replicas=1).flops,
                        setup.weight_precision)}
    out = {part: {"tflop": f / s / TFLOP, "precision": p, "seconds": f / s / hw.peak(p)}
           for part, (f, p) in flops.items()}
    out["total"] = {"tflop": sum(v["tflop"] for v in out.values()), "precision": None,
                    "seconds": sum(v["seconds"] for v in out.values())}
    return out
