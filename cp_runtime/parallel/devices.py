"""Devices for the `cp` mesh: on a CPU, virtual devices asked for before JAX starts."""

from __future__ import annotations

import os

import jax

from cp_runtime.kernels.packing import interpret_pool_threads

__all__ = ["init_cpu_devices"]


def init_cpu_devices(count: int = 16) -> None:
    """Ask for `count` virtual CPU devices; call before JAX is first used. If JAX has already
    started (inside a report, or a test session), keep what it has and refuse if that is
    fewer than `count`. Sizes XLA's CPU thread pool to twice the device count and one
    (interpret-mode kernels on every device at once can deadlock otherwise: kernels/packing.py). Harmless where the
    default backend is a TPU: it only shapes the CPU backend."""
    os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1,
                                                interpret_pool_threads(count))))
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:              # JAX refuses a different count once it has started
        pass
    if jax.device_count() < count:
        raise ValueError(f"{count} devices needed, JAX has {jax.device_count()} (on CPU, set "
                         "the count before any other JAX use)")
