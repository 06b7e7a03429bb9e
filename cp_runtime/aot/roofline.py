"""Seconds and floors of a step phase on one TPU7x device, from the compiler's figures
(cp_runtime.aot.phases).

Rates of one device (a TensorCore; a TPU7x chip has two). Per chip, Cloud TPU's TPU7x page:
2307 TFLOP/s bf16, 4614 fp8, 192 GiB HBM at 7.37 TB/s, 1.2 TB/s bidirectional ICI. A device
gets half of each, and a ring collective sends at half the bidirectional ICI rate: 1154 / 2307
TFLOP/s, 3.69 TB/s, 300 GB/s one way.

The compiler's clock: XLA:TPU prices its own instructions in `estimated_cycles`, and the
module's `optimal_seconds` for programs it can time. `compiler_clock_hz` reads both off a
reference bf16 matmul (8192^3) compiled alone, so cycles / clock are the compiler's seconds.

Per phase:

    estimate   tensor_core_s = XLA cycles / clock + each Mosaic call's roofline (its cost
               estimate's flops at the bf16 rate or bytes at HBM rate, whichever is longer:
               Mosaic gives no cycles, so a kernel is taken at its roofline, i.e. at its floor;
               a VPU kernel's flops are VPU operations, at TPU7X_VPU_OPS_PER_S);
               collective_s = ICI bytes / ICI rate + a latency per collective (the compiler
               gives no collective time; COLLECTIVE_LATENCY_S is an assumption);
               seconds = tensor_core_s + collective_s (collectives run on the SparseCores and
               may overlap the TensorCore's work; the sum is the bound without overlap)
    hidden     what of collective_s the compiled schedule has work beside (phases'
               `windows`): the entry replayed in its order, the TensorCore running each
               instruction (priced as above) and one ICI moving the collectives one after
               another in the order they start; a collective's time is hidden but for the
               waits of the dones while it moves. overlapped_s = seconds - hidden_s, the
               estimate if the SparseCores moved the bytes while the TensorCore ran that
               work, neither slowing the other
    with_unpriced   a hand model of the work XLA:TPU gives no price (phases' `unpriced`):
               the same replay with that work at its least bytes at HBM bandwidth, sorts and
               rewritten scatters on the TensorCore (unpriced_tc_s), the SparseCore calls on a
               resource of their own beside it; with_unpriced_s = tensor_core_s +
               unpriced_tc_s + the TensorCore's waits on the ICI and the SparseCores then
               (unpriced_waits_s). An assumption twice over: the bytes are the least such
               work moves, and the SparseCores' own rate is not known here
    floor      the longest of: flops at the MXU rate of their dtype (fp8 x fp8 at the fp8 rate,
               everything else at bf16), HBM bytes at HBM bandwidth, ICI bytes at ICI rate,
               VPU kernels' operations at the VPU rate
    fraction   floor / seconds (1.0: the phase runs at the speed of its own bytes or flops)

The floor is the phase's own: the compiled program's flops and bytes. A floor of the
necessary work (fp8 weights read once, say) is the hand model's (`bench tpu_model`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from cp_runtime.aot import hlo

__all__ = ["DeviceRates", "TPU7X_CHIP", "TPU7X_DEVICE", "COLLECTIVE_LATENCY_S", "PhaseTime",
           "collective_seconds", "kernel_seconds", "hidden_seconds", "phase_time",
           "compiler_clock_hz"]

TFLOP = 1e12
# Per chip. Cloud TPU docs, "TPU7x (Ironwood)" (docs.cloud.google.com/tpu/docs/tpu7x): peak
# bf16 2307 and fp8 4614 TFLOP/s, 192 GiB HBM, 2 TensorCores. HBM bandwidth and ICI: Google's
# Ironwood announcement (7.37 TB/s; 1.2 TB/s bidirectional ICI).
TPU7X_CHIP = {"bf16_flops": 2307 * TFLOP, "fp8_flops": 4614 * TFLOP, "hbm_bytes": 192 * 2**30,
              "hbm_bytes_per_s": 7.37e12, "ici_bidir_bytes_per_s": 1.2e12, "cores": 2}
COLLECTIVE_LATENCY_S = 10e-6      # an assumption, as `bench tpu_model --collective-us`
# VPU element operations a second of one device: no published figure. Measured: the page top-k
# kernel (kernels/page_top_k.py; 32 rounds x 6 ops over [1032, 16384] f32, VMEM-resident) ran
# 0.821 ms on a TPU v5e, 3.95e12 ops/s, 2,310 a cycle of that compiler's clock (1.712 GHz,
# `compiler_clock_hz`); TPU7x is taken to do as many a cycle of its own (2.359 GHz): an
# assumption only a TPU7x can check.
TPU7X_VPU_OPS_PER_S = 2310 * 2.359e9


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """One device's peak rates: flop/s by dtype, HBM bytes/s, ICI bytes/s one way, VPU
    operations/s."""

    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    collective_latency_s: float = COLLECTIVE_LATENCY_S
    vpu_ops: float = TPU7X_VPU_OPS_PER_S


def _tpu7x_device() -> DeviceRates:
    c, per = TPU7X_CHIP, 1 / TPU7X_CHIP["cores"]
    return DeviceRates(bf16_flops=c["bf16_flops"] * per, fp8_flops=c["fp8_flops"] * per,
                       hbm_bytes_per_s=c["hbm_bytes_per_s"] * per,
                       ici_bytes_per_s=c["ici_bidir_bytes_per_s"] / 2 * per)


TPU7X_DEVICE = _tpu7x_device()


@dataclasses.dataclass(frozen=True)
class PhaseTime:
    """A phase's estimate and floor in seconds (the module docstring says how each is made)."""

    xla_s: float
    kernel_s: float
    collective_s: float
    mxu_floor_s: float
    hbm_floor_s: float
    ici_floor_s: float
    hidden_s: float = 0.0
    vpu_floor_s: float = 0.0
    unpriced_tc_s: float = 0.0
    unpriced_waits_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.xla_s + self.kernel_s + self.collective_s

    @property
    def overlapped_s(self) -> float:
        return self.seconds - self.hidden_s

    @property
    def with_unpriced_s(self) -> float:
        return self.xla_s + self.kernel_s + self.unpriced_tc_s + self.unpriced_waits_s

    @property
    def floor_s(self) -> float:
        return max(self.mxu_floor_s, self.hbm_floor_s, self.ici_floor_s, self.vpu_floor_s)

    @property
    def bound(self) -> str:
        parts = {"MXU": self.mxu_floor_s, "HBM": self.hbm_floor_s, "ICI": self.ici_floor_s,
                 "VPU": self.vpu_floor_s}
        return max(parts, key=parts.get) if any(parts.values()) else "-"

    @property
    def fraction(self) -> float | None:
        return self.floor_s / self.seconds if self.seconds > 0 else None

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "seconds": self.seconds, "floor_s": self.floor_s,
                "bound": self.bound, "fraction": self.fraction,
                "overlapped_s": self.overlapped_s, "with_unpriced_s": self.with_unpriced_s}


def kernel_seconds(flops: float, nbytes: float, rates: DeviceRates, fp8: bool = False,
                   vpu: bool = False) -> float:
    """A Mosaic call at its roofline: its flops at the bf16 rate (fp8: the fp8 rate; vpu: VPU
    operations at the VPU's) or its bytes at HBM rate."""
    rate = rates.vpu_ops if vpu else rates.fp8_flops if fp8 else rates.bf16_flops
    return max(flops / rate, nbytes / rates.hbm_bytes_per_s)


def collective_seconds(ici_bytes: float, collectives: float, rates: DeviceRates) -> float:
    """Collectives' time: their bytes at the ICI rate and a latency each."""
    return ici_bytes / rates.ici_bytes_per_s + collectives * rates.collective_latency_s


def hidden_seconds(windows, rates: DeviceRates) -> float:
    """Collective time with work beside it (module docstring), over phases' `windows`: each
    collective's hidden seconds as the timeline found them, at most its time at `rates`."""
    return sum(weight * min(collective_seconds(ici, count, rates), hidden)
               for weight, ici, count, hidden in windows)


def phase_time(f, rates: DeviceRates, clock_hz: float) -> PhaseTime:
    """The estimate and floor of one phase's figures `f` (cp_runtime.aot.phases.PhaseFigures)."""
    bf16_flops = f.mxu_flops - f.mxu_flops_f8 + f.kernel_flops - f.kernel_flops_f8
    f8_flops = f.mxu_flops_f8 + f.kernel_flops_f8
    kernel_mxu_s = ((f.kernel_flops - f.kernel_flops_f8) / rates.bf16_flops
                    + f.kernel_flops_f8 / rates.fp8_flops)
    return PhaseTime(
        xla_s=f.cycles / clock_hz,
        kernel_s=max(kernel_mxu_s + f.kernel_vpu_ops / rates.vpu_ops,
                     f.kernel_bytes / rates.hbm_bytes_per_s),
        collective_s=collective_seconds(f.ici_bytes, f.collectives, rates),
        mxu_floor_s=bf16_flops / rates.bf16_flops + f8_flops / rates.fp8_flops,
        hbm_floor_s=(f.xla_bytes + f.kernel_bytes) / rates.hbm_bytes_per_s,
        ici_floor_s=f.ici_bytes / rates.ici_bytes_per_s,
        hidden_s=hidden_seconds(f.windows, rates),
        vpu_floor_s=f.kernel_vpu_ops / rates.vpu_ops,
        unpriced_tc_s=(f.unpriced_bytes - f.sparsecore_bytes) / rates.hbm_bytes_per_s,
        unpriced_waits_s=f.unpriced_waits)


@functools.lru_cache(maxsize=None)
def compiler_clock_hz(device) -> float:
    """Cycles per second of the compiler's cost model on `device` (a compile-only TPU device):
    the estimated cycles of a bf16 8192^3 matmul compiled alone over its optimal_seconds."""
    n = 8192
    x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=SingleDeviceSharding(device))
    with jax.default_device(device):
        compiled = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
    module = hlo.parse_module(compiled.as_text())
    cycles = sum(i.cycles for i in module.computations[module.entry])
    seconds = (compiled.cost_analysis() or {}).get("optimal_seconds")
    if not cycles or not seconds or seconds <= 0:
        raise RuntimeError("the compiler gave no cycles or time for the reference matmul")
    return cycles / seconds
