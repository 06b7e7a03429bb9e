"""The in-process gather gives XLA's all-gather's bytes on 16 virtual devices, keeps concurrent
programs and repeated call sites apart, and fails with an error, not a hang, when a device
never arrives."""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from cp_runtime.kernels import native_gather

S = 16


def _mesh():
    return jax.make_mesh((S,), ("cp",))


def _sharded(x):
    return jax.device_put(x, NamedSharding(_mesh(), P("cp")))


def _spmd(body):
    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P("cp"), out_specs=P("cp"),
                                 check_vma=False))


@pytest.mark.parametrize("dtype, shape", [(np.float32, (3,)), (np.int32, (2, 5)),
                                          (jnp.bfloat16, (7,)), (np.float32, ())])
def test_equals_xla_all_gather(dtype, shape):
    x = _sharded(np.random.default_rng(0).normal(size=(S, *shape)).astype(dtype) * 100)
    native = _spmd(lambda v: native_gather.all_gather(v[0], "cp")[None])
    xla = _spmd(lambda v: lax.all_gather(v[0], "cp")[None])
    got, want = np.asarray(native(x)), np.asarray(xla(x))
    assert got.shape == (S, S, *shape) and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_usable_in_one_process_on_a_mesh_of_the_axis_alone():
    assert native_gather.native_status() == "native"
    seen = {}

    def probe(axes, name):
        def body(v):
            seen[axes] = native_gather.usable(name)
            return v
        mesh = jax.make_mesh(axes, ("dp", "cp")[-len(axes):])
        x = jax.device_put(jnp.zeros(S), NamedSharding(mesh, P(mesh.axis_names)))
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(mesh.axis_names),
                              out_specs=P(mesh.axis_names), check_vma=False))(x)

    probe((S,), "cp")
    probe((2, S // 2), "cp")
    assert seen == {(S,): True, (2, S // 2): False}


def test_a_call_site_in_a_loop_meets_once_per_iteration():
    """The same gather run 50 times in one execution: each iteration is its own meeting."""
    def body(v):
        def step(_, acc):
            return native_gather.all_gather(acc, "cp").sum(0) % 1000.0
        return lax.fori_loop(0, 50, step, v[0])[None]

    x = _sharded(np.arange(S * 2, dtype=np.float32).reshape(S, 2))
    want = np.arange(S * 2, dtype=np.float64).reshape(S, 2)
    for _ in range(50):
        want = np.broadcast_to(want.sum(0) % 1000.0, (S, 2))
    np.testing.assert_array_equal(np.asarray(_spmd(body)(x)), want.astype(np.float32))


def test_concurrent_programs_do_not_mix():
    """Two programs with gathers, launched from four threads at once: each gets its own."""
    def program(scale):
        def body(v):
            v = v[0]
            for _ in range(3):
                v = native_gather.all_gather(v, "cp").max(0) * scale
            return v[None]
        return _spmd(body)

    x = _sharded(np.arange(S * 4, dtype=np.float32).reshape(S, 4))
    programs = [program(1.0), program(0.5)]
    wanted = [np.asarray(p(x)) for p in programs]
    wrong = []

    def run(i):
        for _ in range(100):
            if not np.array_equal(np.asarray(programs[i](x)), wanted[i]):
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i % 2,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@functools.cache
def _one_device_short():
    """A gather that expects 17 devices where 16 run it: every device waits 0.3 s, then fails."""
    def body(v):
        out = jax.ShapeDtypeStruct((S + 1,) + v.shape[1:], v.dtype)
        rank = lax.axis_index("cp").astype(jnp.int32)
        return jax.ffi.ffi_call(native_gather.TARGET, out)(
            v[0], rank, size=np.int64(S + 1), call_site=np.int64(-1),
            timeout_ms=np.int64(300))[:1]
    return _spmd(body)


def test_a_device_that_never_arrives_is_an_error_not_a_hang():
    x = _sharded(np.zeros((S, 2), np.float32))
    with pytest.raises(Exception, match=r"16 of 17 devices arrived within 300 ms"):
        _one_device_short()(x).block_until_ready()
    ok = _spmd(lambda v: native_gather.all_gather(v[0], "cp").sum(0)[None])
    np.testing.assert_array_equal(np.asarray(ok(x)), np.zeros((S, 2)))   # and later ones work
