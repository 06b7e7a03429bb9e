"""fp8 cache readers against an identical bf16 cache, run on a TPU (native fp8 pages).

The same pool is stored once in bf16 and once cast to fp8; both cache readers (prefill and decode)
run on each, and the fp8 output's rel-L2 distance from the bf16 output is the cost of the cache
dtype alone. Bounds: e4m3 (3 mantissa bits, relative rounding <= 2**-4) within 5%, e5m2 (2 bits,
<= 2**-3) within 9.6%, and e5m2 strictly worse than e4m3 (so the fp8 cast took effect).

Both readers compile for TPU7x (tests/aot/test_tpu_compile.py proves it on any machine), so on a TPU
every failure fails. The interpret-mode twin runs the same check on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cp_runtime.kernels.sparse_decode import sparse_decode
from cp_runtime.kernels.sparse_prefill import sparse_prefill

# TPU-friendly shapes: H a multiple of 8, D and V multiples of 128 lanes, qb a multiple of 8.
B, Q, H, D, V, PS, N, QB = 2, 16, 16, 256, 128, 16, 4, 8
PAGES = B * 4  # 4 pages (64 tokens) per sequence
REL_L2_BOUND = {jnp.float8_e4m3fn: 0.05, jnp.float8_e5m2: 0.096}


def _inputs(seed=0):
    """bf16 pool of B sequences x 4 full pages; Q queries at each sequence's end."""
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.standard_normal((PAGES + 1, PS, D)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, Q, H, D)), jnp.bfloat16)
    q_pos = np.broadcast_to(np.arange(4 * PS - Q, 4 * PS), (B, Q)).astype(np.int32)
    pages = np.broadcast_to(np.arange(N, dtype=np.int32), (B, Q, N))
    slots = (pages + 4 * np.arange(B, dtype=np.int32)[:, None, None]).astype(np.int32)
    return q, cache, jnp.asarray(slots), jnp.asarray(pages), jnp.asarray(q_pos)


def _readers(interpret: bool):
    """name -> (kernel, arguments transform) for both cache readers."""
    statics = dict(value_dim=V, scale=D ** -0.5, interpret=interpret)

    def prefill(q, cache, slots, pages, q_pos):
        return sparse_prefill(q, cache, slots, pages, q_pos, query_block=QB, **statics)

    def decode(q, cache, slots, pages, q_pos):
        last = slice(Q - 1, Q)
        return sparse_decode(q[:, last], cache, slots[:, last], pages[:, last], q_pos[:, last],
                             **statics)

    return {"prefill": prefill, "decode": decode}


def _rel_l2(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _check_fp8_errors(interpret: bool) -> dict:
    q, cache, slots, pages, q_pos = _inputs()
    errors = {}
    for name, reader in _readers(interpret).items():
        o_bf16, _ = _compile(reader, q, cache, slots, pages, q_pos)(q, cache, slots, pages,
                                                                      q_pos)
        for dtype, bound in REL_L2_BOUND.items():
            fp8 = cache.astype(dtype)
            o_fp8, _ = _compile(reader, q, fp8, slots, pages, q_pos)(q, fp8, slots, pages, q_pos)
            errors[name, dtype] = _rel_l2(o_fp8, o_bf16)
            assert 0 < errors[name, dtype] <= bound, (name, dtype, errors[name, dtype])
        assert errors[name, jnp.float8_e5m2] > errors[name, jnp.float8_e4m3fn], errors
    return errors


@pytest.mark.tpu
@pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")
def test_fp8_packed_cache_readers_compiled():
    _check_fp8_errors(interpret=False)


def test_fp8_cache_readers_interpret():
    _check_fp8_errors(interpret=True)
