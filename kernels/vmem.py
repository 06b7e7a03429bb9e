"""VMEM budget of the Pallas kernels on TPU v7x, and the scoped-VMEM limit each one asks for.

TPU v7x (Ironwood) has 64 MiB of VMEM per TensorCore (Google Cloud TPU documentation, "TPU v7x"
system architecture page); a kernel runs on one TensorCore, so that is the whole budget.

Each kernel's `cost()` estimates its VMEM bytes (buffers, scratch and the large temporaries),
each array counted as Mosaic pads it (`tiled_bytes`).
`vmem_limit_bytes(estimate)` turns that into the `pltpu.CompilerParams(vmem_limit_bytes=...)`
of the call: the estimate plus HEADROOM (Mosaic's own temporaries and layout padding the formula
does not count), never below the compiler's usual 16 MiB default scope, never above the core's
64 MiB. `fit_block(vmem_of, block)` is the rule by which a wrapper shrinks a default block that
would not fit: halve it (staying a multiple of 8 sublanes) until the estimate is within
VMEM_BUDGET_BYTES (and, given `smem_of`, its SMEM within SMEM_BUDGET_BYTES); blocking changes
the grid, never the result.

SMEM: the TPU7x compiler holds a kernel to 1 MiB of it ("Ran out of memory in memory space
smem. Used 1.01M of 1.00M smem" for a decode kernel prefetching two i32[64 * 2048] page
tables); SMEM_BUDGET_BYTES leaves a sixteenth of it to the compiler's own scalars.
"""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["VMEM_BYTES_PER_CORE", "VMEM_BUDGET_BYTES", "SMEM_BYTES_PER_CORE",
           "SMEM_BUDGET_BYTES", "fit_block", "largest_divisor", "tiled_bytes",
           "vmem_limit_bytes"]

VMEM_BYTES_PER_CORE = 64 * 1024 * 1024     # TPU v7x, per TensorCore
HEADROOM = 1.25                             # x the estimate, plus HEADROOM_BYTES
HEADROOM_BYTES = 2 * 1024 * 1024
MIN_LIMIT_BYTES = 16 * 1024 * 1024          # the default scoped-VMEM limit
# An estimate at most this large still gets its headroom under the per-core figure.
VMEM_BUDGET_BYTES = int((VMEM_BYTES_PER_CORE - HEADROOM_BYTES) / HEADROOM)
SMEM_BYTES_PER_CORE = 1024 * 1024           # TPU7x, as its compiler counts it
SMEM_BUDGET_BYTES = SMEM_BYTES_PER_CORE * 15 // 16


LANES = 128


def tiled_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of a VMEM array as Mosaic lays it out: the last dim padded to 128 lanes, the one
    before to a whole tile (8 sublanes of 32-bit words: 8 rows of f32, 16 of bf16, 32 of fp8).
    A `[R, 1]` column of f32 thus takes R * 128 * 4 bytes, not R * 4."""
    *lead, rows, cols = (1,) * max(0, 2 - len(shape)) + tuple(shape)
    sublanes = 8 * (4 // itemsize)
    return (math.prod(lead) * (-(-rows // sublanes) * sublanes)
            * (-(-cols // LANES) * LANES) * itemsize)


def vmem_limit_bytes(estimate: int) -> int:
    """Scoped-VMEM limit for a kernel whose cost() says `estimate` bytes: estimate * 1.25 +
    2 MiB, clamped to [16 MiB, 64 MiB]."""
    want = int(estimate * HEADROOM) + HEADROOM_BYTES
    return max(MIN_LIMIT_BYTES, min(want, VMEM_BYTES_PER_CORE))


def fit_block(vmem_of: Callable[[int], int], block: int,
              smem_of: Callable[[int], int] = lambda block: 0) -> int:
    """The largest of block, block / 2, ... (>= 8, or `block` itself when smaller) whose
    vmem_of(block) is within VMEM_BUDGET_BYTES and smem_of(block) within SMEM_BUDGET_BYTES;
    the smallest tried if none is."""
    while block > 8 and (vmem_of(block) > VMEM_BUDGET_BYTES
                         or smem_of(block) > SMEM_BUDGET_BYTES):
        block = max(8, block // 2)
    return block


def largest_divisor(n: int, step: int, most: int) -> int:
    """The largest multiple of `step` that divides n and is at most `most` (a tile of an axis
    of n); n itself when none is (n below `step`, or no such multiple)."""
    fits = [t for t in range(step, min(n, most) + 1, step) if n % t == 0]
    return max(fits) if fits else n
