"""An all-gather among the devices of one process on XLA:CPU, as one barrier (an XLA FFI
handler, `native/in_process_gather.cc`).

The shards of a local run are XLA:CPU's virtual devices, one thread each. XLA's own in-process
all-gather meets at two barriers, and with more device threads than cores each barrier is a
round of sleeps and wake-ups: about 0.36 ms at 16 devices on 2 cores, for a few hundred bytes.
The handler copies each device's part into a buffer shared by the process and wakes the waiting
devices once, when the last part is in: 0.06 ms for the same gather on the same machine
(`cp-runtime bench collectives`).

`all_gather(x, axis_name)` equals `lax.all_gather(x, axis_name)` (the same bytes). Use it only
where `usable(axis_name)` holds, on the CPU (cp_runtime.parallel.collectives picks per platform):
  - every device of the program is in this process (`jax.process_count() == 1`);
  - the program's mesh is the gathered axis alone (one group: every device takes part);
  - the library built (a C++ compiler, Linux); if not, a warning says why, once per process.
The library is compiled on first use and cached (kernels/native_build.py).
"""

from __future__ import annotations

import functools
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cp_runtime.kernels import native_build
from cp_runtime.kernels.native_build import NativeBuildError

__all__ = ["all_gather", "usable", "native_status", "library_path", "TIMEOUT_S"]

SOURCE = pathlib.Path(__file__).parent / "native" / "in_process_gather.cc"
TARGET = "cp_runtime_in_process_gather"

# How long a device waits for the others before its gather fails with an error: far above any
# step's skew, and an error that names the gather is better than a hung process.
TIMEOUT_S = 300.0

# Each traced call gets its own id: with the execution's RunId it names one gather, so the
# devices of one gather meet, and two gathers of one program never mix.
_call_sites = itertools.count()


def library_path() -> pathlib.Path:
    """Where the library for this source, these flags and this jaxlib is (or will be) cached."""
    return native_build.library_path(SOURCE)


@functools.cache
def native_status() -> str:
    """'native' when the handler is registered, else 'unavailable: <why>' (warned once)."""
    return native_build.status(SOURCE, "CpInProcessGather", TARGET,
                               "in-process gather unavailable, gathers use XLA's collectives")


def usable(axis_name: str) -> bool:
    """Whether `all_gather` may run over `axis_name` in the program being traced (inside
    shard_map): one process, a mesh of that axis alone, and the library registered."""
    return (jax.process_count() == 1
            and jax.sharding.get_abstract_mesh().size == lax.axis_size(axis_name)
            and native_status() == "native")


def all_gather(x: jax.Array, axis_name: str, *, timeout_s: float = TIMEOUT_S) -> jax.Array:
    """x f[*shape] of this device -> f[S, *shape], every device's x in axis order (CPU only;
    see `usable`). Raises NativeBuildError when the library is unavailable."""
    status = native_status()
    if status != "native":
        raise NativeBuildError(f"in-process gather {status}")
    size = lax.axis_size(axis_name)
    out = jax.ShapeDtypeStruct((size,) + x.shape, x.dtype)
    rank = lax.axis_index(axis_name).astype(jnp.int32)
    # Not marked side-effecting: every device runs the same compiled program, so XLA drops or
    # moves a gather on all of them alike, and marked, a B = 8 decode step took 10% longer.
    return jax.ffi.ffi_call(TARGET, out)(
        x, rank, size=np.int64(size), call_site=np.int64(next(_call_sites)),
        timeout_ms=np.int64(round(1e3 * timeout_s)))
