"""The native one-pass indexer equals the reference (both of its loops), is the pass a CPU decode
step actually takes, and steps aside where it does not apply or cannot be built."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from cp_runtime.kernels import native_indexer, reference
from cp_runtime.kernels.storage import to_storage
from test_xla_indexer import S, _assert_close, _problem


@pytest.mark.parametrize("vectorized", [True, False])
@pytest.mark.parametrize("b, nq, heads, dim, m", [
    (1, 1, 1, 16, 9),      # decode, one sequence
    (3, 1, 2, 32, 9),      # three sequences, two heads, two 16-dim chunks
    (2, 2, 2, 16, 7),      # two queries each (4 rows: the most the native pass takes)
    (2, 1, 1, 24, 5),      # 24 dims: not a multiple of 16, the portable loop either way
])
def test_matches_reference(b, nq, heads, dim, m, vectorized):
    args = _problem(0, b=b, nq=nq, heads=heads, dim=dim, m=m)
    ref = reference.indexer_page_scores(*args, num_shards=S, key_block_pages=3)
    stored = to_storage(args[2], jnp.bfloat16)
    assert native_indexer.uses_native(args[0].shape, stored.dtype, jnp.bfloat16)
    out = jax.jit(lambda *a: native_indexer.indexer_page_scores(
        *a, num_shards=S, cache_dtype=jnp.bfloat16, vectorized=vectorized))(
        args[0], args[1], stored, *args[3:])
    assert out.shape == ref.shape == (b, nq, m)
    _assert_close(out, ref)


def test_keys_given_as_bf16_values():
    """A cache of bf16 values (not in storage form) reads the same."""
    args = _problem(1, b=2, nq=1, heads=1, dim=16, m=6)
    ref = reference.indexer_page_scores(*args, num_shards=S, key_block_pages=2)
    _assert_close(native_indexer.indexer_page_scores(*args, num_shards=S), ref)


def test_a_decode_step_lowers_to_the_native_handler():
    q, w, cache, *rest = _problem(2, b=2, nq=1, heads=1, dim=16, m=4)
    stored = to_storage(cache, jnp.bfloat16)
    hlo = jax.jit(lambda *a: native_indexer.indexer_page_scores(
        *a, num_shards=S, cache_dtype=jnp.bfloat16)).lower(q, w, stored, *rest).as_text()
    assert native_indexer.TARGET in hlo


@pytest.mark.parametrize("nq, heads, cache_dtype", [
    (8, 1, jnp.bfloat16),      # a prefill chunk: 8 rows, a matrix product
    (1, 8, jnp.bfloat16),      # 8 heads
    (1, 1, jnp.float32),       # f32 keys
])
def test_other_shapes_take_the_tiled_xla_indexer(nq, heads, cache_dtype):
    q, w, cache, *rest = _problem(3, b=2, nq=nq, heads=heads, dim=16, m=5)
    cache = cache.astype(cache_dtype)
    assert not native_indexer.uses_native(q.shape, cache.dtype)
    hlo = jax.jit(lambda *a: native_indexer.indexer_page_scores(*a, num_shards=S)).lower(
        q, w, cache, *rest).as_text()
    assert native_indexer.TARGET not in hlo
    ref = reference.indexer_page_scores(q, w, cache, *rest, num_shards=S, key_block_pages=2)
    _assert_close(native_indexer.indexer_page_scores(q, w, cache, *rest, num_shards=S), ref)


def test_library_is_cached_by_content(tmp_path):
    """A fresh cache directory gets one library, named by the source/flags/jaxlib hash."""
    script = textwrap.dedent("""
        from cp_runtime.kernels import native_indexer
        print(native_indexer.native_status(), native_indexer.library_path().name)
    """)
    env = dict(os.environ, CP_RUNTIME_CACHE=str(tmp_path))
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert first[0] == "native"
    assert [p.name for p in tmp_path.iterdir()] == [first[1]]
    again = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert again == first


def test_without_a_compiler_warns_and_falls_back(tmp_path):
    """No compiler and nothing cached: a warning that says why, and the tiled indexer's result."""
    script = textwrap.dedent("""
        import warnings
        import jax.numpy as jnp
        from cp_runtime.kernels import native_indexer
        q = jnp.ones((1, 1, 1, 16)); w = jnp.ones((1, 1, 1))
        keys = jnp.ones((3, 16, 16), jnp.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = native_indexer.indexer_page_scores(
                q, w, keys, jnp.array([[0, 1]], jnp.int32), jnp.array([[20]], jnp.int32),
                jnp.int32(0), num_shards=1)
        print(out.tolist())
        print(native_indexer.native_status())
        print(" | ".join(str(c.message) for c in caught))
    """)
    env = dict(os.environ, CP_RUNTIME_CACHE=str(tmp_path), CXX="no-such-compiler")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == "[[[16.0, 16.0]]]"
    assert out[1].startswith("unavailable: no C++ compiler: 'no-such-compiler'")
    assert "native indexer unavailable, decode uses xla_indexer" in out[2]
    assert list(tmp_path.iterdir()) == []
