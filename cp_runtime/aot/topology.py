"""Compile-only TPU devices for a slice named as the capacity command names it (`tpu7x-16`).

libtpu is loaded here and nowhere else on a machine without a TPU: `import jax` alone never
touches it while JAX_PLATFORMS keeps JAX on the CPU (cp_runtime.platform), and only
`compile_only_devices` asks libtpu for a topology. Its start-up warnings about
TPU_ACCELERATOR_TYPE and worker hostnames mean nothing for a compile-only topology.
"""

from __future__ import annotations

import importlib.util
import os

from cp_runtime.cache.capacity import TOPOLOGIES, Topology

__all__ = ["TPUCompilerMissing", "compile_only_devices", "has_libtpu", "topology"]


class TPUCompilerMissing(RuntimeError):
    """libtpu (the `tpu` extra) is not installed, so nothing can be compiled for a TPU."""


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def topology(name: str) -> Topology:
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; choices: {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[name]


def compile_only_devices(name: str) -> list:
    """The `TPU7x` devices of topology `name` (`tpu7x-16`: 16 devices, 2x2x2 chips), for
    lowering and compiling only. Raises TPUCompilerMissing without libtpu."""
    topo = topology(name)
    if not has_libtpu():
        raise TPUCompilerMissing(
            "compiling for a TPU needs libtpu: install the tpu extra "
            "(pip install -e '.[tpu]')")
    # Two processes holding libtpu at once (a test run and a server, say) are fine for
    # compile-only use; libtpu refuses the second without this.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="tpu", topology_name=f"tpu7x:{topo.shape}")
    devices = list(desc.devices)
    if len(devices) != topo.devices:
        raise RuntimeError(f"topology {name} gave {len(devices)} devices, expected "
                           f"{topo.devices}")
    return devices
