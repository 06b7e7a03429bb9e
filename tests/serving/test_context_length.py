"""Requests that can never fit against those that must wait, and uploads all or nothing.

A request whose session's tokens, prompt and `max_tokens` pass `max_model_len` (the whole pool:
one session can hold every page) is refused for good: HTTP 400 `context_length_exceeded` in
vLLM's words, naming both numbers, without Retry-After, and the session protocol's
`context_length_exceeded` (`ContextLengthError`, not retried). A request short of pages that
other sessions hold is 429 `capacity` with Retry-After (`CapacityError`, retryable), its message
in tokens and sessions. An upload in several requests is admitted whole or refused up front,
and one that fails part way leaves the session and the pool as they were.

The engine's admission on a 2 x 4 pool of 16-token pages (no device step: fast); the doors on
one real server with the other server tests' 6,144-token pool (16 shards x 24 pages x 16
tokens, so their compiled steps are reused), steps and all.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import openai
import pytest

import cp_runtime
from conftest import make_engine, random_tokens
from cp_runtime.cache.pages import CapacityError as PagesFull
from cp_runtime.engine.journal import Journal
from cp_runtime.engine.requests import (BadRequest, ContextTooLong, Extend, Generate, PoolBusy,
                                        SamplingParams)
from cp_runtime.serving.errors import error_code
from cp_runtime.serving.state.token_store import TokenStore, read_logs
from cp_runtime.serving.session.protocol import RETRYABLE_CODES, error_class
from serving_helpers import RawConnection, start_server, stop_server
from test_serving import ScriptedPeer
from test_http import request

POOL = 16 * 24 * 16                 # the server's max_model_len (TINY_SERVER's pool)
VOCAB = 256


# -- the engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny, tiny_params):
    return make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=2,
                       pages_per_shard=4, chunk_size=32)


def _holding(engine, tokens: list[int]):
    """A session whose log holds `tokens` and whose pages are reserved for them, idle, without
    a device step (an extend submitted and cancelled: admission is what these tests check;
    the real server's tests below run the steps)."""
    session = engine.create_session()
    engine.submit(Extend(id=("setup", session.id), session=session.id,
                         tokens=np.asarray(tokens)))
    engine.cancel(("setup", session.id))
    session.kv_len = session.length                      # as if written
    return session


def _state(engine, session) -> tuple:
    return (list(session.tokens), session.kv_len, session.table, session.upload,
            engine.allocator.free_per_shard(), engine.has_work)


def test_the_engine_tells_never_from_not_now(engine, tiny):
    assert engine.max_model_len == 2 * 4 * 16
    s = _holding(engine, random_tokens(tiny, 40, 0))            # 3 pages
    other = _holding(engine, random_tokens(tiny, 48, 1))        # 3: 2 left, 32 tokens
    before = _state(engine, s)
    cases = [(Extend(id=1, session=s.id, tokens=np.zeros(89, np.int32)), ContextTooLong,
              r"holds 40 tokens and this extend adds 89: 129 tokens, over the 128"),
             (Generate(id=2, session=s.id, sampling=SamplingParams(max_tokens=10 ** 11)),
              ContextTooLong, r"holds 40 tokens and max_tokens=100,000,000,000 would take "
                              r"it to 100,000,000,040 tokens, over the 128"),
             (Extend(id=3, session=s.id, tokens=np.zeros(4, np.int32), upload=("c", 1),
                     upload_total=89), ContextTooLong, r"this upload of 89 tokens adds 89"),
             (Extend(id=4, session=s.id, tokens=np.zeros(60, np.int32)), PoolBusy,
              r"needs room for 60 tokens and the pool has 32 tokens free; 1 other session "
              r"holds the rest; retry later")]
    for request_, error, message in cases:
        with pytest.raises(error, match=message) as e:
            engine.submit(request_)
        assert isinstance(e.value, PagesFull)          # both are the allocator's kind too
        assert "[" not in str(e.value)                 # no page arrays
        assert _state(engine, s) == before
    assert error_code(ContextTooLong("x", limit=1, held=0, added=2)) == \
        "context_length_exceeded" not in RETRYABLE_CODES
    assert error_code(PoolBusy("x")) == "capacity" in RETRYABLE_CODES
    for session in (s, other):
        engine.close_session(session.id)
    engine.allocator.check_invariants()


def test_an_undone_upload_leaves_the_session_and_the_pool_as_they_were(engine, tiny):
    s = _holding(engine, random_tokens(tiny, 20, 2))
    other = _holding(engine, random_tokens(tiny, 16, 3))
    before = _state(engine, s)
    owner = ("connection", 7)
    upload = random_tokens(tiny, 70, 4)
    engine.submit(Extend(id="p1", session=s.id, tokens=np.asarray(upload[:30]), upload=owner,
                         upload_total=70))
    assert s.upload is not None and len(s.table) == 6       # every page reserved up front
    engine.cancel("p1")                                      # as if it had run
    assert len(s.table) == 6                                 # and they stay reserved
    with pytest.raises(BadRequest, match="busy with an upload"):       # no one else's
        engine.submit(Generate(id="g", session=s.id, sampling=SamplingParams()))
    with pytest.raises(BadRequest, match="busy with an upload"):
        engine.submit(Extend(id="x", session=s.id, tokens=np.asarray([1]), upload=("c", 8)))
    with pytest.raises(BadRequest, match="overshoots"):
        engine.submit(Extend(id="p2", session=s.id, tokens=np.zeros(41, np.int32), upload=owner))
    # A fork (prefix reuse) is taken only up to where the upload began.
    s.kv_len = s.length                                      # as if the part had run
    assert engine.prefix.longest(engine.sessions, np.asarray(before[0] + upload[:30]))[1] == 20
    engine.submit(Extend(id="p2", session=s.id, tokens=np.asarray(upload[30:65]), upload=owner))
    events, length = engine.abort_upload(s.id, owner)        # a part running when undone
    assert length == 20 and [e.request for e in events] == ["p2"]
    assert _state(engine, s) == before
    assert len(engine.prefix._chains[s.id]) == 1            # its one full page, indexed
    engine.allocator.check_invariants()
    assert engine.abort_upload(s.id, owner) == ([], None)
    # Undone while its cache is being rebuilt (a failed step): the rebuild starts again.
    engine.submit(Extend(id="r1", session=s.id, tokens=np.asarray(upload[:30]), upload=owner,
                         upload_total=70))
    engine._recover(RuntimeError("a failed step"))
    assert engine.abort_upload(s.id, owner) == ([], 20)
    restore = engine._work[s.busy]
    assert (s.tokens, restore.target, len(s.table)) == (before[0], 20, 2)
    engine.cancel(s.busy)
    # The whole upload to its end: it joins the session like one extend.
    for i, (a, b) in enumerate(((0, 30), (30, 70))):
        engine.submit(Extend(id=f"q{i}", session=s.id, tokens=np.asarray(upload[a:b]),
                             upload=owner, upload_total=70 if i == 0 else None))
        engine.cancel(f"q{i}")
    assert s.upload is None and s.tokens == before[0] + upload and len(s.table) == 6
    for session in (s, other):
        engine.close_session(session.id)
    engine.allocator.check_invariants()


def test_an_upload_reaches_the_token_log_whole_or_not_at_all(engine, tiny, tmp_path):
    engine.journal = TokenStore(tmp_path)
    try:
        s = _holding(engine, random_tokens(tiny, 20, 5))
        upload, owner = random_tokens(tiny, 50, 6), ("connection", 9)
        for undo in (True, False):
            engine.submit(Extend(id="u1", session=s.id, tokens=np.asarray(upload[:30]),
                                 upload=owner, upload_total=50))
            engine.cancel("u1")
            assert read_logs(tmp_path)[s.id] == s.tokens[:20]     # not yet: a restart undoes
            if undo:
                engine.abort_upload(s.id, owner)
                continue
            engine.submit(Extend(id="u2", session=s.id, tokens=np.asarray(upload[30:]),
                                 upload=owner))
            engine.cancel("u2")
        assert read_logs(tmp_path)[s.id] == s.tokens and len(s.tokens) == 70
        engine.close_session(s.id)
    finally:
        engine.journal = Journal()


# -- the doors --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    server = start_server("--http-port", "0")
    yield server.address, server.http_address
    stop_server(server)


@pytest.fixture
def client(served):
    with cp_runtime.Client(served[0]) as c:
        yield c
        for s in c.sessions():
            c.session(s["id"]).close()


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def test_max_model_len_is_the_pool(served, client):
    assert client.server["max_model_len"] == POOL == client.server["capacity_tokens"]
    _, _, models = request(served[1], "GET", "/v1/models", token=None)
    assert models["data"][0]["max_model_len"] == POOL


@pytest.mark.parametrize("body, param, asked", [
    ({"prompt": _tokens(POOL + 10), "max_tokens": 2}, "prompt", (POOL + 12, POOL + 10, 2)),
    ({"prompt": _tokens(20), "max_tokens": 10 ** 11}, "max_tokens", (10 ** 11 + 20, 20, 10 ** 11)),
])
def test_http_never_fits_is_400_context_length_exceeded(served, client, body, param, asked):
    before = client.stats()
    status, head, answer = request(served[1], "POST", "/v1/completions",
                                   {"model": "tiny", **body}, token=None)
    error = answer["error"]
    assert (status, error["type"], error["code"], error["param"]) == (
        400, "invalid_request_error", "context_length_exceeded", param)
    total, prompt, completion = asked
    assert error["message"] == (
        f"This model's maximum context length is {POOL} tokens. However, you requested "
        f"{total} tokens ({prompt} in the prompt, {completion} in the completion). Please "
        "reduce the length of the prompt or completion.")
    assert "retry-after" not in {k.lower() for k in head}
    after = client.stats()
    for key in ("sessions", "requests", "pages_used_per_shard", "prefill_tokens_total"):
        assert after.get(key) == before.get(key), key


def test_http_continuing_a_session_counts_its_tokens(served, client):
    s = client.create_session()
    s.extend(_tokens(100, 1))
    status, _, answer = request(served[1], "POST", "/v1/responses",
                                {"input": _tokens(20, 2), "max_output_tokens": POOL - 110,
                                 "session": s.id}, token=None)
    assert (status, answer["error"]["code"], answer["error"]["param"]) == (
        400, "context_length_exceeded", "max_output_tokens")
    assert (f"you requested {POOL + 10} tokens (100 in the session, 20 in the input, "
            f"{POOL - 110} in the completion)") in answer["error"]["message"]
    sdk = openai.OpenAI(base_url=f"http://{served[1]}/v1", api_key="x")   # retries by default
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {POOL}"):
        sdk.completions.create(model="tiny", prompt=_tokens(30), max_tokens=POOL)
    assert s.info()["length"] == 100


def test_http_pool_busy_is_429_with_retry_after_in_tokens(served, client):
    holder = client.create_session()
    holder.extend(_tokens(20, 3))
    # A running generation holds the pages of all its max_tokens: 20 + max_tokens - 1 tokens,
    # all but 128 of the pool; no long prefill needed.
    running = holder.stream(max_tokens=POOL - 128 - 20 + 1)
    next(running)
    try:
        before = client.stats()
        status, head, answer = request(served[1], "POST", "/v1/completions",
                                       {"prompt": _tokens(100, 4), "max_tokens": 100},
                                       token=None)
        error = answer["error"]
        assert (status, error["type"], error["code"]) == (429, "rate_limit_error", "capacity")
        assert {k.lower(): v for k, v in head.items()}["retry-after"] == "1"
        assert error["message"] == ("the KV pool is full for now: this request needs room for "
                                    "200 tokens and the pool has 128 tokens free; 1 other "
                                    "session holds the rest; retry later")
        assert client.stats()["pages_used_per_shard"] == before["pages_used_per_shard"]
        # The session protocol says the same, as a retryable CapacityError.
        s = client.create_session()
        s.extend(_tokens(100, 5))                                # 7 pages: 16 tokens left
        with pytest.raises(cp_runtime.CapacityError, match="needs room for 50 tokens and the "
                                                           "pool has 16 tokens free") as e:
            s.generate(max_tokens=50)
        assert isinstance(e.value, cp_runtime.UnavailableError)
        assert s.info()["length"] == 100
    finally:
        holder.close()
        running.close()


def test_protocol_never_fits_is_context_length_error(client):
    s = client.create_session()
    s.extend(_tokens(100, 6))
    before = client.stats()["pages_used_per_shard"]
    with pytest.raises(cp_runtime.ContextLengthError, match=(
            f"holds 100 tokens and max_tokens={POOL:,} would take it to {POOL + 100:,} tokens, "
            f"over the {POOL:,} one session can hold .*; ask for at most {POOL - 100:,}")) as e:
        s.generate(max_tokens=POOL)
    assert isinstance(e.value, cp_runtime.BadRequestError)
    assert not isinstance(e.value, cp_runtime.UnavailableError)          # never retried
    with pytest.raises(cp_runtime.ContextLengthError, match=f"this extend adds {POOL - 99:,}"):
        s.extend(_tokens(POOL - 99, 7))
    assert client.stats()["pages_used_per_shard"] == before and s.info()["length"] == 100


def test_an_upload_past_the_context_is_refused_before_it_is_sent(client):
    s = client.create_session()
    s.extend(_tokens(100, 8))
    before = client.stats()
    with pytest.raises(cp_runtime.ContextLengthError,
                       match=f"this upload of {POOL:,} tokens adds {POOL:,}: {POOL + 100:,} "
                             f"tokens, over the {POOL:,}") as e:
        s.extend(_tokens(POOL, 9), chunk_tokens=64)
    assert "nothing changed" in str(e.value)
    after = client.stats()
    assert after.get("prefill_tokens_total") == before.get("prefill_tokens_total")  # none ran
    assert s.info()["length"] == 100


def test_a_failed_upload_leaves_the_session_and_the_pool_as_they_were(client):
    s = client.create_session()
    s.extend(_tokens(100, 10))
    other = client.create_session()
    other.extend(_tokens(50, 11))
    probe = s.fork()
    want = probe.generate(max_tokens=3).tokens
    probe.close()
    before = (client.stats()["pages_used_per_shard"], s.info())
    upload = _tokens(300, 12)
    upload[200] = VOCAB                                      # the 4th part is refused
    with pytest.raises(cp_runtime.BadRequestError,
                       match=r"outside the vocabulary.*the upload was undone: session \w+ "
                             r"holds its 100 tokens as before"):
        s.extend(upload, chunk_tokens=64)
    assert (client.stats()["pages_used_per_shard"], s.info()) == before
    assert s.generate(max_tokens=3).tokens == want          # its cache is as it was, too
    assert other.info()["length"] == 50


def test_an_upload_is_undone_when_its_connection_closes_or_it_is_aborted(served, client):
    s = client.create_session()
    s.extend(_tokens(40, 13))
    before = (client.stats()["pages_used_per_shard"], s.info())
    for ending in ("close", "abort"):
        with RawConnection(served[0]) as raw:
            first = raw.call("extend", rid=1, session=s.id, tokens=_tokens(64, 14), upload=200)
            assert first == {"id": 1, "event": "done", "length": 104}
            with pytest.raises(cp_runtime.BadRequestError, match="busy with an upload of 200 "
                                                                 "tokens \\(64 sent\\)"):
                s.generate(max_tokens=1)
            if ending == "abort":
                done = raw.call("abort", rid=2, session=s.id)
                assert (done["event"], done["length"], done["aborted"]) == ("done", 40, True)
        deadline = time.monotonic() + 10
        while s.info()["length"] != 40 and time.monotonic() < deadline:
            time.sleep(0.05)                                 # the server sees the close
        assert (client.stats()["pages_used_per_shard"], s.info()) == before


# -- the client's exceptions ------------------------------------------------------------------
def test_client_exceptions_say_what_to_retry():
    assert error_class("context_length_exceeded") is cp_runtime.ContextLengthError
    assert error_class("capacity") is cp_runtime.CapacityError
    assert issubclass(cp_runtime.ContextLengthError, cp_runtime.BadRequestError)
    assert not issubclass(cp_runtime.ContextLengthError, cp_runtime.UnavailableError)
    assert issubclass(cp_runtime.CapacityError, cp_runtime.UnavailableError)
    too_long = [{"event": "error", "code": "context_length_exceeded", "message": "too long"}]
    busy = [{"event": "error", "code": "capacity", "message": "busy"}]
    done = [{"event": "done", "length": 3}]
    retry = cp_runtime.Retry(attempts=3, backoff_s=0.01)

    def run(script, body):
        async def main():
            peer = ScriptedPeer(script)
            address = await peer.start()
            async with peer.server:
                async with cp_runtime.AsyncClient(address, retry=retry) as c:
                    try:
                        return await body(c.session("s1")), peer.requests
                    except cp_runtime.ServerError as e:
                        return e, peer.requests
        return asyncio.run(main())

    async def extend(s):
        return await s.extend([1, 2, 3], chunk_tokens=2)

    error, sent = run([too_long], extend)                   # never retried
    assert isinstance(error, cp_runtime.ContextLengthError) and sent == ["extend"]
    assert run([busy, done, done], extend) == ({"length": 3}, ["extend"] * 3)   # retried
    error, sent = run([done, busy], extend)                 # a later part: not retried
    assert isinstance(error, cp_runtime.CapacityError) and sent == ["extend"] * 2
