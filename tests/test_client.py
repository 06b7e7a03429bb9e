"""The Python client's habits: error classes importable from `cp_runtime`, sessions as context
managers, `stream(logprobs=True)`, one key for a session's id, and the opt-in retry.

The first tests run against a real server (test_serving's). The retry needs `unavailable`
answers on demand, which the real server gives only while it rebuilds a pool (timing the
state tests cover with the same retry): here a small scripted peer on a real socket speaks the
protocol's frames and answers as told.
"""

import asyncio

import pytest
from test_serving import client, served, server  # noqa: F401 - fixtures

import cp_runtime
from cp_runtime.serving.session.protocol import encode_frame, read_frame


def test_error_classes_come_from_the_package(client):  # noqa: F811
    for name in ("BadRequestError", "NotFoundError", "CapacityError", "UnauthorizedError",
                 "UnavailableError", "InternalError"):
        assert issubclass(getattr(cp_runtime, name), cp_runtime.ServerError)
    with pytest.raises(cp_runtime.NotFoundError):
        client.session("no-such-session").info()


def test_sessions_close_at_the_end_of_a_with_block(client):  # noqa: F811
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


def test_stream_yields_log_probabilities_when_asked(client):  # noqa: F811
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
