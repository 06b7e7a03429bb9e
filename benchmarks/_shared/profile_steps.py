"""Whole engine steps for `cp-runtime bench profile` (profile.py): a synthetic pool and
session (random values in every page, a page table covering the context, nothing prefilled),
timed engine steps, the segment the engine plans for a step, and the executor's parts of
running it (transfer, dispatch, device, fetch). Every call into the executor is here.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from cp_runtime.benchmarks._shared.profile_work import StepShape
from cp_runtime.cache.layout import cdiv
from cp_runtime.cache.pool import CP_AXIS, KVPool
from cp_runtime.engine.plans import Row, build_segment, sampling_arrays
from cp_runtime.engine.requests import Extend, Generate, SamplingParams
from cp_runtime.kernels.storage import to_storage

__all__ = ["engine_steps", "executor_parts", "executor_pool", "fill_pool", "make_noop",
           "median_seconds", "program_parts", "rewind", "set_executor_pool", "step_segment",
           "synthetic_session"]


# -- the executor: every call into it is here -----------------------------------------------
def executor_parts(executor) -> tuple:
    """(mesh, params on the mesh) of a LocalExecutor."""
    return executor.mesh, executor.params


def executor_pool(executor) -> KVPool:
    return executor.pool


def set_executor_pool(executor, pool: KVPool) -> None:
    executor.pool = pool


def _start_step(executor, args: tuple, kind: str):
    """Start the executor's compiled step (the engine's program: same jit, same shapes, no new
    compile) on device inputs `args`; it updates the pool in place as a step does. Returns the
    segment's output and the new pool, not waited for."""
    _, params = executor_parts(executor)
    out, pool = executor._step(params, executor_pool(executor), args, kind=kind)
    set_executor_pool(executor, pool)
    return out, pool


def _start_empty_step(executor, args: tuple, noop) -> jax.Array:
    """Start `noop` (make_noop) on what the step takes: the cost of launching a program with
    the step's arguments on the S devices, without the step's work."""
    _, params = executor_parts(executor)
    return noop(params, executor_pool(executor), args)


def make_noop(mesh) -> Callable:
    """A jitted program over every device of `mesh` that takes any arguments, keeps them (as
    the step's program does) and computes nothing: f32[S] zeros."""
    return jax.jit(lambda *args: jnp.zeros((mesh.size,), jnp.float32), keep_unused=True,
                   out_shardings=NamedSharding(mesh, PartitionSpec(CP_AXIS)))


# -- the synthetic pool and session ---------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _random_maker(shape: tuple[int, ...], sharding, value_dtype):
    """key -> a pool buffer (storage form) of N(0, 1) values of `value_dtype`, made on the
    devices; one compile per (shape, sharding, dtype), shared by a pool's equal buffers."""
    return jax.jit(lambda key: to_storage(jax.random.normal(key, shape, jnp.float32),
                                          value_dtype), out_shardings=sharding)


def _random_buffer(shape: tuple[int, ...], sharding, value_dtype, key: jax.Array) -> jax.Array:
    """A pool buffer (storage form) of N(0, 1) values of `value_dtype`, made on the devices."""
    return _random_maker(tuple(shape), sharding, value_dtype)(key)


def fill_pool(executor, seed: int = 0) -> None:
    """Random values in every page of every pool buffer (what a prefill would have left)."""
    spec, pool = executor.pool_spec, executor_pool(executor)
    latent = [(b.shape, b.sharding) for b in pool.latent]
    indexer = [(b.shape, b.sharding) for b in pool.indexer]
    keys = iter(jax.random.split(jax.random.key(seed), len(latent) + len(indexer)))
    set_executor_pool(executor, None)                       # free the zeros before the values
    del pool

    def fill(layout, dtype):
        return tuple(_random_buffer(shape, sharding, dtype, next(keys))
                     for shape, sharding in layout)

    set_executor_pool(executor, KVPool(latent=fill(latent, spec.latent_dtype),
                               indexer=fill(indexer, spec.indexer_dtype)))


def synthetic_session(engine, length: int, cached: int, vocab: int):
    """A session of `cached` tokens whose page table already covers `length` tokens, all
    'in the cache' (the pool holds random values): a long context without a prefill."""
    session = engine.create_session()
    session.table = engine.allocator.grow(session.table, cdiv(length, engine.runtime.page_size))
    session.tokens = np.random.default_rng(length).integers(0, vocab, cached).tolist()
    session.kv_len = cached
    return session


def rewind(session, tokens: int) -> None:
    """Back to the first `tokens` tokens, all cached (its pages stay reserved). Truncated in
    place: a sliced copy would be exactly full, and the step's one append would then copy all
    of it (0.6 ms at a million tokens), which serving's amortised appends never do."""
    del session.tokens[tokens:]
    session.kv_len = tokens


# -- timing ---------------------------------------------------------------------------------
def median_seconds(call: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of `call()` waited for, after one compiling, warming call."""
    jax.block_until_ready(call())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def engine_steps(engine, session, shape: StepShape, repeats: int) -> dict:
    """Median host and device seconds of `repeats` engine steps of `shape` (after a warm-up
    step), each from the same session state. Leaves the session at `shape.length` tokens."""
    tokens = np.random.default_rng(shape.start).integers(0, engine.model.vocab_size,
                                                         shape.length - shape.start)
    timings = []
    for i in range(1 + repeats):
        if shape.kind == "prefill":
            rewind(session, shape.start)
            engine.submit(Extend(id=("profile", i), session=session.id, tokens=tokens))
        else:
            rewind(session, shape.length)
            engine.submit(Generate(id=("profile", i), session=session.id,
                                   sampling=SamplingParams(max_tokens=1)))
        engine.step()
        if engine.has_work:
            raise RuntimeError(f"a {shape.kind} step at {shape.length} took more than one step")
        timings.append(engine.timings[-1])
    rewind(session, shape.length)
    host = statistics.median(t.host_s for t in timings[1:])
    device = statistics.median(t.device_s for t in timings[1:])
    whole = statistics.median(t.host_s + t.device_s for t in timings[1:])
    return {"engine_host_s": host, "engine_device_s": device, "whole_step_s": whole}


def step_segment(engine, session, shape: StepShape):
    """The segment the engine plans for `shape` (same rows, widths and page table)."""
    rt = engine.runtime
    tokens = np.random.default_rng(shape.start).integers(
        0, engine.model.vocab_size, shape.length - shape.start).tolist()
    row = Row(session.table, tokens, shape.start)
    common = dict(page_size=rt.page_size, num_shards=rt.num_shards,
                  sentinel=engine.allocator.sentinel)
    if shape.kind == "decode":
        return build_segment("sample", [row], **common,
                             sampling=sampling_arrays([SamplingParams(max_tokens=1)], [0]))
    return build_segment("fill", [row], width=rt.chunk_size, **common)


def program_parts(executor, segment, repeats: int) -> dict[str, float]:
    """Median seconds of the parts of the executor running `segment` (after a compiling run):
    transfer (the plan's arrays onto the devices), dispatch (an empty program with the step's
    arguments, call to done), device (the step's program, call to done) and fetch (outputs to
    host arrays)."""
    mesh, _ = executor_parts(executor)
    noop, parts = make_noop(mesh), []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        args = jax.block_until_ready(segment.to_device(mesh, executor.runtime.num_shards))
        t1 = time.perf_counter()
        jax.block_until_ready(_start_empty_step(executor, args, noop))
        t2 = time.perf_counter()
        out = jax.block_until_ready(_start_step(executor, args, segment.kind))[0]
        t3 = time.perf_counter()
        jax.tree.map(np.asarray, out)
        parts.append((t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3))
    names = ("transfer_s", "dispatch_s", "device_s", "fetch_s")
    return {name: statistics.median(p[i] for p in parts[1:]) for i, name in enumerate(names)}

