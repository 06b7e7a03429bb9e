"""pytest plugin for a machine with a TPU: every kernel call a test makes in interpret mode runs
compiled on the TPU instead, against the same reference and bounds.

    python -m pytest -p tests.compiled_on_tpu -o addopts="" -q tests/kernels/test_kernels.py ...

Every kernel passes its `interpret` flag through `costs.call_options`, whose
`interpret_params` this replaces for the session; the compile-only TPU7x tests (those taking
the `device` fixture) are skipped, as the chip is not a TPU7x. The references run on the TPU
too, at JAX's default matmul precision (bf16 passes for f32 products), so a bound set from
CPU-side f32 references can fail on the reference's side: read a failure's numbers before the
kernel's. docs/notes/2026-12-06-selection-on-tpu.md ("Kernels compiled on a TPU v5e") has what one
run gave.
"""

from __future__ import annotations

import jax
import pytest


def pytest_configure(config):
    if jax.default_backend() != "tpu":
        raise pytest.UsageError("tests.compiled_on_tpu needs a TPU: JAX's default backend is "
                                f"{jax.default_backend()!r}")
    from cp_runtime.kernels import costs
    costs.interpret_params = lambda interpret: False


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="a compile-only TPU7x test")
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)
