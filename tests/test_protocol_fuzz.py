"""Property-based fuzzing of the wire protocol against one real server process (hypothesis).

Each example opens a connection and sends a few frames: request maps with known and unknown
keys and plausible or wrong-typed values for every op, arbitrary msgpack values, arbitrary
byte strings, interleaved; sometimes it ends with a truncated frame, an oversized length prefix
or unframed bytes. Properties, after every example:

- every reply is a well-formed event map, and no error is `internal` (a refusal always has a
  proper code);
- the server is alive: a fresh connection's `stats` works;
- no page leaks: once the sessions the example created are closed (found with `sessions`),
  pages used per shard, session count and requests in flight are back to the baseline;
- every few examples (and at the end), the victim sessions' next greedy tokens are unchanged.

The default suite runs FAST_EXAMPLES examples; `pytest -m slow tests/test_protocol_fuzz.py`
runs SLOW_EXAMPLES."""

from __future__ import annotations

import socket
import struct
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cp_runtime
from cp_runtime.serving.session.protocol import ERROR_CODES, EVENTS, OPS
from serving_helpers import RawConnection, World, frame, start_server, stop_server

VOCAB = 256
MAX_FRAME = 1 << 16
FAST_EXAMPLES = 300
SLOW_EXAMPLES = 10_000
PROBE_EVERY = 25
TARGET_TOKENS = [3, 1, 4, 1, 5]


# -- strategies -------------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.binary(max_size=24))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner,
                                        max_size=4), max_leaves=8)

SESSION_REFS = ("$target", "$empty", "$closed", "$unknown")
token_lists = st.lists(st.integers(-3, VOCAB + 3), max_size=12)
token_bytes = st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=8).map(
    lambda ids: struct.pack(f"<{len(ids)}i", *ids)) | st.binary(max_size=13)

FIELDS = {
    "id": st.integers(0, 6) | st.text(max_size=3) | values,
    "op": st.sampled_from(OPS + ("launch", "", "__init__", "_Handlers")) | values,
    "session": st.sampled_from(SESSION_REFS) | values,
    "tokens": token_lists | token_bytes | values,
    "text": st.text(max_size=10) | values,
    "max_tokens": st.integers(-2, 4) | st.integers(2 ** 20, 2 ** 64 - 1) | values,
    "temperature": st.floats(-1, 3) | st.floats(allow_nan=True, allow_infinity=True) | values,
    "top_p": st.floats(-0.5, 1.5) | values,
    "top_k": st.integers(-2, 2 ** 40) | values,
    "seed": st.integers(-1, 2 ** 33) | values,
    "stop": token_lists | values,
    "logprobs": st.booleans() | values,
    "token": st.text(max_size=8) | values,
}
requests = st.builds(
    lambda known, unknown: {**unknown, **known},
    st.fixed_dictionaries({}, optional=FIELDS),
    st.dictionaries(st.text(max_size=8), values, max_size=2))
# Likely-valid requests, so that work really runs and is cut off by later frames.
plausible = st.builds(
    lambda rid, op, session, extra: {"id": rid, "op": op, "session": session, **extra},
    st.integers(0, 6), st.sampled_from(("extend", "generate", "fork", "info", "close", "create",
                                        "stats", "sessions")),
    st.sampled_from(SESSION_REFS),
    st.fixed_dictionaries({}, optional={
        "tokens": token_lists | token_lists | FIELDS["tokens"],
        "max_tokens": st.integers(1, 4) | st.integers(1, 4) | FIELDS["max_tokens"],
        "temperature": st.floats(0, 2) | FIELDS["temperature"],
        "top_p": st.floats(0.01, 1) | FIELDS["top_p"],
        "top_k": st.integers(0, 300) | FIELDS["top_k"],
        "seed": st.integers(0, 2 ** 32 - 1) | FIELDS["seed"],
        "stop": token_lists | FIELDS["stop"],
        "logprobs": FIELDS["logprobs"],
        "text": FIELDS["text"]}))
frames = st.one_of(
    requests.map(lambda m: ("map", m)),
    plausible.map(lambda m: ("map", m)),
    plausible.map(lambda m: ("map", m)),
    values.map(lambda v: ("value", v)),
    st.binary(max_size=40).map(lambda b: ("bytes", b)),
)
tails = st.none() | st.one_of(                  # half the examples end with a broken stream
    st.just(("oversized", None)),
    st.just(("4gib", None)),
    st.binary(min_size=1, max_size=3).map(lambda b: ("header", b)),        # truncated header
    st.tuples(st.integers(1, 200), st.binary(max_size=40)).map(lambda t: ("body", t)),
    st.binary(min_size=1, max_size=60).map(lambda b: ("raw", b)),
)
examples = st.tuples(st.lists(frames, min_size=1, max_size=8), tails)


# -- the server and its state ------------------------------------------------------------------
class Fuzz:
    def __init__(self, address: str):
        self.address = address
        self.client = cp_runtime.Client(address)
        self.world = World.build(self.client, VOCAB)
        self.target = self.empty = None
        self._fresh_targets()
        closed = self.client.create_session()
        closed.close()
        self.closed = closed.id
        self.baseline = self._state()
        self.keep = {s["id"] for s in self.client.sessions()}
        self.probe = self.world.probe()
        self.count = 0
        self.codes: dict[str, int] = {}                      # error events by code
        self.events: dict[str, int] = {}                     # other events by kind

    def _fresh_targets(self) -> None:
        for s in (self.target, self.empty):
            if s is not None:
                try:
                    s.close()
                except cp_runtime.serving.session.protocol.NotFoundError:
                    pass
        self.target = self.client.create_session()
        self.target.extend(TARGET_TOKENS)
        self.empty = self.client.create_session()

    def _state(self) -> dict:
        deadline = time.monotonic() + 60
        while (stats := self.client.stats())["requests"] and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"pages": stats["pages_used_per_shard"], "sessions": stats["sessions"],
                "requests": stats["requests"]}

    def resolve(self, value):
        refs = {"$target": self.target.id, "$empty": self.empty.id, "$closed": self.closed,
                "$unknown": "0" * 32}
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        return refs.get(value, value) if isinstance(value, str) else value

    def encode(self, kind, item) -> bytes:
        if kind == "map":
            return frame(msgpack.packb(self.resolve(item), use_bin_type=True))
        if kind == "value":
            return frame(msgpack.packb(item, use_bin_type=True))
        return frame(item)                                      # arbitrary bytes, framed

    def run(self, example) -> None:
        items, tail = example
        data = b"".join(self.encode(kind, item) for kind, item in items)
        ping = tail is None
        if tail is not None:
            kind, arg = tail
            data += {"oversized": lambda: struct.pack(">I", MAX_FRAME + 1),
                     "4gib": lambda: struct.pack(">I", 2 ** 32 - 1),
                     "header": lambda: arg,
                     "body": lambda: struct.pack(">I", arg[0] + len(arg[1])) + arg[1],
                     "raw": lambda: arg}[kind]()
        with RawConnection(self.address, timeout=60) as conn:
            try:
                conn.send(data)
                if ping:
                    conn.request({"id": "$ping", "op": "stats"})
                else:
                    conn.sock.shutdown(socket.SHUT_WR)
            except OSError:            # the server may close first (an oversized prefix)
                pass
            while (reply := conn.read()) is not None:
                self.check_reply(reply)
                if ping and reply.get("id") == "$ping":
                    break
        self.after()

    def check_reply(self, reply) -> None:
        assert isinstance(reply, dict) and reply.get("event") in EVENTS, reply
        assert "id" in reply
        if reply["event"] == "error":
            code = reply.get("code")
            assert code in ERROR_CODES and code != "internal", reply
            assert isinstance(reply.get("message"), str)
            self.codes[code] = self.codes.get(code, 0) + 1
        else:
            self.events[reply["event"]] = self.events.get(reply["event"], 0) + 1

    def after(self) -> None:
        """The server is alive, and with the example's sessions closed nothing is left."""
        with RawConnection(self.address, timeout=60) as fresh:
            assert fresh.call("stats", rid=1)["event"] == "done"
        self._state()                                          # let cut-off extends finish
        for s in self.client.sessions():
            if s["id"] not in self.keep:
                self.client.session(s["id"]).close()
        info = {}
        try:
            info = self.target.info()
        except cp_runtime.serving.session.protocol.NotFoundError:
            pass
        if info.get("length") != len(TARGET_TOKENS) or self.empty.id not in {
                s["id"] for s in self.client.sessions()} or \
                self.empty.info()["length"] != 0:
            self.keep -= {self.target.id, self.empty.id}
            self._fresh_targets()
            self.keep |= {self.target.id, self.empty.id}
        assert self._state() == self.baseline
        self.count += 1
        if self.count % PROBE_EVERY == 0:
            self.check_probe()

    def check_probe(self) -> None:
        assert self.world.probe() == self.probe


@pytest.fixture(scope="module")
def fuzz():
    server = start_server("--pages-per-shard", "24", "--max-frame-bytes", str(MAX_FRAME))
    try:
        f = Fuzz(server.address)
        yield f
        f.check_probe()
        f.client.close()
        assert server.proc.poll() is None
    finally:
        stop_server(server)


def _report(fuzz, started: float, n: int) -> None:
    print(f"\nprotocol fuzz: {fuzz.count} examples run ({n} asked) in "
          f"{time.monotonic() - started:.0f} s; errors by code: {fuzz.codes}; other events "
          f"(pings included): {fuzz.events}")


SETTINGS = dict(deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def test_protocol_fuzz(fuzz, capsys):
    started = time.monotonic()

    @settings(max_examples=FAST_EXAMPLES, **SETTINGS)
    @given(examples)
    def run(example):
        fuzz.run(example)

    run()
    fuzz.check_probe()
    with capsys.disabled():
        _report(fuzz, started, FAST_EXAMPLES)


@pytest.mark.slow
def test_protocol_fuzz_long(fuzz, capsys):
    started = time.monotonic()

    @settings(max_examples=SLOW_EXAMPLES, **SETTINGS)
    @given(examples)
    def run(example):
        fuzz.run(example)

    run()
    fuzz.check_probe()
    with capsys.disabled():
        _report(fuzz, started, SLOW_EXAMPLES)
