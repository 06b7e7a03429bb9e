"""Hostile input against a real server process: every case is answered with the right error code
or a clean disconnect, and leaves the pool and every session exactly as before (pages used per
shard, requests in flight, session count, and each victim session's next greedy token, probed
on a fork before and after).

`test_zz_hostile_input_table` prints the table of cases and what each returned
(`pytest tests/serving/session/test_hostile_input.py -s`).

Then property-based fuzzing of the wire protocol against the same server (hypothesis).

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

The default suite runs FAST_EXAMPLES examples;
`pytest -m slow tests/serving/session/test_hostile_input.py -k fuzz` runs SLOW_EXAMPLES."""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cp_runtime
from cp_runtime.serving.session.protocol import ERROR_CODES, EVENTS, OPS
from serving_helpers import RawConnection, World, frame, pack, start_server, stop_server

VOCAB = 256
PAGES_PER_SHARD = 24                      # 16 shards x 24 pages x 16 tokens = 6144 tokens
CAPACITY = 16 * PAGES_PER_SHARD * 16
MAX_FRAME = 1 << 20
MAX_PENDING = 8192
RESULTS: dict[str, str] = {}              # case -> what it returned, for the table


@pytest.fixture(scope="module")
def server():
    server = start_server("--pages-per-shard", str(PAGES_PER_SHARD),
                          "--max-frame-bytes", str(MAX_FRAME),
                          "--max-pending-bytes", str(MAX_PENDING))
    try:
        yield server.proc, server.address
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def world(server):
    with cp_runtime.Client(server[1]) as client:
        w = World.build(client, VOCAB)
        for v in w.victims:                    # compile the batch shapes used below
            v.fork().close()
        w.baseline = w.snapshot()
        yield w


@pytest.fixture
def ctx(world):
    """A scratch session (20 tokens), an empty one and a closed one; afterwards the scratch
    session must be untouched, and once they are closed the world must equal its baseline."""
    c = world.client
    scratch, empty, closed = c.create_session(), c.create_session(), c.create_session()
    scratch.extend(list(range(20)))
    closed.close()
    ids = {"session": scratch.id, "empty": empty.id, "closed": closed.id}
    yield ids
    scratch = c.session(ids["session"])             # a case may have replaced it
    info = scratch.info()
    scratch.close()
    empty.close()
    assert (info["length"], info["busy"]) == (20, False)
    assert world.snapshot() == world.baseline


# -- the cases --------------------------------------------------------------------------------
# Each case: name -> (bytes to send given the context, the outcome expected, how to send).
# Outcomes list the code of each reply to the case, then "disconnect" when the server closed
# the connection; a stats request ("ping") follows unless the case ends the stream.

def _req(**fields):
    return lambda c: frame({"id": 1, **fields})


def _on_session(op, **fields):
    return lambda c: frame({"id": 1, "op": op, "session": c["session"], **fields})


def _gen(**fields):
    return _on_session("generate", **fields)


def _ext(tokens):
    return _on_session("extend", tokens=tokens)


BR, NF, CTX, DISC = "bad_request", "not_found", "context_length_exceeded", "disconnect"

CASES: dict[str, tuple] = {
    # frames
    "malformed msgpack (0xc1)": (lambda c: frame(b"\xc1\x00junk"), [BR]),
    "msgpack then trailing bytes": (lambda c: frame(pack({"id": 1, "op": "stats"}) + b"\x00"),
                                    [BR]),
    "truncated msgpack map": (lambda c: frame(pack({"id": 1, "op": "stats"})[:-3]), [BR]),
    "empty frame (length 0)": (lambda c: frame(b""), [BR]),
    "deeply nested arrays (100k)": (lambda c: frame(b"\x91" * 100_000 + b"\xc0"), [BR]),
    "map with an array key": (lambda c: frame(b"\x81\x91\x01\x01"), [BR]),
    "truncated header, then EOF": (lambda c: b"\x00\x00", [BR, DISC], "shutdown"),
    "truncated body, then EOF": (lambda c: struct.pack(">I", 100) + b"\x81\xa2id",
                                 [BR, DISC], "shutdown"),
    "closed mid-frame (no half-close)": (lambda c: struct.pack(">I", 100) + b"abc", [], "close"),
    "oversized frame (max_frame_bytes + 1)": (lambda c: struct.pack(">I", MAX_FRAME + 1),
                                              [BR, DISC], "no-ping"),
    "length prefix of 4 GiB - 1": (lambda c: struct.pack(">I", 2 ** 32 - 1), [BR, DISC],
                                   "no-ping"),
    # not a map
    "msgpack array": (lambda c: frame([1, 2, 3]), [BR]),
    "msgpack int": (lambda c: frame(7), [BR]),
    "msgpack str": (lambda c: frame("stats"), [BR]),
    "msgpack nil": (lambda c: frame(None), [BR]),
    "msgpack bin": (lambda c: frame(pack(b"\x00" * 8)), [BR]),
    "msgpack ext type": (lambda c: frame(pack(msgpack.ExtType(5, b"xyz"))), [BR]),
    # ids
    "missing id": (lambda c: frame({"op": "stats"}), [BR]),
    "id a float": (lambda c: frame({"id": 1.5, "op": "stats"}), [BR]),
    "id a list": (lambda c: frame({"id": [1], "op": "stats"}), [BR]),
    "id a bool": (lambda c: frame({"id": True, "op": "stats"}), [BR]),
    "id nil": (lambda c: frame({"id": None, "op": "stats"}), [BR]),
    "id a map": (lambda c: frame({"id": {"a": 1}, "op": "stats"}), [BR]),
    "id bytes": (lambda c: frame({"id": b"\x01", "op": "stats"}), [BR]),
    # ops
    "missing op": (_req(), [BR]),
    "op an int": (_req(op=3), [BR]),
    "op a list": (_req(op=["stats"]), [BR]),
    "op bytes": (_req(op=b"stats"), [BR]),
    "unknown op": (_req(op="launch"), [BR]),
    "op naming a Python attribute": (_req(op="__init__"), [BR]),
    "unknown op of 200 KB (echo?)": (_req(op="x" * 200_000), [BR]),
    "id of 200 KB bytes (echo?)": (lambda c: frame({"id": b"\x00" * 200_000, "op": "stats"}),
                                   [BR]),
    # sessions
    "session missing": (_req(op="info"), [BR]),
    "session an int": (_req(op="info", session=7), [BR]),
    "session a list": (_req(op="extend", session=["x"], tokens=[1]), [BR]),
    "session bytes": (_req(op="generate", session=b"\x00" * 16), [BR]),
    "unknown session (info)": (_req(op="info", session="0" * 32), [NF]),
    "unknown session (extend)": (_req(op="extend", session="f" * 32, tokens=[1]), [NF]),
    "unknown session (generate)": (_req(op="generate", session="x"), [NF]),
    "unknown session (fork)": (_req(op="fork", session=""), [NF]),
    "unknown session (close)": (_req(op="close", session="0" * 32), [NF]),
    "closed session (extend)": (lambda c: frame({"id": 1, "op": "extend", "session": c["closed"],
                                                 "tokens": [1]}), [NF]),
    "closed session (generate)": (lambda c: frame({"id": 1, "op": "generate",
                                                   "session": c["closed"]}), [NF]),
    "closed session (fork)": (lambda c: frame({"id": 1, "op": "fork",
                                               "session": c["closed"]}), [NF]),
    "closed session (close again)": (lambda c: frame({"id": 1, "op": "close",
                                                      "session": c["closed"]}), [NF]),
    # tokens
    "tokens missing": (_on_session("extend"), [BR]),
    "tokens a string": (_ext("1 2 3"), [BR]),
    "tokens a map": (_ext({"0": 1}), [BR]),
    "tokens an int": (_ext(5), [BR]),
    "tokens nil": (_ext(None), [BR]),
    "tokens list of floats": (_ext([1.0, 2.0]), [BR]),
    "tokens list of bools": (_ext([True, False]), [BR]),
    "tokens nested lists": (_ext([[1, 2], [3]]), [BR]),
    "tokens list of strings": (_ext(["1"]), [BR]),
    "token 2**63 (beyond int64)": (_ext([1, 2 ** 63]), [BR]),
    "token 2**64 - 1": (_ext([2 ** 64 - 1]), [BR]),
    "token -2**63": (_ext([-2 ** 63]), [BR]),
    "token -1": (_ext([5, -1]), [BR]),
    "token = vocab_size": (_ext([VOCAB]), [BR]),
    "token int32 bytes, negative": (_ext(np.array([3, -7], "<i4").tobytes()), [BR]),
    "token int32 bytes, >= vocab": (_ext(np.array([VOCAB + 1], "<i4").tobytes()), [BR]),
    "tokens bytes not a multiple of 4": (_ext(b"\x01\x00\x00"), [BR]),
    "empty extend (list)": (_ext([]), [BR]),
    "empty extend (bytes)": (_ext(b""), [BR]),
    "text not a string": (_on_session("extend", text=5), [BR]),
    "extend beyond capacity": (_ext(np.zeros(CAPACITY, "<i4").tobytes()), [CTX]),
    "generate on an empty session": (lambda c: frame({"id": 1, "op": "generate",
                                                      "session": c["empty"]}), [BR]),
    # sampling
    "temperature < 0": (_gen(temperature=-0.5), [BR]),
    "temperature a string": (_gen(temperature="hot"), [BR]),
    "temperature NaN": (_gen(temperature=float("nan")), [BR]),
    "temperature inf": (_gen(temperature=float("inf")), [BR]),
    "temperature 1e300 (inf in f32)": (_gen(temperature=1e300), [BR]),
    "temperature a bool": (_gen(temperature=True), [BR]),
    "top_p 0": (_gen(top_p=0.0), [BR]),
    "top_p 1.5": (_gen(top_p=1.5), [BR]),
    "top_p -0.1": (_gen(top_p=-0.1), [BR]),
    "top_p NaN": (_gen(top_p=float("nan")), [BR]),
    "top_k -1": (_gen(top_k=-1), [BR]),
    "top_k 2**40 (beyond int32)": (_gen(top_k=2 ** 40, temperature=1.0), [BR]),
    "top_k a float": (_gen(top_k=5.0), [BR]),
    "max_tokens 0": (_gen(max_tokens=0), [BR]),
    "max_tokens -1": (_gen(max_tokens=-1), [BR]),
    "max_tokens a float": (_gen(max_tokens=2.0), [BR]),
    "max_tokens a string": (_gen(max_tokens="5"), [BR]),
    "max_tokens 10**9": (_gen(max_tokens=10 ** 9), [CTX]),
    "max_tokens 2**64 - 1": (_gen(max_tokens=2 ** 64 - 1), [CTX]),
    "seed -1": (_gen(seed=-1), [BR]),
    "seed 2**32": (_gen(seed=2 ** 32), [BR]),
    "stop a map": (_gen(stop={"a": 1}), [BR]),
    "stop a string": (_gen(stop="\n"), [BR]),
    "stop list of floats": (_gen(stop=[1.5]), [BR]),
    "logprobs an int": (_gen(logprobs=1), [BR]),
    # several frames on one connection
    "duplicate id in flight": (lambda c: frame({"id": 1, "op": "generate", "session": c["session"],
                                                "max_tokens": 100})
                               + frame({"id": 1, "op": "stats"})
                               + frame({"id": 2, "op": "close", "session": "0" * 32}),
                               ["bad_request(id 1, in flight)", NF, "token...", "done"], "gen"),
}


def _summarise(replies: list[dict], mode: str) -> list[str]:
    """Codes of a case's replies; a generation's token stream is folded into 'token...'."""
    out = []
    for r in replies:
        if r.get("id") == "ping":
            continue
        if r.get("event") == "error":
            if mode == "gen" and r.get("id") == 1 and "in flight" in r.get("message", ""):
                out.append("bad_request(id 1, in flight)")
            else:
                out.append(r["code"])
        elif r.get("event") == "token":
            if not out or out[-1] != "token...":
                out.append("token...")
        else:
            out.append(r["event"])
    return out


def run_case(address: str, data: bytes, mode: str = "ping") -> list[str]:
    """Send `data` on a fresh connection; what came back (see CASES)."""
    with RawConnection(address, timeout=120) as conn:
        conn.send(data)
        if mode == "close":
            return []
        if mode == "shutdown":
            conn.sock.shutdown(socket.SHUT_WR)
        if mode in ("ping", "gen"):
            conn.request({"id": "ping", "op": "stats"})
        replies, last = [], None
        while (reply := conn.read()) is not None:
            replies.append(reply)
            if mode == "ping" and reply.get("id") == "ping":
                last = reply
                break
            if mode == "gen" and reply.get("id") == 1 and reply.get("event") == "done":
                last = reply
                break
        out = _summarise(replies, mode)
        if last is None:
            out.append(DISC)
        for r in replies:
            if r.get("event") == "error":
                assert isinstance(r.get("message"), str) and r["message"]
                assert len(r["message"]) < 2000, "error messages must not echo large inputs"
        return out


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_refused_and_changes_nothing(server, world, ctx, name):
    build, expected, *mode = CASES[name]
    mode = mode[0] if mode else "ping"
    got = run_case(server[1], build(ctx), mode)
    RESULTS[name] = ", ".join(got) or "(nothing; the server drops the connection)"
    assert got == expected
    assert server[0].poll() is None
    if name == "duplicate id in flight":        # the generation ran: take its tokens back
        world.client.session(ctx["session"]).close()
        ctx["session"] = world.client.create_session().id
        world.client.session(ctx["session"]).extend(list(range(20)))


def _wait_idle(client, timeout=120.0):
    deadline = time.monotonic() + timeout
    while client.stats()["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats()["requests"] == 0


def test_two_concurrent_ops_on_one_session(server, world, ctx):
    """The second op on a busy session is refused (bad_request); the first completes."""
    address = server[1]
    tokens = np.random.default_rng(5).integers(0, VOCAB, 700).astype("<i4")
    for first, second in [
        ({"op": "extend", "tokens": tokens.tobytes()}, {"op": "extend", "tokens": [1, 2]}),
        ({"op": "generate", "max_tokens": 30}, {"op": "generate", "max_tokens": 2}),
        ({"op": "generate", "max_tokens": 30}, {"op": "fork"}),
        ({"op": "extend", "tokens": tokens.tobytes()}, {"op": "generate"}),
    ]:
        s = world.client.create_session()
        s.extend(list(range(30)))
        with RawConnection(address) as conn:
            conn.request({"id": 1, "session": s.id, **first})
            conn.request({"id": 2, "session": s.id, **second})
            replies, last = conn.until_done(1)
        second_reply = [r for r in replies if r["id"] == 2]
        assert len(second_reply) == 1 and second_reply[0]["code"] == "bad_request"
        assert "busy" in second_reply[0]["message"]
        assert last["event"] == "done"
        want = 30 + (700 if first["op"] == "extend" else 30)
        assert last["length"] == want and s.info()["length"] == want
        RESULTS[f"concurrent: {first['op']} then {second['op']} on one session"] = (
            f"second: {second_reply[0]['code']}; first: done")
        s.close()
    _wait_idle(world.client)


def test_client_disconnecting_mid_generation(server, world, ctx):
    """Its generation is cancelled (unused pages back at once), the session stays idle and
    whole, and closing it frees its pages."""
    s = world.client.create_session()
    s.extend(list(range(40)))
    with RawConnection(server[1]) as conn:
        conn.request({"id": 1, "op": "generate", "session": s.id, "max_tokens": 3000,
                      "logprobs": True})
        first = conn.read()
        assert first["event"] == "token"
    _wait_idle(world.client)
    info = s.info()
    assert info["busy"] is False and 41 <= info["length"] < 40 + 3000
    assert info["pages"] == -(-info["length"] // 16)        # the reservation went back
    s.close()
    RESULTS["client disconnects mid-generate"] = "generation cancelled; pages back on close"


def test_client_disconnecting_mid_extend(server, world, ctx, tiny):
    """The extend's tokens are in the log when it is accepted: the upload finishes without
    its client, and the session continues exactly like an uninterrupted one."""
    prompt = np.random.default_rng(6).integers(0, VOCAB, 1500).astype("<i4")
    s = world.client.create_session()
    with RawConnection(server[1]) as conn:
        conn.request({"id": 1, "op": "extend", "session": s.id, "tokens": prompt.tobytes()})
        assert conn.read()["event"] == "progress"
    _wait_idle(world.client)
    info = s.info()
    assert (info["length"], info["cached"], info["busy"]) == (1500, 1500, False)
    ref = world.client.create_session()
    ref.extend(prompt)
    a, b = s.generate(max_tokens=3), ref.generate(max_tokens=3)
    assert a.tokens == b.tokens
    s.close()
    ref.close()
    RESULTS["client disconnects mid-extend"] = ("upload completes; next tokens equal an "
                                                "uninterrupted session's")


WARM_TOKENS = 256


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@pytest.mark.slow             # kept out of the default suite for its time budget
def test_slow_client_that_never_reads_is_disconnected(server, world, ctx):
    """Generations with logprobs for a client that never reads: once more than
    max_pending_bytes of replies wait, the server drops it (its generations cancelled); the
    server stays healthy and its memory does not grow with the unread stream."""
    proc, address = server
    sessions = [world.client.create_session() for _ in range(6)]
    for i, s in enumerate(sessions):
        s.extend(list(range(10 + i)))
    with cp_runtime.Client(address) as reader:          # compile the shapes used below
        async_gens = [reader.session(s.id).fork() for s in sessions]
        threads = [threading.Thread(target=f.generate, kwargs=dict(max_tokens=WARM_TOKENS))
                   for f in async_gens]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for f in async_gens:
            f.close()
    rss_before = _rss_kib(proc.pid)
    conn = RawConnection(address, rcvbuf=4096)
    for i, s in enumerate(sessions):
        conn.request({"id": i, "op": "generate", "session": s.id, "max_tokens": 900,
                      "logprobs": True})
    deadline = time.monotonic() + 240
    while world.client.stats()["connections"] > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = world.client.stats()
    assert stats["connections"] == 1, "the server kept a client that never reads"
    _wait_idle(world.client)
    produced = [s.info()["length"] - 10 - i for i, s in enumerate(sessions)]
    assert max(produced) < WARM_TOKENS                  # cut off, not run to the end
    with pytest.raises(OSError):                        # reset (or closed) by the server
        conn.sock.settimeout(10)
        while conn.sock.recv(1 << 16):
            pass
        raise ConnectionResetError("closed")
    conn.close()
    grown_mib = (_rss_kib(proc.pid) - rss_before) / 1024
    assert grown_mib < 64, f"server memory grew by {grown_mib:.0f} MiB"
    for s in sessions:
        assert s.info()["busy"] is False
        s.close()
    RESULTS["slow client never reads (generate, logprobs)"] = (
        f"disconnect after <= {max(produced)} tokens/request; server RSS +{grown_mib:.0f} MiB")


def test_zz_hostile_input_table(capsys):
    """Prints the table of hostile inputs and what each returned."""
    if not RESULTS:
        pytest.skip("no case ran")
    width = max(map(len, RESULTS))
    lines = [f"| {'hostile input':<{width}} | returned |", f"|{'-' * (width + 2)}|----------|"]
    lines += [f"| {name:<{width}} | {got} |" for name, got in RESULTS.items()]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# -- protocol fuzz on the same server ----------------------------------------------------------
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
def fuzz(server):
    """The fuzzer on the module's server, after the cases above (its baseline keeps their
    world's sessions)."""
    proc, address = server
    f = Fuzz(address)
    yield f
    f.check_probe()
    f.client.close()
    assert proc.poll() is None


def _report(fuzz, started: float, n: int) -> None:
    print(f"\nprotocol fuzz: {fuzz.count} examples run ({n} asked) in "
          f"{time.monotonic() - started:.0f} s; errors by code: {fuzz.codes}; other events "
          f"(pings included): {fuzz.events}")


SETTINGS = dict(deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def _run_fuzz(fuzz, capsys, count: int) -> None:
    """`count` hypothesis examples through the server, then the probe's check and a report."""
    started = time.monotonic()

    @settings(max_examples=count, **SETTINGS)
    @given(examples)
    def run(example):
        fuzz.run(example)

    run()
    fuzz.check_probe()
    with capsys.disabled():
        _report(fuzz, started, count)


def test_protocol_fuzz(fuzz, capsys):
    _run_fuzz(fuzz, capsys, FAST_EXAMPLES)


@pytest.mark.slow
def test_protocol_fuzz_long(fuzz, capsys):
    _run_fuzz(fuzz, capsys, SLOW_EXAMPLES)
