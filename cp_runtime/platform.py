"""Where JAX runs when nobody says: on the CPU, unless this machine has TPU chips.

With the `tpu` extra installed, JAX's first use of a backend starts libtpu, which on a machine
without a TPU looks for one (metadata lookups, TPU_* environment variables) and prints a page of
warnings about accelerator types and worker hostnames before falling back to the CPU. The
command line and the tests call `keep_jax_off_absent_tpus()` before any JAX backend starts, so
on such a machine libtpu is loaded only by `cp-runtime compile` (cp_runtime.aot.topology), which
needs its compiler and not its devices. An explicit JAX_PLATFORMS always wins.
"""

from __future__ import annotations

import glob
import os

import jax

__all__ = ["tpu_chips_present", "keep_jax_off_absent_tpus"]

# Device nodes of TPU chips: /dev/accel* (v2-v4), /dev/vfio/N (v5e and later, v7x included).
_TPU_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*")


def tpu_chips_present() -> bool:
    return any(glob.glob(pattern) for pattern in _TPU_DEVICE_NODES)


def keep_jax_off_absent_tpus() -> None:
    """Set JAX's platforms to "cpu" when JAX_PLATFORMS is unset and no TPU chip is attached;
    a no-op otherwise (and once a JAX backend has started, which it cannot change)."""
    if os.environ.get("JAX_PLATFORMS") or tpu_chips_present():
        return
    jax.config.update("jax_platforms", "cpu")
