"""The tpu7x-16 model (benchmarks/hand_model/tpu_model.py): terms add up, units are what they
say (decode, and the prefill designs' collectives against formulas written out here), the rates
and the wire dtype enter where they should, overlapped <= serial, --json holds the four target
cases, and docs/hand-model.md shows exactly what the module prints."""

import dataclasses
import json
import pathlib

import pytest

from cp_runtime.benchmarks._shared.minimum_work import matmul_weights, projection_work
from cp_runtime.benchmarks.hand_model import tpu_model
from cp_runtime.config import load_model_config

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "hand-model.md"


@pytest.fixture(scope="module")
def glm():
    return load_model_config("glm-5.2")


HW = tpu_model.tpu7x_16()
SETUP = tpu_model.Setup()


def test_device_is_half_a_chip():
    chip = tpu_model.TPU7X_CHIP
    assert HW.devices == 16
    assert HW.hbm_bytes_per_s == pytest.approx(7.37e12 / 2)
    assert HW.bf16_flops == pytest.approx(2307e12 / 2) and HW.fp8_flops == 2 * HW.bf16_flops
    assert HW.hbm_bytes == 96 * 2**30
    assert HW.ici_bytes_per_s == pytest.approx(chip["ici_bidir_bytes_per_s"] / 4)   # 300 GB/s


def test_step_time_is_the_sum_of_its_terms(glm):
    for case in tpu_model.scenarios([8192], [128 << 10], [1, 32]):
        r = tpu_model.evaluate(glm, HW, SETUP, case)
        assert r["seconds"] == pytest.approx(sum(t["ms"] for t in r["terms"]) / 1e3)
        # each term: max of its resources plus its latency
        for t in r["terms"]:
            assert t["ms"] >= 0 and t["bound"] in ("HBM", "MXU", "ICI", "latency", "-")


def _whole_weights(model) -> int:
    """The elements every device holds whole: the routers of the MoE layers and every layer's
    down projections (q_a, kv_a; the indexer's wk and weights_proj in full layers)."""
    down = model.num_hidden_layers * (model.q_lora_rank + model.kv_lora_rank
                                      + model.qk_rope_head_dim)
    down += model.num_full_layers * (model.index_head_dim + model.index_n_heads)
    return model.hidden_size * (down + (model.num_hidden_layers - model.first_k_dense_replace)
                                * model.n_routed_experts)


def test_prefill_sums_its_chunks(glm):
    """Two 8K chunks: the weights are read once per chunk and the projection flops are those of
    16K tokens, split over the 16 devices, but the routers' and the down projections', which
    every device runs whole."""
    terms = {t.name: t for t in tpu_model.prefill_terms(glm, HW, SETUP, length=16384)}
    one = projection_work(glm, 8192, logit_rows=1, param_bytes=1, replicas=1)
    whole = _whole_weights(glm) * 15 / 16             # what a device holds beyond its 1/16
    proj = terms["weights + projections"]
    assert proj.flops == pytest.approx(2 * (one.flops / 16 + 2 * 8192 * whole))
    assert proj.hbm_bytes == pytest.approx(2 * (one.bytes / 16 + whole))
    assert proj.precision == "fp8"


def test_units_of_decode_terms(glm):
    """Batch 1 at 128K: weight bytes are the active weights + lm_head + one embedding row, fp8,
    over 16 devices, and the whole routers and down projections; indexer bytes are every local
    key (padded to key blocks) of the 21 full layers in bf16; attention reads ceil(129 / 16) =
    9 fp8 pages of 16 x 640 per layer, plus its queries and partials."""
    terms = {t.name: t for t in tpu_model.decode_terms(glm, HW, SETUP, context=128 << 10,
                                                       batch=1)}
    hid, ps = glm.hidden_size, SETUP.page_size
    weights = ((matmul_weights(glm) + glm.vocab_size * hid + hid) / 16
               + _whole_weights(glm) * 15 / 16)
    assert terms["weights + projections"].hbm_bytes == pytest.approx(weights)
    # 8193 pages -> 513 local pages, padded by the kernel to whole 64-page key blocks: 576
    keys = glm.num_full_layers * 576 * ps * glm.index_head_dim * 2
    assert keys <= terms["indexer scores"].hbm_bytes <= 1.01 * keys
    h, d, v = glm.num_attention_heads, glm.latent_dim, glm.kv_lora_rank
    per_layer = (9 * (ps * d * 1 + 8)           # fp8 pages + their slot/page ids
                 + h * d * 2                    # bf16 query rows
                 + h * (v + 1) * 4)             # f32 partial output and lse
    assert terms["selected-page attention"].hbm_bytes == glm.num_hidden_layers * per_layer
    flops = glm.num_hidden_layers * 2 * 9 * glm.num_attention_heads * ps * (
        glm.latent_dim + glm.kv_lora_rank)
    assert terms["selected-page attention"].flops == pytest.approx(flops)
    # merge: one all-to-all over heads of the packed f32[1, 64, 512 + 1] (15/16 of it leaves;
    # f32 whatever the wire dtype: the lse must arrive exact)
    merge = glm.num_hidden_layers * 15 / 16 * 64 * (512 * 4 + 4)
    assert terms["attention merge"].ici_bytes == pytest.approx(merge)
    # the down projections are whole on every device: their outputs are not gathered
    assert "projections all-gather" not in terms
    # q heads: all-gather of f32[1, 64, 640] per layer, with the indexer's f32[1, 32, 128] in
    # the same gather in full layers (q in f32 there whatever the wire)
    heads = 15 / 16 * 4 * (78 * 64 * 640 + 21 * 32 * 128)
    assert terms["q heads all-gather"].ici_bytes == pytest.approx(heads)
    # the two all-reduces of f32[1, 6144] per layer: f32 (4 B), what the program sends today
    # (this row counted bf16 before Setup.wire_bytes; it doubled with the f32 default)
    assert terms["weight-shard all-reduce"].ici_bytes == pytest.approx(
        78 * 2 * 2 * 15 / 16 * 6144 * 4)
    # per layer: q heads (the indexer's with them), merge, two all-reduces; full layers: the
    # top-k
    assert terms["collective latency"].collectives == 4 * 78 + 21


def test_doubling_hbm_bandwidth_halves_bandwidth_bound_terms(glm):
    fast = dataclasses.replace(HW, hbm_bytes_per_s=2 * HW.hbm_bytes_per_s)
    halved = 0
    for context, batch in ((128 << 10, 1), (1 << 20, 32)):
        for t in tpu_model.decode_terms(glm, HW, SETUP, context=context, batch=batch):
            before, after = t.seconds(HW), t.seconds(fast)
            if t.bound(HW) == "HBM" and t.bound(fast) == "HBM":
                assert after == pytest.approx(before / 2)
                halved += 1
            elif t.hbm_bytes == 0:
                assert after == before
    assert halved >= 4


def test_memory_fit(glm):
    """Weights (~743 B parameters, fp8) take ~46 GB of each device; 32 sequences of 1M tokens
    do not fit beside them, but for their latent cache held in host memory, their indexer's
    cache does (21 layers x 128 bf16 keys a token: 11.3 GB a device)."""
    def by_case(setup):
        return {x["case"]: x for x in (tpu_model.evaluate(glm, HW, setup, c) for c in
                                       tpu_model.scenarios([8192], [1 << 20], [1, 32]))}
    r = by_case(SETUP)
    assert 45 < r["prefill 8K"]["hbm_gb_per_device"] < 48
    assert r["decode 1M B=1"]["fits"] and not r["decode 1M B=32"]["fits"]
    host = by_case(dataclasses.replace(SETUP, latent_memory="host"))["decode 1M B=32"]
    indexer = 32 * ((1 << 20) + 1) * 21 * 128 * 2 / 16 / 1e9
    assert host["fits"]
    assert host["hbm_gb_per_device"] == pytest.approx(
        r["prefill 8K"]["hbm_gb_per_device"] + indexer, abs=0.05)


# -- prefill designs --------------------------------------------------------------------------
# GLM-5.2 by hand: L = 78 layers, F = 21 full, 3 dense (first_k_dense_replace) and 75 MoE; a
# chunk's last 8K tokens of 1M see C = 1M tokens = 65,536 pages of 16.
L, F, DENSE, MOE, T, C = 78, 21, 3, 75, 8192, 1 << 20
ATTENTION_W = (2048 * 6144 + 64 * (192 + 64) * 2048 + (512 + 64) * 6144 + 64 * (192 + 256) * 512
               + 6144 * 64 * 256)
INDEXER_W = 32 * 128 * 2048 + 128 * 6144 + 32 * 6144


def _chunk(glm, design: str, *, wire: int = 4, start: int = C - T, end: int = C,
           row_attention: str = "auto", mlp_rows: str = "wire",
           indexer_scores: str = "cache") -> dict:
    setup = dataclasses.replace(SETUP, prefill_design=design, wire_bytes=wire,
                                row_attention=row_attention, mlp_rows=mlp_rows,
                                indexer_scores=indexer_scores)
    return {t.name: t for t in tpu_model.chunk_terms(glm, HW, setup, start=start, end=end,
                                                     union=setup.prefill_union)}


def test_layer_kinds_and_weights_add_up_to_matmul_weights(glm):
    kinds = tpu_model.layer_kinds(glm)
    assert kinds == {"dense+full": 3, "moe+full": 18, "moe+shared": 57}
    for experts in (None, glm.n_routed_experts):
        total = sum(n * sum(tpu_model.layer_weights(glm, k, experts=experts).values())
                    for k, n in kinds.items())
        assert total == matmul_weights(glm, experts=experts)
    w = tpu_model.layer_weights(glm, "moe+full")
    assert (w["attention"], w["indexer"]) == (ATTENTION_W, INDEXER_W)


def test_units_of_gather_kv_terms(glm):
    """The last 8K chunk of 1M: each layer all-gathers its fp8 latent cache of 1M tokens x 640
    (15/16 of it sent), attention writes and forwards that buffer (2 x 1M x 640 B a layer) and,
    the rows split, each device attends all 64 heads of its 512 rows over all 129 entries,
    union 2 x 129 pages per block, the q heads and outputs traded by all-to-all (or the
    head-split weights gathered: what auto takes, with an f32 wire or bf16); no
    q-heads gather, no merge."""
    terms = _chunk(glm, "gather_kv", row_attention="rows")
    assert terms["KV all-gather"].ici_bytes == pytest.approx(L * 15 / 16 * C * 640)
    assert "q heads all-gather" not in terms and "attention merge" not in terms
    assert terms["indexer q all-gather"].ici_bytes == pytest.approx(
        F * 15 / 16 * T * 32 * 128 * 4)                  # f32 whatever the wire
    flops = L * 2 * (T // 64) * (2 * 129) * 64 * 4 * 16 * (640 + 512)
    attention = terms["selected-page attention"]
    assert attention.flops == pytest.approx(flops)
    assert attention.hbm_bytes > L * 2 * C * 640
    # the sequence design's attention exactly: 16 x fewer queries with 16 x the heads, so 16 x
    # fewer page reads than 4 heads of every row (the model's union does not depend on the
    # block: the same flops)
    sequence = _chunk(glm, "sequence")["selected-page attention"]
    assert (attention.flops, attention.hbm_bytes) == (sequence.flops, sequence.hbm_bytes)
    # heads: 64 heads over the 9 entries a device owns, union 2 x 9 per 32-query block
    assert _chunk(glm, "gather_q")["selected-page attention"].flops == pytest.approx(
        L * 2 * (T // 32) * (2 * 9) * 32 * 64 * 16 * (640 + 512))
    # the residual stream split by row (8K rows over 16 devices): the heads' sums
    # reduce-scattered, the MLP's input gathered and its sums reduce-scattered, each row's
    # q_lora and (f32) cached row, indexer key and weights gathered; no all-reduce
    assert "weight-shard all-reduce" not in terms
    assert terms["heads' reduce-scatter"].ici_bytes == pytest.approx(L * 15 / 16 * T * 6144 * 4)
    assert terms["MLP all-gather + reduce-scatter"].ici_bytes == pytest.approx(
        L * 2 * 15 / 16 * T * 6144 * 4)
    assert terms["q_lora all-gather"].ici_bytes == pytest.approx(L * 15 / 16 * T * 2048 * 4)
    assert terms["row features all-gather"].ici_bytes == pytest.approx(
        15 / 16 * T * (L * 640 + F * (128 + 32)) * 4)
    assert terms["q heads all-to-all"].ici_bytes == pytest.approx(L * 15 / 16 * T * 4 * 640 * 4)
    assert terms["outputs all-to-all"].ici_bytes == pytest.approx(L * 15 / 16 * T * 4 * 512 * 4)
    # per layer: KV, the two all-to-alls, the reduce-scatter, the MLP's two, q_lora, the row
    # features; full layers: the indexer's q, the top-k
    assert sum(t.collectives for t in terms.values()) == 8 * L + 2 * F
    # the weights gathered instead: each device's 1/16 of q_b, kv_b and o_proj, and in full
    # layers of the indexer's wq_b (fp8, with their f32 scales) from the 15 others; no trade,
    # no heads' sum and no q_lora (each device makes every q head of its rows itself)
    weights = _chunk(glm, "gather_kv", row_attention="weights")
    part = 64 * (256 * 2048 + 448 * 512 + 256 * 6144) * (1 + 4 / 128 ** 2) / 16
    wq_b = 32 * 128 * 2048 * (1 + 4 / 128 ** 2) / 16
    assert weights["head weights all-gather"].ici_bytes == pytest.approx(
        L * 15 * part + F * 15 * wq_b)
    assert not {"q heads all-to-all", "outputs all-to-all", "heads' reduce-scatter",
                "q_lora all-gather"} & set(weights)
    assert sum(t.collectives for t in weights.values()) == 10 * L + 4 * F
    assert weights["selected-page attention"] == attention
    assert _chunk(glm, "gather_kv") == weights                     # auto, f32 on the wire
    assert _chunk(glm, "gather_kv", wire=2) == _chunk(glm, "gather_kv", wire=2,   # and bf16
                                                      row_attention="weights")
    # the down projections run on each device's T / S rows; the routers on every row
    down = _whole_weights(glm) - (L - glm.first_k_dense_replace) * glm.n_routed_experts * 6144
    heads = _chunk(glm, "gather_q")["weights + projections"]
    assert terms["weights + projections"].flops == pytest.approx(
        heads.flops - 15 / 16 * 2 * T * down)


def test_fp8_mlp_rows_halve_the_mlp_gather(glm):
    """gather_kv's split rows reach the MLP as fp8 values (Strategy.mlp_rows): a byte a
    value, beside each row's f32 scale and, in the 75 MoE layers, its 8 experts and weights,
    in a third collective; the sums still come back on the (bf16) wire."""
    L, moe = glm.num_hidden_layers, 75
    wire = _chunk(glm, "gather_kv", wire=2)["MLP all-gather + reduce-scatter"]
    fp8 = _chunk(glm, "gather_kv", wire=2, mlp_rows="fp8")["MLP all-gather + reduce-scatter"]
    assert wire.ici_bytes == pytest.approx(L * 2 * 15 / 16 * T * 6144 * 2)
    assert fp8.ici_bytes == pytest.approx(
        15 / 16 * T * (L * (6144 + 1 * 4 + 6144 * 2) + moe * 2 * 8 * 4))
    assert (wire.collectives, fp8.collectives) == (2 * L, 3 * L)
    with pytest.raises(ValueError, match="mlp_rows 'int8'"):
        dataclasses.replace(SETUP, mlp_rows="int8")


def test_fp8_indexer_scores_run_at_the_fp8_rate_on_keys_of_a_byte(glm):
    """A chunk's indexer in fp8 (Strategy.indexer_scores): the same flops plus a scale a
    key and query block at the fp8 rate, keys of a byte and not two (plus an f32 scale each),
    q gathered as its e4m3 values; a decode step's indexer keeps the cache's bf16."""
    cache, fp8 = (_chunk(glm, "gather_kv", wire=2, indexer_scores=s)
                  for s in ("cache", "fp8"))
    bf16, e4m3 = cache["indexer scores"], fp8["indexer scores"]
    assert (bf16.precision, e4m3.precision) == ("bf16", "fp8")
    assert e4m3.parts(HW)["MXU"] < 0.51 * bf16.parts(HW)["MXU"]
    assert 0.5 < e4m3.hbm_bytes / bf16.hbm_bytes < 0.6
    assert fp8["indexer q all-gather"].ici_bytes == pytest.approx(
        cache["indexer q all-gather"].ici_bytes / 4)
    setup = dataclasses.replace(SETUP, indexer_scores="fp8")
    decode = {t.name: t for t in tpu_model.decode_terms(glm, HW, setup, context=C, batch=1)}
    assert decode["indexer scores"].precision == "bf16"
    with pytest.raises(ValueError, match="indexer_scores 'int4'"):
        dataclasses.replace(SETUP, indexer_scores="int4")


def test_units_of_sequence_terms(glm):
    """8K tokens, 512 per device: experts' dispatch + combine of 512 x 8 rows of 6144 per MoE
    layer; the dense layers gather and scatter all 8K rows; each layer all-gathers its fp8
    attention (and indexer) weights but the down projections; candidates go to their queries'
    owners; no merge and no all-reduce."""
    terms = _chunk(glm, "sequence")
    assert terms["expert all-to-all"].ici_bytes == pytest.approx(
        MOE * 2 * 15 / 16 * 512 * 8 * 6144 * 4)
    assert terms["dense MLP gather + scatter"].ici_bytes == pytest.approx(
        DENSE * 2 * 15 / 16 * T * 6144 * 4)
    # less the down projections, whole on every device: q_a, kv_a (and wk, weights_proj)
    down = L * (2048 + 512 + 64) * 6144 + F * (128 + 32) * 6144
    assert terms["weight all-gather"].ici_bytes == pytest.approx(
        15 / 16 * (L * ATTENTION_W + F * INDEXER_W - down))
    assert terms["candidates all-to-all"].ici_bytes == pytest.approx(F * 15 / 16 * T * 128 * 8)
    assert terms["new rows all-to-all"].ici_bytes == pytest.approx(
        15 / 16 * 512 * (L * 640 + F * 128 * 2))
    assert terms["embedding reduce-scatter"].ici_bytes == pytest.approx(15 / 16 * T * 6144 * 4)
    assert "attention merge" not in terms and "weight-shard all-reduce" not in terms
    # the projections' flops are the gather_q design's, but for the router and the down
    # projections, which each device runs for its own T / S tokens only; its weights are read
    # whole
    heads = _chunk(glm, "gather_q")["weights + projections"]
    assert terms["weights + projections"].flops == pytest.approx(
        heads.flops - 15 / 16 * 2 * T * _whole_weights(glm))
    assert terms["weights + projections"].hbm_bytes > L * ATTENTION_W
    assert sum(t.collectives for t in terms.values()) == 5 * L + 5 * F + 1


@pytest.mark.parametrize("design", tpu_model.DESIGNS)
def test_bf16_wire_halves_exactly_the_activation_collectives(glm, design):
    """The indexer's q is gathered in f32 whatever the wire where a program runs the design
    (gather_q's with the q heads, gather_kv's on its own): the selection must be exact."""
    activations = {"q heads all-gather", "weight-shard all-reduce", "expert all-to-all",
                   "dense MLP gather + scatter", "embedding reduce-scatter",
                   "heads' reduce-scatter", "MLP all-gather + reduce-scatter",
                   "q_lora all-gather", "q heads all-to-all", "outputs all-to-all"}
    if design == "sequence":
        activations.add("indexer q all-gather")
    f32, bf16 = (_chunk(glm, design, wire=w, row_attention="rows") for w in (4, 2))
    assert f32.keys() == bf16.keys() and activations & f32.keys()
    index_q = F * 15 / 16 * T * 32 * 128 * 4           # the indexer's q heads, f32
    for name, t in f32.items():
        want = t.ici_bytes / 2 if name in activations else t.ici_bytes
        if design == "gather_q" and name == "q heads all-gather":     # a chunk: two gathers
            want = (t.ici_bytes - index_q) / 2 + index_q
        if name == "attention merge":
            # f32: the partials exchanged in f32, [T, 64, 512 + 1]; bf16: the chunk's 1 GB
            # of partials are past EXCHANGE_MAX_BYTES, so the lse's f32 gather and a bf16
            # reduce-scatter (merge.resolve_merge)
            assert t.ici_bytes == pytest.approx(L * 15 / 16 * T * 64 * 513 * 4)
            want = L * (15 * T * 64 * 4 + 15 / 16 * T * 64 * 512 * 2)
        assert bf16[name].ici_bytes == pytest.approx(want), name
        assert (bf16[name].hbm_bytes, bf16[name].flops) == (t.hbm_bytes, t.flops)


def test_overlapped_is_at_most_serial(glm):
    """serial = compute + collectives; overlapped = sum over layers of max(compute,
    collectives): between the larger of the two and their sum."""
    rows = tpu_model.design_sweep(glm, HW, SETUP, length=128 << 10, chunks=[8192, 32768])
    assert [(r["design"], r["chunk_size"]) for r in rows] == [
        (d, c) for d in tpu_model.DESIGNS for c in (8192, 32768)]
    for r in rows:
        assert r["serial_s"] == pytest.approx(r["compute_s"] + r["collective_s"])
        assert max(r["compute_s"], r["collective_s"]) <= r["overlapped_s"] * (1 + 1e-12)
        assert r["overlapped_s"] <= r["serial_s"]
        assert set(r["by_kind"]) == {"dense+full", "moe+full", "moe+shared", "step"}
    heads = tpu_model.evaluate(glm, HW, SETUP, {"kind": "prefill", "length": 128 << 10,
                                                "batch": 1, "union": -1.0})
    assert heads["seconds"] == pytest.approx(rows[0]["serial_s"])


def test_compute_floor(glm):
    """1M tokens: the indexer scores sum_t (t // 16) * 16 earlier keys, 21 layers x 32 heads x
    (2 x 128 + 3) flops a pair, over 16 devices at 1154 TFLOP/s bf16; the total is what the
    1M prefill's target doubles."""
    floor = tpu_model.compute_floor(glm, HW, SETUP, length=C)
    pairs = 16 * 16 * (C // 16 - 1) * (C // 16) // 2
    assert floor["indexer"]["tflop"] == pytest.approx(F * pairs * 32 * 259 / 16 / 1e12)
    assert floor["indexer"]["seconds"] == pytest.approx(floor["indexer"]["tflop"] * 1e12
                                                        / HW.bf16_flops)
    assert floor["projections"]["precision"] == "fp8"
    parts = ("indexer", "attention", "projections")
    assert floor["total"]["seconds"] == pytest.approx(sum(floor[p]["seconds"] for p in parts))
    assert 7 < floor["total"]["seconds"] < 11
    case = {c["case"]: c for c in tpu_model.cases(glm, HW, SETUP, design_chunks=[32768])}
    assert case["prefill 1M"]["target_seconds"] == pytest.approx(2 * floor["total"]["seconds"])


def test_json_has_the_four_cases(capsys, glm):
    assert tpu_model.main(["--json", "--prefill-lengths", "8k", "--contexts", "8k",
                           "--batches", "1", "--design-chunks", "32k"]) == 0
    data = json.loads(capsys.readouterr().out)
    keys = {"case", "seconds", "source", "fits", "design", "target_seconds", "meets_target",
            "latent_memory", "host_copy_s"}
    assert [c["case"] for c in data["cases"]] == list(tpu_model.CASES)
    for c in data["cases"]:
        assert set(c) == keys and c["source"] == "model"
        assert isinstance(c["fits"], bool) and c["meets_target"] in (True, False, None)
        prefill = c["case"].startswith("prefill")
        assert (c["design"] is not None) == prefill
        if prefill:
            assert c["design"]["chunk_size"] == 32768
            assert c["design"]["prefill_design"] in tpu_model.DESIGNS
    by = {c["case"]: c for c in data["cases"]}
    assert by["prefill 128K"]["target_seconds"] == 2.0
    assert by["decode 1M B=1"]["target_seconds"] == 0.008
    assert by["decode 1M B=32"]["target_seconds"] is None
    # 32 sessions of 1M fit with their latent cache on the hosts; the step then stages, per
    # layer and device, 32 x 129 / 16 selected pages and reads and writes back 2 written ones,
    # 10 KiB each (pages of 16 x 640 fp8), over half a v5e's measured host link.
    b32 = by["decode 1M B=32"]
    assert b32["meets_target"] is b32["fits"] is True and b32["latent_memory"] == "host"
    assert b32["host_copy_s"] == pytest.approx(78 * (258 + 4) * 16 * 640 / (12.0e9 / 2))
    assert all(c["latent_memory"] == "device" and c["host_copy_s"] == 0
               for c in data["cases"] if c is not b32)
    assert {a["seconds"] for a in data["anchors"]} == {84.7, 314.6, 77.0, 0.0161, 0.0173}
    assert data["results"] and data["model"] == "glm-5.2"


def test_compiler_figures_replace_the_models_seconds(glm):
    out = tpu_model.cases(glm, HW, SETUP, design_chunks=[32768],
                          source_figures={"prefill 1M": 1000.0})
    by = {c["case"]: c for c in out}
    assert (by["prefill 1M"]["seconds"], by["prefill 1M"]["source"]) == (1000.0, "compiler")
    assert by["prefill 1M"]["meets_target"] is False
    assert by["prefill 128K"]["source"] == "model"


def test_bad_setup_is_a_value_error():
    with pytest.raises(ValueError, match="prefill_design"):
        tpu_model.Setup(prefill_design="tokens")
    with pytest.raises(ValueError, match="wire_bytes"):
        tpu_model.Setup(wire_bytes=3)
    with pytest.raises(ValueError, match="layer kind"):
        tpu_model.layer_weights(load_model_config("glm-5.2"), "moe")


def test_doc_table_is_what_the_module_prints(capsys, tmp_path):
    assert tpu_model.main(["--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split("\nwrote ")[0].rstrip("\n")
    assert printed in DOC.read_text(), "docs/hand-model.md is out of date: paste the output"
    data = json.loads((tmp_path / "tpu_model.json").read_text())
    assert [r["case"] for r in data["results"]][:2] == ["prefill 8K", "prefill 1M"]


@pytest.mark.slow
def test_the_hand_model_beside_the_compiler(capsys):
    """`--compiler`: the same decode step and prefill chunk compiled for tpu7x-16; every term
    where the two differ by more than 20% is named (slow: ~1 min of compiling)."""
    from cp_runtime.aot.topology import has_libtpu

    if not has_libtpu():
        pytest.skip("needs libtpu (tpu extra)")
    assert tpu_model.main(["--compiler", "--compiler-layers", "1", "--contexts", "8k",
                           "--batches", "1", "--chunk-size", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "hand model vs the TPU compiler" in printed
    for term in ("indexer scores", "selected-page attention", "cache writes",
                 "rest of the step", "whole step"):
        assert term in printed
    assert "differs: selected-page attention" in printed   # the estimate's upper bound


def test_compiler_figures_take_the_cases_seconds_from_a_compile_matrix(tmp_path, capsys):
    """`--compiler-figures`: the JSON `cp-runtime compile --matrix --out` writes; its decode
    cases by name and its prefills summed over chunks replace the model's seconds, and a
    compiled prefill names the layout and chunk its programs ran, not the model's best."""
    matrix = {"model": "glm-5.2", "prefill_1048576_seconds": 30.0,
              "prefill_131072_seconds": None, "chunk_size": 8192,
              "cases": [{"case": "decode 1M B=1", "program": "decode", "seconds": 0.012,
                         "attention": "gather_q"},
                        {"case": "decode 128K B=1", "seconds": 0.011},
                        {"case": "prefill @0", "program": "prefill_logits", "seconds": 0.2,
                         "attention": "gather_kv"}]}
    assert tpu_model.compiler_seconds(matrix) == {"prefill 1M": 30.0, "decode 1M B=1": 0.012}
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(matrix))
    assert tpu_model.main(["--json", "--compiler-figures", str(path)]) == 0
    by_case = {c["case"]: c for c in json.loads(capsys.readouterr().out)["cases"]}
    assert by_case["prefill 1M"]["source"] == "compiler"
    assert by_case["prefill 1M"]["seconds"] == 30.0
    assert by_case["prefill 1M"]["design"] == {"prefill_design": "gather_kv", "chunk_size": 8192}
    assert by_case["prefill 128K"]["design"]["prefill_design"] in tpu_model.DESIGNS
    assert by_case["decode 1M B=1"]["source"] == "compiler"
    assert not by_case["decode 1M B=1"]["meets_target"]            # 12 ms > 8 ms
    assert by_case["prefill 128K"]["source"] == "model"
    path.write_text(json.dumps({**matrix, "model": "deepseek-v3.2"}))
    with pytest.raises(SystemExit, match="holds 'deepseek-v3.2'"):
        tpu_model.main(["--json", "--compiler-figures", str(path)])
