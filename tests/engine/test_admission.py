"""The admission queue on a real engine: an extend that would take the queued prefill tokens past
`max_queued_tokens` is refused as Overloaded (retryable) and changes nothing; one into an empty
queue is always taken; 0 means no bound; restores are never refused, but count; unset, the bound
follows the measured prefill rate (AUTO_QUEUE_S seconds of it, at least 16 chunks)."""

import numpy as np
import pytest

from conftest import make_engine, random_tokens
from cp_runtime.config import RuntimeConfig
from cp_runtime.engine.core import AUTO_QUEUE_S, STATS_WINDOW_S, StepTiming
from cp_runtime.engine.requests import EngineError, Extend, Overloaded

BOUND = 64


@pytest.fixture
def engine(tiny, tiny_params):
    """Chunks of 32 tokens, at most 64 queued; the pool holds far more than the queue."""
    return make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=16,
                       pages_per_shard=8, chunk_size=32, max_queued_tokens=BOUND)


def extend(engine, tiny, n: int, rid, seed: int = 0, session=None):
    session = session or engine.create_session()
    engine.submit(Extend(id=rid, session=session.id,
                         tokens=np.asarray(random_tokens(tiny, n, seed))))
    return session


def state(engine) -> dict:
    """Everything a refused request must leave as it was."""
    return {"sessions": {sid: (list(s.tokens), s.kv_len, s.busy, len(s.table))
                         for sid, s in engine.sessions.items()},
            "pages_used": engine.allocator.used_per_shard(),
            "queue": [w.request.id for w in engine.scheduler.work()],
            "queued_tokens": engine.scheduler.queued_tokens,
            "requests": engine.stats()["requests"]}


def test_an_extend_past_the_bound_is_refused_and_changes_nothing(engine, tiny):
    a = extend(engine, tiny, 40, "a")
    extend(engine, tiny, BOUND - 40, "b")            # exactly at the bound: taken
    assert engine.scheduler.queued_tokens == BOUND
    c = engine.create_session()
    before = state(engine)
    with pytest.raises(Overloaded, match="max_queued_tokens=64") as refused:
        extend(engine, tiny, 1, "c", session=c)
    assert isinstance(refused.value, EngineError) and refused.value.code == "overloaded"
    assert state(engine) == before
    assert c.tokens == [] and c.busy is None and len(c.table) == 0
    engine.allocator.check_invariants()
    # The request id was not taken: the same id is free once there is room.
    engine.close_session(a.id)                       # ends "a": 24 tokens queued
    extend(engine, tiny, 1, "c", session=c)
    assert engine.scheduler.queued_tokens == BOUND - 40 + 1


def test_an_extend_into_an_empty_queue_is_taken_past_the_bound(engine, tiny):
    a = extend(engine, tiny, 3 * BOUND, "big")       # 192 tokens > 64: the queue was empty
    assert engine.scheduler.queued_tokens == 3 * BOUND
    with pytest.raises(Overloaded):
        extend(engine, tiny, 1, "small")
    # Once it is gone (closed here: steps would take seconds of compiling) the queue is empty
    # and takes the next big one.
    engine.close_session(a.id)
    assert engine.scheduler.queued_tokens == 0
    extend(engine, tiny, 3 * BOUND, "again")
    assert engine.scheduler.queued_tokens == 3 * BOUND
    engine.allocator.check_invariants()


def test_zero_means_no_bound_and_unset_starts_at_sixteen_chunks(tiny, tiny_params):
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=16,
                         pages_per_shard=8, chunk_size=32, max_queued_tokens=0)
    for i in range(8):
        extend(engine, tiny, 100, i, seed=i)
    assert engine.scheduler.queued_tokens == 800 and len(engine.scheduler.work()) == 8
    assert RuntimeConfig(chunk_size=32).admission_bound == 16 * 32     # the auto bound's floor
    assert RuntimeConfig(chunk_size=32, max_queued_tokens=0).admission_bound == 0
    auto = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=16,
                       pages_per_shard=8, chunk_size=32)
    assert auto.scheduler.max_queued_tokens == 16 * 32                  # before any step


def expected_auto_bound(engine) -> int:
    """AUTO_QUEUE_S seconds of the prefill rate of the recorded steps that ran a prefill chunk
    (host + device seconds; not the first step of a shape, which compiled), at least 16
    chunks."""
    steps = [t for t in engine.timings if t.prefill_tokens and not t.first_of_shape]
    seconds = sum(t.host_s + t.device_s for t in steps)
    rate = sum(t.prefill_tokens for t in steps) / seconds if seconds else 0.0
    return max(16 * engine.runtime.chunk_size, int(rate * AUTO_QUEUE_S))


def test_the_auto_bound_follows_the_measured_prefill_rate(tiny, tiny_params):
    """Unset, the bound is set after every step from the steps' own timings; a fixed bound
    stays as it is."""
    # Page 64: the four chunks' steps share one page-table width, so one program to compile.
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=1,
                         pages_per_shard=4, page_size=64, chunk_size=16)
    extend(engine, tiny, 64, "a")
    steps = 0
    while engine.scheduler.work():                   # four prefill chunks of 16
        engine.step()
        steps += 1
        assert engine.scheduler.max_queued_tokens == expected_auto_bound(engine)
    assert steps == 4 and engine.totals["prefill_tokens"] == 64
    # A measured rate of 100K tokens/s (one step of 50K tokens in 0.5 s, within the minute):
    # the bound rises past the floor, to AUTO_QUEUE_S seconds of the window's rate.
    last = engine.timings[-1]
    engine._record(StepTiming(end=last.end + 1e-3, prefill_tokens=50_000, decode_tokens=0,
                              host_s=0.1, device_s=0.4))
    assert engine.scheduler.max_queued_tokens == expected_auto_bound(engine) > 16 * 16
    # A step without prefill changes nothing; steps older than a minute drop out of the rate.
    bound = engine.scheduler.max_queued_tokens
    engine._record(StepTiming(end=last.end + 2e-3, prefill_tokens=0, decode_tokens=4,
                              host_s=5.0, device_s=5.0))
    assert engine.scheduler.max_queued_tokens == bound
    engine._record(StepTiming(end=last.end + STATS_WINDOW_S + 1, prefill_tokens=16,
                              decode_tokens=0, host_s=0.5, device_s=0.5))
    assert len(engine.timings) == 1                  # 16 tokens/s: the floor again
    assert engine.scheduler.max_queued_tokens == expected_auto_bound(engine) == 16 * 16
    # A bound that is set stays as it is, whatever the rate.
    fixed = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=1,
                        pages_per_shard=4, page_size=64, chunk_size=16, max_queued_tokens=48)
    fixed._record(StepTiming(end=1.0, prefill_tokens=50_000, decode_tokens=0, host_s=0.1,
                             device_s=0.4))
    assert fixed.scheduler.max_queued_tokens == 48


def test_restores_are_never_refused_but_count(engine, tiny):
    a = extend(engine, tiny, 60, "a")
    restored = engine.restore_session("r" * 32, random_tokens(tiny, 100, 1))  # 160 > 64
    assert restored.busy == ("restore", "r" * 32)
    assert engine.scheduler.queued_tokens == 160
    again = engine.restore_session("s" * 32, random_tokens(tiny, 10, 2))
    assert engine.scheduler.queued_tokens == 170 and again.busy is not None
    engine.close_session(a.id)                       # the restores' 110 tokens are left
    assert engine.scheduler.queued_tokens == 110
    with pytest.raises(Overloaded):                  # the restores fill the queue
        extend(engine, tiny, 1, "b")
    engine.allocator.check_invariants()
