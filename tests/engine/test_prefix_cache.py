"""Prefix reuse (cp_runtime.engine.prefix_cache): a stateless request forks the live session
holding the longest cached prefix of its prompt, prefills only the rest, and generates exactly
what it would have without reuse; kept entries make way for pages others need."""

import numpy as np
import pytest

from cp_runtime.cache.pages import CapacityError
from cp_runtime.engine.requests import BadRequest, Done, Extend, Generate, SamplingParams, Token
from conftest import make_engine, random_tokens


@pytest.fixture(scope="module")
def shared_engine(tiny, tiny_params):
    """One engine for the module (its step programs compile once)."""
    return make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=2,
                       pages_per_shard=10, chunk_size=32, max_batch=2)


@pytest.fixture
def engine(shared_engine):
    """The shared engine with no session, and 64 prefix-cache entries allowed."""
    for session_id in list(shared_engine.sessions):
        shared_engine.close_session(session_id)
    shared_engine.prefix.max_entries = 64
    return shared_engine


def _complete(engine, session_id, tokens, n=4) -> list[int]:
    """Extend the session with `tokens` (if any), then generate n greedy tokens; the ids."""
    if tokens:
        engine.submit(Extend(id=("x", session_id), session=session_id,
                             tokens=np.asarray(tokens, np.int32)))
        while engine.has_work:
            engine.step()
    out = []
    engine.submit(Generate(id=("g", session_id), session=session_id,
                           sampling=SamplingParams(max_tokens=n)))
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, Token) and event.request == ("g", session_id):
                out.append(event.token)
            assert not isinstance(event, Done) or event.info.get("finish_reason") != "error"
    return out


def _stateless(engine, prompt, n=4) -> tuple[list[int], int]:
    """A stateless request as the HTTP front runs one: (its tokens, prompt tokens reused)."""
    session, cached = engine.open_cached(np.asarray(prompt, np.int32), len(prompt) + n)
    out = _complete(engine, session.id, prompt[cached:], n)
    engine.retain(session.id)
    return out, cached


def test_reuse_prefills_only_the_rest_and_generates_the_same_tokens(engine, tiny):
    doc = random_tokens(tiny, 150, 0)
    questions = [random_tokens(tiny, 9, 10 + i) for i in range(3)]
    fresh = []
    for q in questions:                    # without reuse: a durable session each, closed
        s = engine.create_session()
        fresh.append(_complete(engine, s.id, doc + q))
        engine.close_session(s.id)
    prefilled, before = engine.totals["prefill_tokens"], engine.stats()["prefix_cache"]
    got = [_stateless(engine, doc + q) for q in questions]
    assert [t for t, _ in got] == fresh                          # exact: greedy ids equal
    # The first finds nothing; the others reuse the document (and nothing of the question).
    assert [c for _, c in got] == [0, 150, 150]
    stats = engine.stats()["prefix_cache"]
    assert stats["entries"] == 3
    assert (stats["hits"] - before["hits"], stats["cached_tokens"] - before["cached_tokens"]) \
        == (2, 300)
    # Prefill work: the first prompt whole, then only the questions.
    assert engine.totals["prefill_tokens"] - prefilled == 159 + 2 * 9
    # A prompt equal to an entry's whole log (prompt + generated) reuses all of it but the
    # last generated token, which the generation rewrites.
    again, cached = _stateless(engine, doc + questions[0] + fresh[0][:3])
    assert cached == 150 + 9 + 3 and again[0] == fresh[0][3]
    for session_id in list(engine.sessions):
        engine.close_session(session_id)
    assert engine.allocator.num_used() == 0 and not engine.prefix.stats()["indexed_sessions"]


def test_entries_make_way_for_pages_and_their_count(engine, tiny):
    engine.prefix.max_entries = 2
    for i in range(3):
        _stateless(engine, random_tokens(tiny, 40, i))
    assert len(engine.prefix.entries) == 2 and engine.open_sessions == 0
    older, newer = engine.prefix.entries               # the first went for the count
    # A durable session needing most of the pool closes the oldest entry, no more.
    s = engine.create_session()
    total = engine.runtime.num_shards * engine.runtime.pages_per_shard * 16
    engine.extend(s.id, random_tokens(tiny, total - 64, 9))
    assert list(engine.prefix.entries) == [newer] and older not in engine.sessions
    # 7 pages do not fit even with the last entry closed: refused, and nothing closed.
    with pytest.raises(CapacityError):
        engine.open_cached(np.asarray(random_tokens(tiny, 100, 5), np.int32), 104)
    assert set(engine.sessions) == {newer, s.id}
    # 3 pages fit once it is closed.
    engine.open_cached(np.asarray(random_tokens(tiny, 40, 6), np.int32), 44)
    assert newer not in engine.sessions
    engine.allocator.check_invariants()


def test_fork_at_a_length_shares_the_prefix_of_a_busy_session(engine, tiny):
    doc = random_tokens(tiny, 70, 1)
    parent = engine.create_session()
    engine.extend(parent.id, doc)
    engine.submit(Generate(id="busy", session=parent.id, sampling=SamplingParams(max_tokens=3)))
    child = engine.fork(parent.id, 40)             # the parent is busy: allowed at a length
    assert child.tokens == doc[:40] and child.kv_len == 40
    with pytest.raises(BadRequest, match="cannot fork"):
        engine.fork(parent.id, 72)
    with pytest.raises(BadRequest, match="busy"):
        engine.fork(parent.id)                     # the whole log needs an idle parent
    want = _complete(engine, engine.create_session().id, doc[:40] + [5, 6])
    assert _complete(engine, child.id, [5, 6]) == want
