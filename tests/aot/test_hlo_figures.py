"""Figures read off compiled TPU modules (cp_runtime.aot.hlo, phases, roofline, cases): MXU flops
of matmuls as XLA:TPU writes them (batched ones as dilated convolutions), HBM bytes of slices and
in-place updates, per-layer scaling to a whole model, the compiler's clock, and the prefill sum
over chunks."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot import hlo, topology
from cp_runtime.aot.cases import (PREFILL_PROGRAM, PhaseCase, case_matrix, prefill_seconds,
                                  size_label)
from cp_runtime.aot.phases import (PhaseFigures, layer_figures, layers_covering_kinds,
                                   model_figures)
from cp_runtime.aot.programs import cut_model
from cp_runtime.aot.roofline import TPU7X_DEVICE, phase_time
from cp_runtime.config import load_model_config

GLM = load_model_config("glm-5.2")

needs_libtpu = pytest.mark.skipif(not topology.has_libtpu(), reason="needs libtpu (tpu extra)")


@pytest.fixture(scope="module")
def device():
    return topology.compile_only_devices("tpu7x-16")[0]


def _module(fn, device, *shapes):
    args = [jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device)) for s, d in shapes]
    with jax.default_device(device):
        compiled = jax.jit(fn).lower(*args).compile()
    return hlo.parse_module(compiled.as_text()), compiled


def _entry_flops(module) -> dict:
    out: dict = {}
    for ins in module.computations[module.entry]:
        for k, v in hlo.matmul_flops(ins, module).items():
            out[k] = out.get(k, 0) + v
    return out


@needs_libtpu
def test_matmul_flops_plain_batched_and_fp8(device):
    m, _ = _module(lambda a, b: a @ b, device, ((256, 512), jnp.bfloat16),
                   ((512, 384), jnp.bfloat16))
    assert _entry_flops(m) == {"bf16": 2 * 256 * 512 * 384}
    # "...hn,hnc->...hc" (the absorbed W_uk): XLA:TPU writes it as a convolution whose window
    # is dilated over the heads; every tap that lands on a hole must not count.
    m, _ = _module(lambda q, w: jnp.einsum("bhn,hnc->bhc", q, w), device,
                   ((8, 4, 192), jnp.bfloat16), ((4, 192, 512), jnp.bfloat16))
    assert _entry_flops(m) == {"bf16": 2 * 8 * 4 * 192 * 512}
    m, _ = _module(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32), device,
                   ((256, 512), jnp.float8_e4m3fn), ((512, 384), jnp.float8_e4m3fn))
    assert _entry_flops(m) == {"f8": 2 * 256 * 512 * 384}


@needs_libtpu
def test_a_slice_of_a_big_array_counts_its_bytes_not_the_array(device):
    def rows(table, i):
        return jax.lax.dynamic_slice_in_dim(table, i, 8) * 2

    m, _ = _module(rows, device, ((65536, 1024), jnp.float32), ((), jnp.int32))
    total = sum(hlo.hbm_bytes(i, m) for i in m.computations[m.entry])
    # 8 rows read and 8 written; far below the 256 MiB table
    assert 2 * 8 * 1024 * 4 <= total <= 4 * 8 * 1024 * 4 + 1024


@needs_libtpu
def test_an_in_place_update_counts_the_update_not_the_buffer(device):
    def update(buf, rows, i):
        return jax.lax.dynamic_update_slice_in_dim(buf, rows, i, 0)

    args = ((65536, 1024), jnp.float32), ((8, 1024), jnp.float32), ((), jnp.int32)
    sds = [jax.ShapeDtypeStruct(s, d, sharding=SingleDeviceSharding(device)) for s, d in args]
    with jax.default_device(device):
        compiled = jax.jit(update, donate_argnums=(0,)).lower(*sds).compile()
    m = hlo.parse_module(compiled.as_text())
    total = sum(hlo.hbm_bytes(i, m) for i in m.computations[m.entry])
    assert 0 < total <= 4 * 8 * 1024 * 4


@needs_libtpu
def test_the_compiler_clock_turns_a_matmuls_cycles_into_its_time(device):
    from cp_runtime.aot.roofline import compiler_clock_hz

    clock = compiler_clock_hz(device)
    assert 1e9 < clock < 5e9
    m, compiled = _module(lambda a, b: a @ b, device, ((4096, 4096), jnp.bfloat16),
                          ((4096, 4096), jnp.bfloat16))
    cycles = sum(i.cycles for i in m.computations[m.entry])
    optimal = compiled.cost_analysis()["optimal_seconds"]
    assert cycles / clock == pytest.approx(optimal, rel=0.25)


def test_layer_kinds_and_the_cut_that_covers_them():
    # GLM-5.2: layers 0-2 dense with an indexer, 3 MoE with one, 4 MoE sharing layer 3's
    assert layers_covering_kinds(GLM) == 5
    assert layers_covering_kinds(load_model_config("deepseek-v3.2")) == 4


def test_model_figures_scale_each_layer_kind_by_its_count():
    cut = cut_model(GLM, 5)
    by_key = {(layer, "dense"): PhaseFigures(cycles=10 * (layer + 1)) for layer in range(5)}
    by_key[(None, "sampling")] = PhaseFigures(cycles=7)
    scaled = model_figures(by_key, cut, GLM)
    dense = 3 * (10 + 20 + 30) / 3                       # 3 dense layers, as the cut's mean
    moe_full = (GLM.num_full_layers - 3) * 40             # layer 3 stands for them
    moe_shared = (GLM.num_hidden_layers - GLM.num_full_layers) * 50
    assert scaled["dense"].cycles == pytest.approx(dense + moe_full + moe_shared)
    assert scaled["sampling"].cycles == 7
    with pytest.raises(ValueError, match="no layer of kind"):
        model_figures(by_key, cut_model(GLM, 4), GLM)


def test_phase_time_floor_and_fraction():
    r = TPU7X_DEVICE
    f = PhaseFigures(cycles=2e9, xla_bytes=r.hbm_bytes_per_s, mxu_flops=r.bf16_flops / 2,
                     kernel_bytes=r.hbm_bytes_per_s, ici_bytes=r.ici_bytes_per_s / 4,
                     collectives=2)
    t = phase_time(f, r, clock_hz=1e9)
    assert t.xla_s == 2 and t.kernel_s == 1
    assert t.collective_s == pytest.approx(0.25 + 2 * r.collective_latency_s)
    assert t.hbm_floor_s == 2 and t.mxu_floor_s == 0.5 and t.ici_floor_s == 0.25
    assert t.floor_s == 2 and t.bound == "HBM"
    assert t.fraction == pytest.approx(2 / t.seconds)
    f8 = phase_time(dataclasses.replace(PhaseFigures(), mxu_flops=r.fp8_flops,
                                        mxu_flops_f8=r.fp8_flops), r, 1e9)
    assert f8.mxu_floor_s == 1


def test_a_kernel_named_fp8_runs_its_flops_at_the_fp8_rate():
    """A Mosaic call whose name ends in FP8_MXU_SUFFIX (kernels/costs.py) multiplies fp8 by
    fp8: its estimate's flops at the fp8 rate, in the phase's time and floor alike; other
    kernels' flops at the bf16 rate."""
    r = TPU7X_DEVICE
    kernels = {name: hlo.Instruction(f"{name}.3", "custom-call", "f32[8,128]", ("p",),
                                     'custom_call_target="tpu_custom_call"')
               for name in ("expert_grouped_matmul_fp8", "expert_grouped_matmul")}
    assert kernels["expert_grouped_matmul_fp8"].fp8_mxu
    assert not kernels["expert_grouped_matmul"].fp8_mxu
    flops = 2 * r.fp8_flops                        # 2 s at the fp8 rate, 4 s at bf16
    both = PhaseFigures(kernels=2, kernel_flops=2 * flops, kernel_flops_f8=flops)
    t = phase_time(both, r, clock_hz=1e9)
    assert t.kernel_s == pytest.approx(2 + 4)
    assert t.mxu_floor_s == pytest.approx(2 + 4)


def test_case_matrix_and_the_prefill_sum():
    cases = case_matrix(chunk=8192)
    names = [c.name for c in cases]
    assert names[:6] == ["decode 128K B=1", "decode 128K B=8", "decode 128K B=32",
                         "decode 1M B=1", "decode 1M B=8", "decode 1M B=32"]
    assert names[6:] == ["prefill @0", "prefill @120K", "prefill @512K", "prefill @1016K"]
    assert {c.program for c in cases[6:]} == {PREFILL_PROGRAM}
    assert PhaseCase(PREFILL_PROGRAM, 8192 * 2, offset=8192).context == 16384
    assert size_label(3000) == "3000"
    rows = [{"program": PREFILL_PROGRAM, "offset": o, "seconds": s}
            for o, s in ((0, 1.0), (120 << 10, 2.0), (512 << 10, 3.0), ((1 << 20) - 8192, 5.0))]
    assert prefill_seconds(rows, 128 << 10, 8192) == pytest.approx(16 * (1 + 2) / 2)
    linear = [{**r, "seconds": 1 + r["offset"] / (1 << 20)} for r in rows]
    assert prefill_seconds(linear, 1 << 20, 8192) == pytest.approx(128 + 127 * 64 / 128)
    # flat after 120K, as the attention kernel's bound: chunks 0..14 on the rising line
    kinked = [{**r, "seconds": min(1 + r["offset"] / (120 << 10), 2.0)} for r in rows]
    assert prefill_seconds(kinked, 1 << 20, 8192) == pytest.approx(15 + 7 + 113 * 2)
    assert prefill_seconds(rows[:1], 1 << 20, 8192) is None


def test_an_async_slice_moves_its_piece():
    """XLA:TPU prefetches a weight into VMEM in async slices: each reads its piece of the
    source once (and writes nothing to HBM when the piece lands in VMEM, `S(1)`), not the
    whole source per slice."""
    text = """HloModule m

ENTRY %main (p: s8[6291456]) -> s8[4194304] {
  %p = s8[6291456]{0:T(1024)} parameter(0)
  %slice-start = ((s8[6291456]{0:T(1024)}), s8[4194304]{0:T(1024)S(1)}, s32[]{:S(2)}) \
slice-start(%p), slice={[0:4194304]}
  %slice-start.1 = ((s8[6291456]{0:T(1024)}), s8[2097152]{0:T(1024)}, s32[]{:S(2)}) \
slice-start(%p), slice={[4194304:6291456]}
  %slice-done = s8[4194304]{0:T(1024)S(1)} slice-done(%slice-start)
  ROOT %slice-done.1 = s8[2097152]{0:T(1024)} slice-done(%slice-start.1)
}
"""
    module = hlo.parse_module(text)
    moved = {i.name: hlo.hbm_bytes(i, module) for i in module.computations[module.entry]}
    assert moved["slice-start"] == 4194304                 # read; written to VMEM
    assert moved["slice-start.1"] == 2 * 2097152           # read and written in HBM


def test_a_kernel_named_vpu_runs_its_flops_at_the_vpu_rate():
    """A Mosaic call whose name ends in VPU_SUFFIX (kernels/page_top_k.py) does vector work:
    its estimate's flops are VPU operations, at the VPU rate in the phase's time and floor,
    and none of them counts as MXU flops."""
    r = TPU7X_DEVICE
    kernel = hlo.Instruction("page_top_k_vpu.2", "custom-call", "f32[8,128]", ("p",),
                             'custom_call_target="tpu_custom_call"')
    assert kernel.vpu and not kernel.fp8_mxu
    t = phase_time(PhaseFigures(kernels=1, kernel_vpu_ops=3 * r.vpu_ops), r, clock_hz=1e9)
    assert t.kernel_s == pytest.approx(3) and t.vpu_floor_s == pytest.approx(3)
    assert t.mxu_floor_s == 0 and t.bound == "VPU"


def test_work_the_compiler_gives_no_price_is_counted_in_its_phase():
    """A sort carries no estimated cycles, nor does a call XLA:TPU moved to the SparseCores
    (a gather here); each is counted as unpriced work in its phase, with the least HBM bytes
    it moves (its result written and as much read); a priced fusion beside them is not."""
    text = """HloModule m

%gathered (x: s32[1024]) -> s32[1024] {
  ROOT %x = s32[1024]{0} parameter(0)
}

ENTRY %main (p: f32[8,256], q: s32[1024]) -> f32[8,256] {
  %p = f32[8,256]{1,0} parameter(0)
  %q = s32[1024]{0} parameter(1)
  %s = f32[8,256]{1,0} sort(%p), dimensions={1}, to_apply=%lt, metadata={op_name="jit(step)/shard_map/layer2/selection/sort"}
  %g = ((s32[1024]{0}), s32[1024]{0}, u32[]) call-start(%q), async_execution_thread="sparsecore", to_apply=%gathered, metadata={op_name="jit(step)/shard_map/layer2/dense/gather"}
  %gd = s32[1024]{0} call-done(%g), metadata={op_name="jit(step)/shard_map/layer2/dense/gather"}
  ROOT %f = f32[8,256]{1,0} fusion(%s), kind=kLoop, calls=%lt, metadata={op_name="jit(step)/shard_map/layer2/selection/add"}, backend_config={"estimated_cycles":"100"}
}
"""
    figures = layer_figures(text, CLOCK_HZ)
    assert figures[(2, "selection")].unpriced == 1
    assert figures[(2, "selection")].unpriced_bytes == 2 * 8 * 256 * 4
    assert figures[(2, "dense")].unpriced == 1
    assert figures[(2, "dense")].unpriced_bytes == 2 * 1024 * 4


def test_an_offloaded_collective_counts_in_its_callers_phase():
    """XLA:TPU moves a collective to the SparseCores as an async call of a computation that
    holds it, where the collective may carry no op_name, and the call's result may first feed
    an op whose name says nothing (`reshape.9`): the collective is its caller's, and that
    caller's phase is read past the bare name (layer 3's merge here)."""
    text = """HloModule m

%offloaded (x: bf16[64,512], t: token[]) -> bf16[64,512] {
  %x = bf16[64,512]{1,0} parameter(0)
  %t = token[] parameter(1)
  ROOT %all-reduce.1 = bf16[64,512]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
}

ENTRY %main (p: bf16[64,512]) -> bf16[64,512] {
  %p = bf16[64,512]{1,0} parameter(0)
  %tok = token[] after-all()
  %start = ((bf16[64,512]{1,0}, token[]), bf16[64,512]{1,0}) call-start(%p, %tok), \
to_apply=%offloaded
  %done = bf16[64,512]{1,0} call-done(%start)
  %r = bf16[64,512]{1,0} copy(%done), metadata={op_name="jit(step)/shard_map/reshape.9"}
  ROOT %m = bf16[64,512]{1,0} negate(%r), metadata={op_name="jit(step)/shard_map/layer3/merge/mul"}
}
"""
    figures = layer_figures(text, CLOCK_HZ)
    assert figures[(3, "merge")].collectives == 1
    assert figures[(3, "merge")].ici_bytes == 64 * 512 * 2 * 2 * 3 // 4
    assert all(f.collectives == 0 for key, f in figures.items() if key != (3, "merge"))


def test_a_relayout_copy_of_a_layers_weight_counts_in_that_layer():
    """XLA names a copy of a weight into another layout (before a kernel that wants it so) by
    the parameter alone: it belongs to the layer and phase of the op that consumes it, so the
    scaling counts it once per layer of its kind, not once a step."""
    text = """HloModule m

ENTRY %main (p: f32[256,48,1]) -> f32[256,48,1] {
  %p = f32[256,48,1]{0,2,1:T(1,128)} parameter(0), \
metadata={op_name="params[\\'model.layers.3.mlp.experts.gate_proj.weight_scale_inv\\']"}
  %c = f32[256,48,1]{2,1,0:T(8,128)} copy(%p), \
metadata={op_name="params[\\'model.layers.3.mlp.experts.gate_proj.weight_scale_inv\\']"}, \
backend_config={"estimated_cycles":"10383"}
  ROOT %m = f32[256,48,1]{2,1,0:T(8,128)} negate(%c), \
metadata={op_name="jit(step)/shard_map/layer3/dense/mul"}
}
"""
    figures = layer_figures(text, CLOCK_HZ)
    assert figures[(3, "dense")].cycles == 10383
    assert (None, "other") not in figures


GROUP = "replica_groups={{" + ",".join(map(str, range(16))) + "}}"
OFFLOADED_GATHER = f"""%offloaded (x: f8e4m3fn[64,64,640], t: token[]) -> f8e4m3fn[1024,64,640] {{
  %x = f8e4m3fn[64,64,640]{{2,1,0}} parameter(0)
  %t = token[] parameter(1)
  ROOT %all-gather.1 = f8e4m3fn[1024,64,640]{{2,1,0}} all-gather(%x), {GROUP}, dimensions={{0}}
}}
"""
CLOCK_HZ = 1e9


def _gather_seconds(module: hlo.Module) -> float:
    """One offloaded page gather's time at TPU7X_DEVICE's rates (bytes and a latency)."""
    ici = hlo.ici_bytes(module.by_name["all-gather.1"])[1]
    return ici / TPU7X_DEVICE.ici_bytes_per_s + TPU7X_DEVICE.collective_latency_s


def test_a_collective_is_hidden_by_the_work_scheduled_beside_it():
    """The entry replayed in order: the TensorCore runs each instruction, one ICI moves the
    collectives in the order they start, and a done waits for its own. The page gather has
    1,500 cycles of work beside it; the psum, started behind it, moves only once the gather
    has, by which time its done is waiting: nothing of it is hidden."""
    text = f"""HloModule m

{OFFLOADED_GATHER}
ENTRY %main (p: f8e4m3fn[64,64,640], q: f32[128,128]) -> f32[128,128] {{
  %p = f8e4m3fn[64,64,640]{{2,1,0}} parameter(0)
  %q = f32[128,128]{{1,0}} parameter(1)
  %tok = token[] after-all()
  %start = ((f8e4m3fn[64,64,640]{{2,1,0}}, token[]), f8e4m3fn[1024,64,640]{{2,1,0}}) \
call-start(%p, %tok), to_apply=%offloaded, \
metadata={{op_name="jit(step)/shard_map/layer2/kv_gather/all_gather"}}
  %work = f32[128,128]{{1,0}} negate(%q), backend_config={{"estimated_cycles":"1000"}}, \
metadata={{op_name="jit(step)/shard_map/layer2/indexer/neg"}}
  %ar = f32[128,128]{{1,0}} all-reduce-start(%work), {GROUP}, to_apply=%add, \
metadata={{op_name="jit(step)/shard_map/layer2/merge/psum"}}
  %more = f32[128,128]{{1,0}} negate(%work), backend_config={{"estimated_cycles":"500"}}, \
metadata={{op_name="jit(step)/shard_map/layer2/indexer/neg"}}
  %done = f8e4m3fn[1024,64,640]{{2,1,0}} call-done(%start)
  %ar.done = f32[128,128]{{1,0}} all-reduce-done(%ar)
  ROOT %out = f32[128,128]{{1,0}} add(%ar.done, %more), \
metadata={{op_name="jit(step)/shard_map/layer2/merge/add"}}
}}
"""
    figures = layer_figures(text, CLOCK_HZ)
    module = hlo.parse_module(text)
    gather_ici = hlo.ici_bytes(module.by_name["all-gather.1"])[1]
    assert gather_ici == 15 * 64 * 64 * 640
    assert figures[(2, "kv_gather")].windows == [[1, gather_ici, 1, pytest.approx(1.5e-6)]]
    assert figures[(2, "merge")].windows == [[1, 128 * 128 * 4 * 2 * 15 // 16, 1,
                                              pytest.approx(0, abs=1e-12)]]
    r = TPU7X_DEVICE
    gather = phase_time(figures[(2, "kv_gather")], r, CLOCK_HZ)
    assert gather.hidden_s == pytest.approx(1.5e-6)
    assert gather.overlapped_s == pytest.approx(gather.seconds - gather.hidden_s)
    assert phase_time(figures[(2, "merge")], r, CLOCK_HZ).hidden_s == pytest.approx(0, abs=1e-12)
    # scaled as every other figure: a window weighs as many layers as its layer stands for
    scaled = PhaseFigures()
    scaled.add(figures[(2, "kv_gather")], 3)
    assert phase_time(scaled, r, CLOCK_HZ).hidden_s == pytest.approx(3 * gather.hidden_s)


def test_collectives_in_flight_together_share_the_work_beside_them():
    """Two page gathers started together, a kernel-long piece of work (1 ms of cycles), then
    both dones: the ICI moves one after the other and the work covers both, so both are
    hidden whole. Work after a collective's done hides nothing of it: the third gather, whose
    done comes first, is exposed whole, and the work after it is left for none."""
    def start(n, layer):
        return (f"  %start.{n} = ((f8e4m3fn[64,64,640]{{2,1,0}}, token[]), "
                f"f8e4m3fn[1024,64,640]{{2,1,0}}) call-start(%p, %tok), to_apply=%offloaded.{n}, "
                f"metadata={{op_name=\"jit(step)/shard_map/layer{layer}/kv_gather/all_gather\"}}")

    def done(n):
        return f"  %done.{n} = f8e4m3fn[1024,64,640]{{2,1,0}} call-done(%start.{n})"

    work = ('  %{0} = f32[128,128]{{1,0}} negate(%q), backend_config={{"estimated_cycles":'
            '"1000000"}}, metadata={{op_name="jit(step)/shard_map/layer1/indexer/neg"}}')
    text = "\n".join([
        "HloModule m", "",
        *(OFFLOADED_GATHER.replace("%offloaded", f"%offloaded.{n}").replace(
            "all-gather.1", f"all-gather.{n}") for n in (1, 2, 3)),
        "ENTRY %main (p: f8e4m3fn[64,64,640], q: f32[128,128]) -> f32[128,128] {",
        "  %p = f8e4m3fn[64,64,640]{2,1,0} parameter(0)",
        "  %q = f32[128,128]{1,0} parameter(1)", "  %tok = token[] after-all()",
        start(1, 1), start(2, 2), work.format("w1"), done(1), done(2),
        start(3, 3), done(3), work.format("w2"),
        "  ROOT %out = f32[128,128]{1,0} add(%w1, %w2)", "}", ""])
    figures = layer_figures(text, CLOCK_HZ)
    gather = _gather_seconds(hlo.parse_module(text))
    assert 2 * gather < 1e-3                           # the work outlasts both gathers
    hidden = {layer: phase_time(figures[(layer, "kv_gather")], TPU7X_DEVICE, CLOCK_HZ)
              for layer in (1, 2, 3)}
    assert hidden[1].hidden_s == pytest.approx(gather)
    assert hidden[2].hidden_s == pytest.approx(gather)
    assert hidden[3].hidden_s == pytest.approx(0, abs=1e-12)


def test_a_collective_permute_start_moves_its_destination_not_its_contexts():
    """XLA:TPU's collective-permute-start returns (source, destination, u32[] context,
    u32[] context): what it moves is the destination, not the last (scalar) member."""
    line = ("  %cp = (f8e4m3fn[1026,64,640]{2,1,0}, f8e4m3fn[1026,64,640]{2,1,0}, u32[]{:S(2)}, "
            "u32[]{:S(2)}) collective-permute-start(%x), channel_id=1, "
            "source_target_pairs={{0,1},{1,0}}")
    text = ("HloModule m\n\nENTRY %main (x: f8e4m3fn[1026,64,640]) -> f8e4m3fn[1026,64,640] {\n"
            "  %x = f8e4m3fn[1026,64,640]{2,1,0} parameter(0)\n" + line + "\n"
            "  ROOT %d = f8e4m3fn[1026,64,640]{2,1,0} collective-permute-done(%cp)\n}\n")
    module = hlo.parse_module(text)
    assert hlo.ici_bytes(module.by_name["cp"]) == (1026 * 64 * 640, 1026 * 64 * 640)
    assert hlo.last_array_bytes("f32[]") == 4          # a scalar result is still counted


def test_the_unpriced_work_replayed_at_the_hbm_rate():
    """The hand model of the unpriced work (`with_unpriced_s`): a SparseCore gather runs
    beside the TensorCore at its least bytes at the HBM rate, so the 1,000 cycles of work
    scheduled before its done hide that much of it and the done waits for the rest; a sort
    runs on the TensorCore at its bytes. The compiler's own figures stay as they were."""
    n = 1 << 20
    text = f"""HloModule m

%gathered (x: s32[{n}]) -> s32[{n}] {{
  ROOT %x = s32[{n}]{{0}} parameter(0)
}}

ENTRY %main (p: f32[8,256], q: s32[{n}]) -> f32[8,256] {{
  %p = f32[8,256]{{1,0}} parameter(0)
  %q = s32[{n}]{{0}} parameter(1)
  %g = ((s32[{n}]{{0}}), s32[{n}]{{0}}, u32[]) call-start(%q), async_execution_thread="sparsecore", to_apply=%gathered, metadata={{op_name="jit(step)/shard_map/layer2/dense/gather"}}
  %work = f32[8,256]{{1,0}} negate(%p), backend_config={{"estimated_cycles":"1000"}}, metadata={{op_name="jit(step)/shard_map/layer2/dense/neg"}}
  %gd = s32[{n}]{{0}} call-done(%g), metadata={{op_name="jit(step)/shard_map/layer2/dense/gather"}}
  ROOT %s = f32[8,256]{{1,0}} sort(%work), dimensions={{1}}, to_apply=%lt, metadata={{op_name="jit(step)/shard_map/layer2/selection/sort"}}
}}
"""
    figures = layer_figures(text, CLOCK_HZ)
    r = TPU7X_DEVICE
    dense, selection = figures[(2, "dense")], figures[(2, "selection")]
    gather_s = 2 * n * 4 / r.hbm_bytes_per_s
    assert gather_s > 1000 / CLOCK_HZ                  # the work hides only part of it
    assert dense.sparsecore_bytes == dense.unpriced_bytes == 2 * n * 4
    assert dense.unpriced_waits == pytest.approx(gather_s - 1000 / CLOCK_HZ)
    t = phase_time(dense, r, CLOCK_HZ)
    assert t.unpriced_tc_s == 0 and t.overlapped_s == pytest.approx(1000 / CLOCK_HZ)
    assert t.with_unpriced_s == pytest.approx(gather_s)
    sort = phase_time(selection, r, CLOCK_HZ)
    assert selection.sparsecore_bytes == 0 and selection.unpriced_waits == 0
    assert sort.with_unpriced_s == pytest.approx(2 * 8 * 256 * 4 / r.hbm_bytes_per_s)
    assert sort.overlapped_s == 0


def test_the_report_names_what_it_left_unpriced():
    """`cp-runtime compile`'s case report ends with the unpriced work per phase and the least
    time its bytes take at the HBM rate, or says there is none."""
    from cp_runtime.aot.report import _unpriced_line
    nbytes = TPU7X_DEVICE.hbm_bytes_per_s / 1000                       # 1 ms of HBM
    line = _unpriced_line({"dense": {"unpriced": 30, "unpriced_bytes": nbytes},
                           "selection": {"unpriced": 0, "unpriced_bytes": 0}})
    assert "dense 30" in line and "selection" not in line and "1.000 ms" in line, line
    assert "none" in _unpriced_line({"dense": {"unpriced": 0}})
