"""Sessions that survive, against real server processes over real state directories: restart
after kill -9, every kind of damage to the directory, a full disk, recovery from a failed
step."""

import asyncio
import time

import jax.numpy as jnp
import numpy as np
import pytest

import cp_runtime
from conftest import make_engine, random_tokens
from cp_runtime.engine.requests import Extend, Generate, SamplingParams, Token, Unavailable
from cp_runtime.model.oracle import oracle_logits
from cp_runtime.serving.state.token_store import read_logs
from serving_helpers import start_server, stop_server

def greedy_continuation(params, cfg, tokens, n):
    """The oracle's greedy next n tokens after `tokens`."""
    out = list(tokens)
    for _ in range(n):
        logits = oracle_logits(params, jnp.asarray(out), cfg=cfg, page_size=16)
        out.append(int(np.argmax(np.asarray(logits)[-1])))
    return out[len(tokens):]


class FailOnce:
    """Wraps an executor's jitted step: the call runs (so the pool is donated and gone), then
    raises, once."""

    def __init__(self, step):
        self.step, self.armed = step, True

    def __call__(self, *args, **kwargs):
        out = self.step(*args, **kwargs)
        if self.armed:
            self.armed = False
            raise RuntimeError("injected device failure")
        return out


def test_a_failed_step_rebuilds_the_pool_and_every_session(tiny, tiny_params):
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=4,
                         pages_per_shard=16, chunk_size=32)
    a, b = engine.create_session(), engine.create_session()
    engine.extend(a.id, random_tokens(tiny, 50, 0))
    engine.extend(b.id, random_tokens(tiny, 30, 1))
    engine.executor._step = FailOnce(engine.executor._step)
    engine.submit(Generate(id="g", session=a.id, sampling=SamplingParams(max_tokens=4)))
    engine.submit(Extend(id="x", session=b.id, tokens=np.asarray(random_tokens(tiny, 40, 2))))
    events = engine.step()
    assert sorted((e.request, e.code) for e in events) == [("g", "unavailable"),
                                                           ("x", "unavailable")]
    assert engine.info(a.id)["restoring"] and b.length == 30 + 40   # accepted tokens stay
    with pytest.raises(Exception, match="being restored"):
        engine.submit(Generate(id="early", session=a.id, sampling=SamplingParams()))
    while engine.has_work:
        engine.step()
    assert (a.kv_len, b.kv_len) == (a.length, b.length)
    engine.submit(Generate(id="retry", session=a.id, sampling=SamplingParams(max_tokens=4)))
    out = []
    while engine.has_work:
        out += [e.token for e in engine.step() if isinstance(e, Token)]
    assert out == greedy_continuation(tiny_params, tiny, a.tokens[:50], 4)
    engine.allocator.check_invariants()


# The client's own retry waits out `unavailable` while a restarted server rebuilds a session
# (up to about two minutes).
WHILE_RESTORING = cp_runtime.Retry(attempts=600, backoff_s=0.05, max_backoff_s=0.2)


@pytest.fixture
def state_dir(tmp_path):
    return str(tmp_path / "state")


def test_kill_9_mid_extend_and_mid_generate_loses_no_acknowledged_token(state_dir, tiny,
                                                                       tiny_params):
    args = ("--state-dir", state_dir, "--fsync", "never")
    server = start_server(*args)
    address = server.address
    prompt = random_tokens(tiny, 200, 5)
    acked: dict[str, list[int]] = {}

    async def upload_then_kill(client):
        """Acknowledged 200 tokens, then a 3000-token extend killed after its first chunk."""
        s = await client.create_session()
        await s.extend(prompt)
        acked["upload"] = list(prompt)
        async for event in client.events("extend", session=s.id,
                                         tokens=random_tokens(tiny, 3000, 6)):
            if event["event"] == "progress":
                server.kill()
                break
        return s.id

    async def generate_then_kill(client):
        s = await client.create_session()
        await s.extend(prompt)
        got = []
        async for event in client.events("generate", session=s.id, max_tokens=60):
            if event["event"] == "token":
                got.append(event["token"])
            if len(got) == 5:
                server.kill()
                break
        acked["chat"] = list(prompt) + got
        return s.id

    async def main():
        async with cp_runtime.AsyncClient(address) as c:
            chat = await generate_then_kill(c)
        return chat

    chat_id = asyncio.run(main())
    server = start_server(*args)
    address = server.address
    async def second():
        async with cp_runtime.AsyncClient(address) as c:
            return await upload_then_kill(c)
    try:
        upload_id = asyncio.run(second())
    except (ConnectionError, OSError):
        pytest.fail("the upload's client lost the connection before the kill")
    t_restart = time.monotonic()
    server = start_server(*args)
    address = server.address
    try:
        with cp_runtime.Client(address, retry=WHILE_RESTORING) as client:
            listed = {s["id"]: s["length"] for s in client.sessions()}
            assert set(listed) == {chat_id, upload_id}
            logs = read_logs(state_dir)
            for sid, name in ((chat_id, "chat"), (upload_id, "upload")):
                assert logs[sid][: len(acked[name])] == acked[name]   # nothing acknowledged lost
                assert listed[sid] == len(logs[sid])
            chat = client.session(chat_id)
            cont = chat.generate(max_tokens=3).tokens
            first_token_s = time.monotonic() - t_restart
            assert cont == greedy_continuation(tiny_params, tiny, logs[chat_id], 3)
            print(f"restart to first token of the restored session: {first_token_s:.1f} s")
    finally:
        stop_server(server)


@pytest.mark.slow             # kept out of the default suite for its time budget
def test_a_snapshot_restores_into_a_server_with_another_shard_count(state_dir, tiny,
                                                                   tiny_params):
    server = start_server("--state-dir", state_dir)
    address = server.address
    try:
        with cp_runtime.Client(address) as client:
            s = client.create_session()
            s.extend(random_tokens(tiny, 300, 7))
            snap = s.snapshot()
            assert (snap["length"], snap["cached"]) == (300, 300)
            s.extend(random_tokens(tiny, 20, 8))                    # after the snapshot
            sid, log = s.id, read_logs(state_dir)[s.id]
    finally:
        stop_server(server)
    server = start_server("--state-dir", state_dir, "--shards", "4")
    address = server.address
    try:
        with cp_runtime.Client(address, retry=WHILE_RESTORING) as client:
            assert client.server["shards"] == 4
            s = client.session(sid)
            out = s.generate(max_tokens=3).tokens
            assert out == greedy_continuation(tiny_params, tiny, log, 3)
            # Only the 20 tokens past the snapshot were prefilled (then one decode per token).
            assert client.stats()["prefill_tokens_total"] == 20
    finally:
        stop_server(server)


def test_a_failed_direct_step_is_recovered_and_raised_as_unavailable(tiny, tiny_params):
    engine = make_engine(tiny, tiny_params, kv_cache_dtype="f32", num_shards=4,
                         pages_per_shard=16, chunk_size=32)
    s = engine.create_session()
    engine.extend(s.id, random_tokens(tiny, 40, 0))
    engine.executor._step = FailOnce(engine.executor._step)
    with pytest.raises(Unavailable, match="being rebuilt"):
        engine.decode([s.id], [3])
    assert s.length == 40 and engine.info(s.id)["restoring"]     # nothing half-appended
    while engine.has_work:
        engine.step()
    logits = engine.decode([s.id], [3])
    ref = oracle_logits(tiny_params, jnp.asarray(s.tokens), cfg=tiny, page_size=16)
    np.testing.assert_allclose(logits[0], np.asarray(ref)[-1], rtol=1e-4, atol=1e-4)
