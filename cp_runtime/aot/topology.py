"""Compile-only TPU devices for a slice named as the capacity command names it (`tpu7x-16`).

libtpu is loaded here and nowhere else on a machine without a TPU: `import jax` alone never
touches it while JAX_PLATFORMS keeps JAX on the CPU (cp_runtime.platform), and only
`compile_only_devices` asks libtpu for a topology. On such a machine libtpu's start-up writes
a page of warnings to the process's stderr (no TPU_ACCELERATOR_TYPE, an `E0000 ...
INVALID_ARGUMENT` about TPU_WORKER_HOSTNAMES) that mean nothing for a compile-only topology.
libtpu writes them before its logging starts, so TPU_STDERR_LOG_LEVEL and TPU_MIN_LOG_LEVEL do
not reach them; `compile_only_devices` sends file descriptor 2 to a temporary file while libtpu
starts and shows what it caught only if the topology fails to load. On a machine with TPU
chips nothing is hidden.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile

from cp_runtime.cache.capacity import TOPOLOGIES, Topology
from cp_runtime.platform import tpu_chips_present

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

    with _start_up_quietly(not tpu_chips_present()):
        desc = topologies.get_topology_desc(platform="tpu",
                                            topology_name=f"tpu7x:{topo.shape}")
    devices = list(desc.devices)
    if len(devices) != topo.devices:
        raise RuntimeError(f"topology {name} gave {len(devices)} devices, expected "
                           f"{topo.devices}")
    return devices


@contextlib.contextmanager
def _start_up_quietly(quiet: bool):
    """With `quiet`, file descriptor 2 (libtpu's C++ writes to it, not to sys.stderr) goes to
    a temporary file for the block; what it caught is written to stderr if the block raises,
    and dropped otherwise."""
    if not quiet:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            caught.seek(0)
            sys.stderr.write(caught.read().decode(errors="replace"))
            sys.stderr.flush()
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
