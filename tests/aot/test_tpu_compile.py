"""The TPU compiler's own verdict, on a machine without a TPU: every Pallas kernel and the
serving programs compile with XLA:TPU and Mosaic for a compile-only tpu7x:2x2x2 slice (16 TPU7x
devices), from shapes alone (cp_runtime.aot).

  - kernels: each kernel x cache dtype x model x page size (three of the twelve combinations
    in the default suite, all in the slow run; the experts' kernel once per model, at one
    token's rows and an 8192-token chunk's, the fp8 linear kernel at 1 and 256 rows, the
    most the model gives it), at the model's per-shard shapes; multi-block prefill (200 and
    8192 queries); within the VMEM budget; the kernel's cost() inside the compiler's figures
    (its CostEstimate reached XLA).
  - token masks: sparse_decode and sparse_prefill with `sel_masks` at index_topk entries a
    query (GLM-5.2 by default, DeepSeek-V3.2 in the slow run), fp8 pages of 64: decode rows
    of 1 and 64, an 8192-query chunk, within the VMEM and SMEM budgets.
  - programs: glm-5.2 and deepseek-v3.2 cut to their first 3 layers at full width (the MoE
    layers come later: `cp-runtime compile --layers 4` and the slow whole-model test compile
    them), sharded fp8 weights with their block scales (the models' own): the decode step
    compiles, aliases the pool in place (alias bytes = pool bytes), counts the kernels' flops,
    and takes the capacity rule's weight bytes. In the slow run only (the default suite's time
    allows one program): deepseek-v3.2's decode, glm-5.2's prefill chunk, and glm-5.2's decode
    again at a pool 4x larger, where temporaries grow by at most 2% of the pool's growth (they
    do not grow).
  - schedule (Strategy.tpu_schedule, cp_runtime.engine.step.compiler_options): the step's
    XLA option reaches TPU meshes only. Slow: GLM-5.2's 8K chunk at 120K (5 layers, beside
    the capacity-sized pool, two compiles of ~2.5 min here) hides a third of its collectives'
    time behind compute with the scheduler's memory-pressure tracking off ("overlap"), next
    to none with it on ("xla"), from the same program text, and fits the device both ways.
    (Not every chunk shows it: a 4K chunk at 0 and an 8K chunk at 0 hide the same both ways.)
    It compiles the chunk in one pass (chunk_halves off), so that the option alone differs.
  - halves (Strategy.chunk_halves, cp_runtime.model.halves). Slow: GLM-5.2's 8K chunk
    at 0 as two halves hides most of the MLP's all-gathers and reduce-scatters, which one
    pass leaves exposed, and the chunk's overlapped time drops by more than the weights'
    second reading costs.
  - pages gathered ahead (cp_runtime.model.halves, `ShardState.ahead`). Slow: GLM-5.2's 8K
    chunk at 120K, as two halves, has most of its pages' all-gathers beside its indexer
    kernels, where gathered in their own layer they sat almost all exposed.

Without libtpu (the tpu extra) these skip with the reason, except under CI, where they fail.
"""

from __future__ import annotations

import pytest

from conftest import require_libtpu

require_libtpu()


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from cp_runtime.aot.cases import PhaseCase, run_case, run_exchanges  # noqa: E402
from cp_runtime.aot.deploy import CompilePlan, compile_plan  # noqa: E402
from cp_runtime.aot.kernel_cases import (decode_cases, expert_cases, linear_cases,  # noqa: E402
                                         indexer_cases, kernel_cases, latent_cases,
                                         prefill_cases, router_cases, write_cases)
from cp_runtime.aot.report import compile_figures  # noqa: E402
from cp_runtime.aot.roofline import compiler_clock_hz  # noqa: E402
from cp_runtime.aot.topology import compile_only_devices  # noqa: E402
from cp_runtime.cache.capacity import GIB  # noqa: E402
from cp_runtime.config import RuntimeConfig, load_model_config  # noqa: E402
from cp_runtime.engine.step import compiler_options  # noqa: E402
from cp_runtime.kernels import sparse_decode  # noqa: E402
from cp_runtime.kernels.vmem import SMEM_BUDGET_BYTES, VMEM_BUDGET_BYTES  # noqa: E402

MODELS = ("glm-5.2", "deepseek-v3.2")
CACHE_DTYPES = ("bf16", "fp8_e4m3", "fp8_e5m2")
PAGE_SIZES = (16, 64)
LAYERS = 3                      # the 3-4; each layer adds ~3-8 s to a compile here
SMALL_POOL_PAGES = 32768        # 5.6 GB a device for 3 layers (latent + indexer); 4x is 22 GB


@pytest.fixture(scope="module")
def device():
    return compile_only_devices("tpu7x-16")[0]


def _cases(model, kv_dtype, page_size, device):
    """All dtypes: decode rows and a chunk written, a 5-row decode, a 200-query (4+ block)
    prefill. fp8_e4m3 (the default) adds the batch and chunk extremes (the 8192-query chunk at
    pages of 64; `cp-runtime compile --kernels` compiles it at 16 too) and the indexer, whose
    bf16 cache is the same under every fp8 latent dtype and bf16, and the experts' and
    the linear kernels (no cache: once per model, with the 64-token pages). (e5m2 writes the
    same tiles as e4m3, so only e4m3 and bf16 write a whole chunk.)"""
    full = kv_dtype == "fp8_e4m3"
    chunks = (1, 200, 8192) if full and page_size == 64 else (1, 200) if full else (200,)
    writes = ((64, 1),) if kv_dtype == "fp8_e5m2" else ((64, 1), (8192, 8192))
    return (write_cases(model, kv_dtype, page_size, writes, device)
            + decode_cases(model, kv_dtype, page_size, (1, 5, 64) if full else (5,), device)
            + prefill_cases(model, kv_dtype, page_size, chunks, device)
            + (indexer_cases(model, kv_dtype, page_size, (1, 8192),
                             RuntimeConfig().key_block_pages, device) if full else [])
            + (expert_cases(model, (1, 8192), device) + linear_cases(model, (1, 256), device)
               if full and page_size == 64 else []))


def _kernel_params():
    """Every model x cache dtype x page size; the default suite compiles glm-5.2's fp8_e4m3
    (the default cache) and bf16 and deepseek-v3.2's fp8_e4m3, at pages of 64 (the TPU
    deployments' size), the rest in the slow run (each takes ~10-35 s here)."""
    default = {("glm-5.2", "fp8_e4m3", 64), ("glm-5.2", "bf16", 64),
               ("deepseek-v3.2", "fp8_e4m3", 64)}
    return [pytest.param(m, d, p, marks=() if (m, d, p) in default else pytest.mark.slow)
            for m in MODELS for d in CACHE_DTYPES for p in PAGE_SIZES]


@pytest.mark.parametrize("model_name, kv_dtype, page_size", _kernel_params())
def test_kernels_compile_for_tpu7x(model_name, kv_dtype, page_size, device):
    model = load_model_config(model_name)
    for case in _cases(model, kv_dtype, page_size, device):
        r = compile_figures(case.name, case.jitted(), case.args, {}, device)
        assert r["compiled"], (case.name, r["error"])
        assert case.cost["vmem_bytes"] <= VMEM_BUDGET_BYTES, (case.name, case.cost)
        # The kernel's CostEstimate is part of the compiler's totals (XLA counts nothing inside
        # a custom call otherwise); the grouping and padding around a kernel only add to them.
        assert r["flops"] >= case.cost["flops"], (case.name, r["flops"], case.cost["flops"])
        assert r["bytes_accessed"] >= case.cost["bytes"], (case.name, r, case.cost)


@pytest.mark.parametrize("model_name, prefill_block", [
    ("glm-5.2", 16), pytest.param("deepseek-v3.2", 2, marks=pytest.mark.slow)])
def test_token_masked_attention_compiles_for_tpu7x(model_name, prefill_block, device):
    """Token mode: index_topk = 2,048 entries a query, each with its two mask words. Decode at
    1 and 64 rows: the row's tables and masks in SMEM blocks (72 KiB at N = 2,048; prefetched
    whole, the page tables alone of 64 rows were 1.01 MiB of TPU7x's 1.00 MiB and refused).
    The 8192-query chunk: its union lists take 4 * qb * N * 4 bytes of SMEM, so GLM-5.2's
    block is 16 queries (512 KiB; 32 was refused at 1 MiB), DeepSeek-V3.2's 128 heads price
    2 lowest. (The chunk takes 15-40 s to compile here, most of it XLA's sort of the blocks'
    unions, 16 x 2,048 entries each: that sort alone took 12 s.)"""
    model = load_model_config(model_name)
    cases = (decode_cases(model, "fp8_e4m3", 64, (1, 64), device, masked=True)
             + prefill_cases(model, "fp8_e4m3", 64, (8192,), device, masked=True))
    for case in cases:
        r = compile_figures(case.name, case.jitted(), case.args, {}, device)
        assert r["compiled"], (case.name, r["error"])
        assert case.cost["vmem_bytes"] <= VMEM_BUDGET_BYTES, (case.name, case.cost)
        assert case.cost["smem_bytes"] <= SMEM_BUDGET_BYTES, (case.name, case.cost)
        assert r["flops"] >= case.cost["flops"], (case.name, r["flops"], case.cost["flops"])
        assert r["bytes_accessed"] >= case.cost["bytes"], (case.name, r, case.cost)
    assert cases[-1].cost["blocks"]["sel_masks"] == (2, prefill_block, model.index_topk)


@pytest.fixture(scope="module")
def compiled():
    """(model, pages per shard) -> (compile_plan result, its programs by name), each compiled
    once for the module (a 4-layer decode step takes ~35 s to compile here)."""
    cache = {}

    def get(model_name: str, pages: int, programs=("decode",)):
        key = model_name, pages, programs
        if key not in cache:
            plan = CompilePlan(model=model_name, layers=LAYERS, pages_per_shard=pages,
                               programs=programs, chunk_size=1024, context=1 << 20)
            result = compile_plan(plan)
            cache[key] = result, {p["name"]: p for p in result["programs"]}
        return cache[key]

    return get


def _decode_kernel_flops(model, runtime_pages: int, plan_rows: int) -> float:
    """Flops the decode step's attention kernels account for: one call per layer."""
    ps, h, d = 64, model.num_attention_heads, model.latent_dim
    n = model.index_topk // ps + 1
    sds = jax.ShapeDtypeStruct
    per_layer = sparse_decode.cost(sds((plan_rows, 1, h, d), jnp.bfloat16),
                                   sds((runtime_pages + 1, ps, d), jnp.float8_e4m3fn),
                                   sds((plan_rows, 1, n), jnp.int32), None, None,
                                   value_dim=model.kv_lora_rank)["flops"]
    return LAYERS * per_layer


def _check_program(name: str, result: dict, row: dict) -> None:
    assert row["compiled"], (name, row["error"])
    assert row["alias_bytes"] == result["pool_bytes_per_device"], (name, row)
    assert row["peak_bytes"] <= result["hbm_bytes_per_device"], (name, row)


@pytest.mark.parametrize("model_name", [
    "glm-5.2", pytest.param("deepseek-v3.2", marks=pytest.mark.slow)])
def test_programs_compile_in_place_with_kernel_costs(model_name, compiled):
    result, rows = compiled(model_name, SMALL_POOL_PAGES)
    assert set(rows) == {"decode"}
    for name, row in rows.items():
        _check_program(name, result, row)
    model = load_model_config(model_name)
    assert rows["decode"]["flops"] >= _decode_kernel_flops(model, SMALL_POOL_PAGES,
                                                           result["max_batch"])
    # The weights the programs take (the model's own fp8, block scales and all) are the
    # capacity rule's weights, to the byte.
    assert result["weight_bytes_per_device"] == result["capacity_weight_bytes_per_device"]
    # And by the compiler's own count: the decode step's argument bytes less the pool are the
    # weights plus the step's inputs (a page table of a few KiB), within 1% of the rule. (The
    # decode step uses every weight; a "fill" chunk computes no logits, and the compiler drops
    # the unused lm head from its arguments.)
    rule, decode = result["capacity_weight_bytes_per_device"], rows["decode"]
    weights = decode["argument_bytes"] - decode["pool_argument_bytes"]
    assert abs(weights - rule) <= 0.01 * rule, (weights, rule)


@pytest.mark.parametrize("model_name", MODELS)
def test_compile_kernels_lists_every_kernel(model_name, device):
    """`cp-runtime compile --kernels` has a case for every Pallas kernel the step runs, each
    with the cost figures its report prints (built, not compiled: the next test compiles the
    two kinds the kernels' own tests do not reach through these cases)."""
    model = load_model_config(model_name)
    cases = kernel_cases(model, "fp8_e4m3", 64, device)
    assert {c.kernel for c in cases} == {"cache_write", "sparse_decode", "sparse_prefill",
                                         "indexer", "experts", "linear", "router", "latent",
                                         "whole_heads", "shared", "top_k"}
    assert len({c.name for c in cases}) == len(cases)
    for c in cases:
        assert {"flops", "bytes", "vmem_bytes"} <= set(c.cost), c.name
        assert c.cost["vmem_bytes"] <= VMEM_BUDGET_BYTES, c.name


def test_router_and_latent_cases_compile(device):
    """GLM-5.2's router and kv_b kernels as `compile --kernels` builds them, one row each."""
    model = load_model_config("glm-5.2")
    for case in router_cases(model, (1,), device) + latent_cases(model, (1,), device):
        r = compile_figures(case.name, case.jitted(), case.args, {}, device)
        assert r["compiled"], (case.name, r["error"])
        assert r["flops"] >= case.cost["flops"] > 0, case.name


@pytest.mark.slow
def test_prefill_chunk_program_compiles_in_place(compiled):
    """A 1024-token chunk of glm-5.2 (multi-block prefill in the program, ~70 s to compile
    here: the default suite compiles the prefill kernels alone, at up to 8192 queries)."""
    result, rows = compiled("glm-5.2", SMALL_POOL_PAGES, programs=("prefill_fill",))
    _check_program("prefill_fill", result, rows["prefill_fill"])


@pytest.mark.slow
def test_program_temporaries_do_not_grow_with_the_pool(compiled):
    """glm-5.2's decode at a 4x larger pool: temporaries within 2% of the growth."""
    small, at_small = compiled("glm-5.2", SMALL_POOL_PAGES)
    large, at_large = compiled("glm-5.2", 4 * SMALL_POOL_PAGES, programs=("decode",))
    growth = large["pool_bytes_per_device"] - small["pool_bytes_per_device"]
    assert growth > 0
    for name, b in at_large.items():
        a = at_small[name]
        _check_program(name, large, b)
        assert abs(b["temp_bytes"] - a["temp_bytes"]) <= 0.02 * growth, (name, a, b)


def test_schedule_options_reach_tpu_programs_only():
    tracking = "xla_tpu_enable_scheduler_memory_pressure_tracking"
    tpu = Mesh(np.array(compile_only_devices("tpu7x-16")), ("cp",))
    cpu = Mesh(np.array(jax.devices("cpu")[:1]), ("cp",))
    assert compiler_options("overlap", tpu) == {tracking: False,
                                                 "xla_tpu_enable_async_all_to_all": True}
    assert compiler_options("xla", tpu) is None
    assert compiler_options("overlap", cpu) is None


@pytest.mark.slow
def test_a_32k_chunk_fits_only_with_the_runtimes_schedule():
    """The 32K chunk at 1M - 32K of a GLM-5.2 prompt as two halves (7 layers; figures scaled
    to 78): the same program text both ways. With XLA's default scheduling (its memory-pressure
    tracking on) the temporaries do not fit the device (measured: 99.86 GB required against
    94.75 GB, RESOURCE_EXHAUSTED); with the runtime's ("overlap") it compiles at 92.9 GiB and
    hides 388.2 of its 405.4 ms of collectives. (At 8K chunks the two schedules are now the
    same: at 120K in one pass both hide 47.0 of 115.1 ms, since the page selection's sorts,
    whose temporaries were [16384, 1025] pairs a half, became a kernel; 38.1 against 5.0
    before.)"""
    device = compile_only_devices("tpu7x-16")[0]
    case = PhaseCase("prefill_logits", 1015808 + 32768, 1, 1015808)
    runs = {schedule: run_case(case, model="glm-5.2", layers=7, chunk=32768, page_size=64,
                               kv_cache_dtype="fp8_e4m3", topology="tpu7x-16",
                               clock_hz=compiler_clock_hz(device), tpu_schedule=schedule)
            for schedule in ("xla", "overlap")}
    assert not runs["xla"]["compiled"]
    assert "RESOURCE_EXHAUSTED" in runs["xla"]["error"], runs["xla"]["error"]
    r = runs["overlap"]
    assert r["compiled"], r["error"]
    assert r["peak_bytes"] <= 96 * GIB, r["peak_bytes"]
    hidden = sum(p["hidden_s"] for p in r["phases"].values())
    ici = sum(p["collective_s"] for p in r["phases"].values())
    assert hidden >= 0.6 * ici, (hidden, ici)


@pytest.mark.slow
def test_two_halves_hide_the_mlps_collectives_that_one_pass_leaves_exposed():
    """The 8K chunk of a GLM-5.2 prompt at 0 (5 layers, scaled to 78), in one pass and as
    two halves (cp_runtime.model.halves). Measured, the MLP's rows in fp8, the query rows
    written in the attention's layout, the shared experts in their kernel and the page
    selection's ranks in theirs: of the MLP's all-gathers and reduce-scatters (the dense
    phase's 40.3 ms of ICI; 42.6 as halves), 1.3 ms hidden in one pass and 34.1 ms as halves
    (33.8 before the shared experts' kernel); the chunk's overlapped time 171.7 -> 147.3 ms
    (184.1 -> 161.0 before that kernel), its serial time 210.4 -> 233.4 ms (every weight read
    twice)."""
    device = compile_only_devices("tpu7x-16")[0]
    case = PhaseCase("prefill_logits", 8192, 1, 0)
    runs = {halves: run_case(case, model="glm-5.2", layers=None, chunk=8192, page_size=64,
                             kv_cache_dtype="fp8_e4m3", topology="tpu7x-16",
                             clock_hz=compiler_clock_hz(device), chunk_halves=halves)
            for halves in ("off", "on")}
    for r in runs.values():
        assert r["compiled"], r["error"]
        assert r["peak_bytes"] <= 96 * GIB, r["peak_bytes"]
    dense = {h: r["phases"]["dense"] for h, r in runs.items()}
    assert dense["off"]["hidden_s"] <= 0.05 * dense["off"]["collective_s"], dense["off"]
    assert dense["on"]["hidden_s"] >= 0.4 * dense["on"]["collective_s"], dense["on"]
    # the two halves read every weight twice, and still finish sooner
    assert runs["on"]["seconds"] > runs["off"]["seconds"]
    assert runs["on"]["overlapped_s"] <= 0.95 * runs["off"]["overlapped_s"], (
        runs["on"]["overlapped_s"], runs["off"]["overlapped_s"])


@pytest.mark.slow
def test_the_pages_gathered_ahead_move_beside_the_indexer_kernels():
    """The 8K chunk of a GLM-5.2 prompt at 120K as two halves, 7 layers (layer 3 gathers its
    own pages and 4's beside its indexer kernels, 5's and 6's in the chain, beside 3's and 4's
    attention; figures scaled to 78). Measured, the indexer in fp8: 17.7 of the kv_gather's
    21.5 ms hidden (19.3 before each layer's q weights were gathered in the layer before it,
    16.0 with four layers gathered beside the bf16 kernels, 6.5 before the pages were gathered
    ahead), the overlapped chunk 163.3 ms with the selection's ranks in their kernel (163.1
    with XLA's sorts, priced at nothing; 176.1 before the shared experts' kernel, 177.2 before
    the query rows were written in the attention's layout), peak 87.6 GiB."""
    device = compile_only_devices("tpu7x-16")[0]
    case = PhaseCase("prefill_logits", 122880 + 8192, 1, 122880)
    r = run_case(case, model="glm-5.2", layers=7, chunk=8192, page_size=64,
                 kv_cache_dtype="fp8_e4m3", topology="tpu7x-16",
                 clock_hz=compiler_clock_hz(device), chunk_halves="on")
    assert r["compiled"], r["error"]
    assert r["peak_bytes"] <= 96 * GIB, r["peak_bytes"]
    kv = r["phases"]["kv_gather"]
    assert kv["hidden_s"] >= 0.6 * kv["collective_s"], kv


def _chunk_dense_figures(chunk: int, **layouts: dict) -> dict:
    """The chunk at 0 of a GLM-5.2 prompt (5 layers, scaled to 78), compiled once per layout
    (RuntimeConfig fields): its dense phase's figures, after checking it fits."""
    device = compile_only_devices("tpu7x-16")[0]
    case = PhaseCase("prefill_logits", chunk, 1, 0)
    dense = {}
    for name, layout in layouts.items():
        r = run_case(case, model="glm-5.2", layers=None, chunk=chunk, page_size=64,
                     kv_cache_dtype="fp8_e4m3", topology="tpu7x-16",
                     clock_hz=compiler_clock_hz(device), **layout)
        assert r["compiled"], r["error"]
        assert r["peak_bytes"] <= 96 * GIB, r["peak_bytes"]
        dense[name] = r["phases"]["dense"]
    return dense


@pytest.mark.slow
def test_experts_regrouped_for_a_prompt_compile_and_run_fewer_rows():
    """The 2K chunk at 0, its experts in one group and regrouped into 8 for the prompt
    (`prefill_expert_groups`, the TPU7x configuration's prefill program): both compile and
    fit, with the stacks split two ways and a group's extra passes in a loop. In 8 groups each
    device gathers, runs and sums back about an eighth of the (token, expert) rows: measured,
    the dense phase's time with the unpriced work (the rows' gathers and scatters) 38.5 ->
    30.5 ms, its serial time 34.4 -> 29.9 ms. (At 32K chunks, where XLA:TPU moves the rows on
    the SparseCores, 360 -> 156 ms a chunk: docs/notes/2026-12-07-expert-groups.md, "The experts in
    groups, as the runtime runs them".) A 2K chunk: the 8K one compiled twice took 4 minutes of CI.
    Slow (two compiles, about 2.5 minutes of CI on a 2-core machine): the default run keeps
    the exchanges' compile, and the TPU compile set runs this one."""
    dense = _chunk_dense_figures(2048, one={}, regrouped={"prefill_expert_groups": 8})
    one, regrouped = dense["one"], dense["regrouped"]
    assert regrouped["with_unpriced_s"] <= 0.9 * one["with_unpriced_s"], dense
    assert regrouped["seconds"] < one["seconds"], dense


def test_the_experts_exchange_compiles_a_layer_at_a_time_and_sends_seven_eighths():
    """The exchange of GLM-5.2's routed experts into 8 groups before a prompt and back after
    it (`prefill_expert_groups`, cp_runtime.weights.regroup), one MoE layer's program each:
    both compile; each device sends 7/8 of its slice of the layer's stacks (fp8 values and
    their scales), and holds at most four times the layer's slice at its peak (measured 3.7
    in, 3.0 back), not the whole model's experts twice. Times the 75 MoE layers, the ICI
    rate gives 0.14 s in and 0.24 s back (measured 0.137 and 0.239)."""
    clock = compiler_clock_hz(compile_only_devices("tpu7x-16")[0])
    exchanges = run_exchanges(model="glm-5.2", topology="tpu7x-16", groups=8, clock_hz=clock)
    layer_slice = (256 * 3 * 6144 * 2048) / 16                     # fp8 values, one device
    for name, figures in exchanges.items():
        assert figures["peak_bytes"] <= 4 * layer_slice * 1.01, (name, figures)
    # Each direction at least the bytes' ICI time (7/8 of the slice, 75 layers), at most 2x.
    least = 75 * 7 / 8 * layer_slice / 300e9
    assert least <= exchanges["experts_to_groups"]["seconds"] <= 2 * least, exchanges
    assert least <= exchanges["experts_to_one"]["seconds"] <= 2 * least, exchanges


@pytest.mark.slow
def test_a_prompts_regrouped_experts_run_as_eight_held_groups():
    """The 8K chunk at 0 with the experts regrouped into 8 (device d in group d mod 8) against
    8 groups as placed (`expert_groups`, d in group d // 2): the same kernels and collectives,
    so the same dense-phase figures to 1%; both fit. Slow: two compiles."""
    dense = _chunk_dense_figures(8192, grouped={"expert_groups": 8},
                                 regrouped={"prefill_expert_groups": 8})
    grouped, regrouped = dense["grouped"], dense["regrouped"]
    for key in ("kernel_bytes", "ici_bytes", "seconds", "with_unpriced_s"):
        assert regrouped[key] == pytest.approx(grouped[key], rel=0.01), (key, dense)
