"""End to end: a real `cp-runtime serve` process, real sockets, the Python clients.

The last part is the Python client's habits: error classes importable from `cp_runtime`,
sessions as context managers, `stream(logprobs=True)`, one key for a session's id, and the
opt-in retry. The retry needs `unavailable` answers on demand, which the real server gives only
while it rebuilds a pool (timing the state tests cover with the same retry): there a small
scripted peer on a real socket speaks the protocol's frames and answers as told."""

import asyncio
import os
import signal
import socket
import struct
import subprocess
import threading
import time

import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import cp_runtime
from conftest import random_tokens
from cp_runtime.model.oracle import oracle_logits
from cp_runtime.serving.process import SERVE_COMMAND
from cp_runtime.serving.session.protocol import (BadRequestError, ContextLengthError, NotFoundError,
                                         ServerError, UnauthorizedError, encode_frame,
                                         read_frame)
from serving_helpers import TINY_SERVER, start_server, stop_server


@pytest.fixture(scope="module")
def served():
    """(address, the ServerProcess): at debug level, with a summary every second."""
    server = start_server("--log-level", "debug", "--log-summary-s", "1")
    yield server.address, server
    stop_server(server)                                         # SIGTERM ends it cleanly


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture
def client(server):
    with cp_runtime.Client(server) as c:
        yield c


def test_hello_reports_the_model_and_limits(client):
    info = client.server
    assert (info["model"], info["shards"], info["page_size"]) == ("tiny", 16, 16)
    assert info["capacity_tokens"] == 16 * 24 * 16 and info["text"] is True
    assert info["limits"]["max_frame_bytes"] > 0


def test_the_log_has_start_up_phases_requests_and_summaries(served, client):
    address, server = served
    session = client.create_session()
    session.extend(list(range(40)))
    session.close()
    deadline = time.monotonic() + 10
    while "last 1 s:" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = server.log()
    for phase in ("pool: 24 pages of 16 tokens a shard over 16 shards", "weights: replicated",
                  "compile: a ", "listening on", "request conn=",
                  " extend session=", "tokens=40 ", "last 1 s:"):
        assert phase in text, (phase, text[-3000:])


def test_served_greedy_generation_equals_the_oracle(client, tiny, tiny_params):
    prompt = random_tokens(tiny, 150, 0)
    session = client.create_session()
    seen = []
    assert session.extend(prompt, progress=lambda done, total: seen.append((done, total))) == {
        "length": 150}
    assert seen[-1] == (150, 150) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    gen = session.generate(max_tokens=5, logprobs=True)
    assert gen.finish_reason == "length" and len(gen.logprobs) == 5
    ref = np.asarray(oracle_logits(tiny_params, jnp.asarray(prompt + gen.tokens[:-1]), cfg=tiny,
                                   page_size=16))
    assert gen.tokens == ref[149:].argmax(-1).tolist()
    info = session.info()
    assert info["length"] == 155 and sum(info["pages_per_shard"]) == info["pages"] == 10
    session.close()


def test_stream_and_generate_agree_for_a_seed_and_forks_are_independent(client, tiny):
    session = client.create_session()
    session.extend(random_tokens(tiny, 40, 1))
    a, b = session.fork(), session.fork()
    sampling = dict(max_tokens=6, temperature=0.9, top_p=0.95, top_k=50, seed=42)
    streamed = list(a.stream(**sampling))
    assert b.generate(**sampling).tokens == streamed
    assert a.info()["length"] == b.info()["length"] == 46 and session.info()["length"] == 40
    for s in (a, b, session):
        s.close()


def test_errors_are_typed_and_change_nothing(client, tiny):
    session = client.create_session()
    session.extend(random_tokens(tiny, 20, 2))
    before = client.stats()["pages_used_per_shard"]
    for bad, error in [(dict(temperature=-1), BadRequestError), (dict(top_p=0), BadRequestError),
                       (dict(max_tokens=10 ** 9), ContextLengthError)]:
        with pytest.raises(error):
            session.generate(**bad)
    with pytest.raises(BadRequestError, match="outside the vocabulary"):
        session.extend([tiny.vocab_size])
    with pytest.raises(BadRequestError, match="empty"):
        session.extend("")                       # text: tiny has the byte tokenizer
    with pytest.raises(ContextLengthError, match="over the 6,144 one session can hold"):
        session.extend(np.zeros(16 * 24 * 16, np.int32))
    with pytest.raises(NotFoundError):
        client.session("0" * 32).info()
    assert client.stats()["pages_used_per_shard"] == before
    assert session.info()["length"] == 20
    session.close()


@pytest.mark.slow             # kept out of the default suite for its time budget
def test_a_long_upload_does_not_stall_another_clients_generation(server, tiny):
    """One client uploads 4K tokens (64 steps of 64) while another generates 12 tokens: the
    generation finishes first, a token per step."""
    done = {}

    def upload():
        with cp_runtime.Client(server) as c:
            s = c.create_session()
            s.extend(random_tokens(tiny, 4096, 3))
            done["upload"] = time.monotonic()
            s.close()

    with cp_runtime.Client(server) as c:
        chat = c.create_session()
        chat.extend(random_tokens(tiny, 30, 4))
        thread = threading.Thread(target=upload)
        thread.start()
        time.sleep(0.5)
        assert len(chat.generate(max_tokens=12).tokens) == 12
        done["chat"] = time.monotonic()
        thread.join()
        chat.close()
    assert done["chat"] < done["upload"]


def test_async_client_runs_requests_concurrently(server, tiny):
    async def main():
        async with cp_runtime.AsyncClient(server) as c:
            sessions = [await c.create_session() for _ in range(3)]
            await asyncio.gather(*(s.extend(random_tokens(tiny, 33, 5)) for s in sessions))
            gens = await asyncio.gather(*(s.generate(max_tokens=4) for s in sessions))
            for s in sessions:
                await s.close()
            return gens

    gens = asyncio.run(main())
    assert gens[0].tokens == gens[1].tokens == gens[2].tokens     # same prompt, greedy


def _raw(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _reply(sock: socket.socket) -> dict | None:
    head = sock.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL))


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_bad_frames_get_errors_and_the_server_lives_on(server, client):
    with _raw(server) as sock:
        sock.sendall(_frame(b"\xc1not msgpack"))                   # 0xc1 is never valid
        assert _reply(sock)["code"] == "bad_request"
        sock.sendall(_frame(msgpack.packb([1, 2, 3])))             # not a map
        assert _reply(sock)["code"] == "bad_request"
        sock.sendall(_frame(msgpack.packb({"op": "stats"})))       # no id
        assert _reply(sock)["code"] == "bad_request"
        sock.sendall(_frame(msgpack.packb({"id": 1, "op": "launch"})))
        reply = _reply(sock)
        assert (reply["id"], reply["code"]) == (1, "bad_request")
        sock.sendall(struct.pack(">I", 2 ** 32 - 1))                # a 4 GiB frame
        assert _reply(sock)["code"] == "bad_request"
        assert _reply(sock) is None                                 # and the connection ends
    assert client.stats()["sessions"] >= 0


def test_no_token_is_needed_on_loopback_and_a_token_is_checked(tiny):
    server = start_server("--pages-per-shard", "4", env={"CP_RUNTIME_TOKEN": "s3cret"})
    address = server.address
    try:
        with pytest.raises(UnauthorizedError):
            cp_runtime.Client(address)
        with pytest.raises(UnauthorizedError):
            cp_runtime.Client(address, token="wrong")
        with cp_runtime.Client(address, token="s3cret") as c:
            assert c.stats()["sessions"] == 0
    finally:
        assert server.stop(signal.SIGINT) == 0


def test_binding_beyond_loopback_without_a_token_is_refused():
    out = subprocess.run([*SERVE_COMMAND, *TINY_SERVER, "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "CP_RUNTIME_TOKEN"})
    assert out.returncode == 2 and "--auth-token" in out.stderr
    assert "listening" not in out.stdout


def test_server_error_classes_mirror_the_codes():
    from cp_runtime.serving.session.protocol import ERROR_CODES, error_class
    assert {error_class(code).code for code in ERROR_CODES} == set(ERROR_CODES)
    assert all(issubclass(error_class(code), ServerError) for code in ERROR_CODES)


# -- the Python client's habits ---------------------------------------------------------------

def test_error_classes_come_from_the_package(client):
    for name in ("BadRequestError", "NotFoundError", "CapacityError", "UnauthorizedError",
                 "UnavailableError", "InternalError"):
        assert issubclass(getattr(cp_runtime, name), cp_runtime.ServerError)
    with pytest.raises(cp_runtime.NotFoundError):
        client.session("no-such-session").info()


def test_sessions_close_at_the_end_of_a_with_block(client):
    with client.create_session() as s:
        s.extend([1, 2, 3])
        with s.fork() as child:
            assert child.info()["length"] == 3
            ids = {x["id"] for x in client.sessions()}          # the key Session.id names
            assert {s.id, child.id} <= ids
        assert child.id not in {x["id"] for x in client.sessions()}
    assert s.id not in {x["id"] for x in client.sessions()}
    with client.create_session() as early:
        early.close()                                            # closed inside: no error
    with pytest.raises(RuntimeError, match="inside"):
        with client.create_session() as failing:
            raise RuntimeError("an error inside the block")
    assert failing.id not in {x["id"] for x in client.sessions()}


def test_stream_yields_log_probabilities_when_asked(client):
    with client.create_session() as s, client.create_session() as twin:
        for x in (s, twin):
            x.extend([5, 6, 7, 8])
        pairs = list(s.stream(max_tokens=4, logprobs=True))
        whole = twin.generate(max_tokens=4, logprobs=True)
        assert [t for t, _ in pairs] == whole.tokens
        assert [lp for _, lp in pairs] == pytest.approx(whole.logprobs, abs=1e-6)
        assert all(isinstance(t, int) for t in s.stream(max_tokens=2))


class ScriptedPeer:
    """A TCP peer that answers `hello`, then each request by the next entry of `script`: a
    list of events to send for it (the request's id filled in)."""

    def __init__(self, script: list[list[dict]]):
        self.script, self.requests = list(script), []

    async def _serve(self, reader, writer):
        while (message := await read_frame(reader, 1 << 20)) is not None:
            events = ([{"event": "done", "model": "scripted"}] if message["op"] == "hello"
                      else self.script.pop(0))
            if message["op"] != "hello":
                self.requests.append(message["op"])
            for event in events:
                writer.write(encode_frame({"id": message["id"], **event}))
            await writer.drain()
        writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]


UNAVAILABLE = [{"event": "error", "code": "unavailable", "message": "rebuilding"}]


def _run_against(script, body, retry):
    async def main():
        peer = ScriptedPeer(script)
        address = await peer.start()
        async with peer.server:
            async with cp_runtime.AsyncClient(address, retry=retry) as c:
                return await body(c), peer.requests
    return asyncio.run(main())


def test_retry_sends_a_turned_away_request_again_with_backoff():
    script = [UNAVAILABLE, UNAVAILABLE, [{"event": "done", "session": "s1"}]]

    async def create(c):
        return (await c.create_session()).id

    fast = cp_runtime.Retry(attempts=3, backoff_s=0.01)
    assert _run_against(script, create, fast) == ("s1", ["create"] * 3)
    with pytest.raises(cp_runtime.UnavailableError):              # off by default
        _run_against(script, create, None)
    with pytest.raises(cp_runtime.UnavailableError):              # out of attempts
        _run_against(script, create, cp_runtime.Retry(attempts=2, backoff_s=0.01))
    assert [cp_runtime.Retry(backoff_s=0.25, max_backoff_s=1).wait_s(n)
            for n in (1, 2, 3, 4)] == [0.25, 0.5, 1, 1]


def test_retry_never_repeats_a_request_that_had_begun():
    """A generate that streamed a token and then failed has had an effect: not retried."""
    script = [[{"event": "token", "token": 3, "logprob": -0.5}, *UNAVAILABLE],
              [{"event": "done", "finish_reason": "length"}]]

    async def generate(c):
        return await c.session("s1").generate(max_tokens=2)

    with pytest.raises(cp_runtime.UnavailableError):
        _run_against(script, generate, cp_runtime.Retry(attempts=5, backoff_s=0.01))
