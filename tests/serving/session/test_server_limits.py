"""Limits, session ids and authentication, against one real server process started with small
limits and an auth token: each limit's refusal carries its error code and a message naming the
limit, and the server stays healthy after each."""

from __future__ import annotations

import dataclasses
import re
import socket
import struct
import time
import types

import numpy as np
import pytest

import cp_runtime
from cp_runtime.cli.main import build_parser
from cp_runtime.serving.backend import ServerLimits
from cp_runtime.serving.session import server as server_module
from cp_runtime.serving.session.protocol import BadRequestError, CapacityError, UnauthorizedError
from serving_helpers import RawConnection, frame, start_server, stop_server

TOKEN = "s3cret-token"
LIMITS = ServerLimits(max_frame_bytes=4096, max_sessions=4, max_tokens_per_request=100,
                      max_connections=3, max_pending_bytes=8192)


@pytest.fixture(scope="module")
def server():
    flags = []
    for f in dataclasses.fields(LIMITS):
        flags += ["--" + f.name.replace("_", "-"), str(getattr(LIMITS, f.name))]
    server = start_server("--pages-per-shard", "8", "--auth-token", TOKEN, *flags)
    try:
        yield server.proc, server.address
    finally:
        stop_server(server)


def healthy(address: str) -> dict:
    """A fresh connection authenticates and gets stats; nothing is left in flight."""
    with cp_runtime.Client(address, token=TOKEN) as c:
        deadline = time.monotonic() + 30
        # Closed connections are dropped by the server's event loop a moment later.
        while ((stats := c.stats())["requests"] or stats["connections"] > 1) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats["requests"] == 0
        return stats


def authed(address: str, **kw) -> RawConnection:
    conn = RawConnection(address, **kw)
    assert conn.call("hello", rid="auth", token=TOKEN)["event"] == "done"
    return conn


def test_serve_flags_set_every_limit_with_safe_defaults():
    parser = build_parser()
    defaults = parser.parse_args(["serve"])
    for f in dataclasses.fields(ServerLimits):
        assert getattr(defaults, f.name) == f.default > 0
    args = parser.parse_args(["serve", "--max-frame-bytes", "10", "--max-connections", "2"])
    assert (args.max_frame_bytes, args.max_connections) == (10, 2)
    for f in dataclasses.fields(ServerLimits):
        for bad in ("0", "-1", "x"):
            with pytest.raises(SystemExit):
                parser.parse_args(["serve", "--" + f.name.replace("_", "-"), bad])
    with pytest.raises(ValueError, match="max_sessions=0"):
        ServerLimits(max_sessions=0)
    d = ServerLimits()                 # safe defaults: bounded, and a 1M-token upload fits
    assert d.max_frame_bytes <= 64 << 20 and d.max_pending_bytes <= 64 << 20
    assert d.max_connections <= 1024 and d.max_tokens_per_request * 4 <= d.max_frame_bytes


def test_hello_reports_the_limits(server):
    with cp_runtime.Client(server[1], token=TOKEN) as c:
        assert c.server["limits"] == dataclasses.asdict(LIMITS)


def test_max_frame_bytes(server):
    with authed(server[1]) as conn:
        conn.send(frame({"id": 1, "op": "stats", "pad": "x" * 4000}))     # just under: fine
        assert conn.until_done(1)[1]["event"] == "done"
        conn.send(struct.pack(">I", 4097) + b"\x00" * 4097)
        reply = conn.read()
        assert reply["code"] == "bad_request" and "max_frame_bytes=4096" in reply["message"]
        assert conn.read() is None                                     # and it is closed
    healthy(server[1])


def test_max_tokens_per_request(server):
    with cp_runtime.Client(server[1], token=TOKEN) as c:
        s = c.create_session()
        before = c.stats()["pages_used_per_shard"]
        with pytest.raises(BadRequestError, match="max_tokens_per_request=100"):
            s.extend(np.zeros(101, np.int32), chunk_tokens=101)
        assert c.stats()["pages_used_per_shard"] == before and s.info()["length"] == 0
        assert s.extend(np.zeros(100, np.int32), chunk_tokens=100) == {"length": 100}
        s.close()
    healthy(server[1])


def test_max_sessions(server):
    with cp_runtime.Client(server[1], token=TOKEN) as c:
        sessions = [c.create_session() for _ in range(4)]
        with pytest.raises(CapacityError, match="max_sessions=4"):
            c.create_session()
        sessions[0].extend([1, 2, 3])
        with pytest.raises(CapacityError, match="max_sessions=4"):
            sessions[0].fork()
        assert c.stats()["sessions"] == 4
        sessions.pop().close()
        sessions.append(c.create_session())                            # room again
        for s in sessions:
            s.close()
    assert healthy(server[1])["sessions"] == 0


def test_max_connections(server):
    address = server[1]
    with cp_runtime.Client(address, token=TOKEN) as c:
        held = [RawConnection(address), RawConnection(address)]        # 3 connections now
        refused = RawConnection(address)
        reply = refused.read()
        assert (reply["id"], reply["code"]) == (None, "unavailable")
        assert "max_connections=3" in reply["message"]
        assert refused.read() is None
        refused.close()
        assert c.stats()["connections"] == 3                           # the server lives on
        held.pop().close()
        deadline = time.monotonic() + 10
        while c.stats()["connections"] > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with authed(address) as again:                                 # room again
            assert again.call("stats", rid=1)["event"] == "done"
        for h in held:
            h.close()
    healthy(address)


def test_max_pending_bytes(server):
    """A client that sends requests and never reads the replies is dropped once more than
    max_pending_bytes of replies wait for it."""
    address = server[1]
    conn = authed(address, rcvbuf=4096)
    for i in range(2000):
        try:
            conn.request({"id": i, "op": "stats"})
        except OSError:                        # dropped while we were still sending
            break
    conn.sock.settimeout(10)
    with pytest.raises(OSError):
        while conn.sock.recv(1 << 16):
            pass
        raise ConnectionResetError("closed")
    conn.close()
    assert healthy(address)["connections"] == 1


def test_session_ids_are_128_random_bits_and_never_repeat(server):
    ids = []
    with authed(server[1]) as conn:
        for _ in range(400):
            for k in range(4):
                conn.request({"id": f"c{k}", "op": "create"})
            created = [conn.until_done(f"c{k}")[1]["session"] for k in range(4)]
            for k, sid in enumerate(created):
                conn.request({"id": f"x{k}", "op": "close", "session": sid})
            for k in range(4):
                assert conn.until_done(f"x{k}")[1]["event"] == "done"
            ids += created
    assert len(ids) == 1600 and len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    bits = np.array([[int(i, 16) >> b & 1 for b in range(128)] for i in ids])
    share = bits.mean(0)                              # every bit set about half the time
    assert share.min() > 0.4 and share.max() < 0.6


def test_a_wrong_token_is_refused_and_closes_the_connection(server):
    address = server[1]
    for token in ("wrong", "", TOKEN + "x", TOKEN[:-1], 12345, None, ["s3cret-token"]):
        with RawConnection(address) as conn:
            conn.request({"id": 1, "op": "hello", "token": token})
            reply = conn.read()
            assert (reply["id"], reply["code"]) == (1, "unauthorized")
            assert conn.read() is None                     # closed after the refusal
    with RawConnection(address) as conn:                   # other ops before hello: refused
        for op in ("stats", "create", "sessions", "launch"):
            reply = conn.call(op, rid=op)
            assert reply["code"] in ("unauthorized", "bad_request")
            assert reply["code"] == "unauthorized" or op == "launch"
        assert conn.call("hello", rid="h", token=TOKEN)["event"] == "done"
        assert conn.call("stats", rid="s")["sessions"] == 0
    with pytest.raises(UnauthorizedError):
        cp_runtime.Client(address, token="wrong")
    healthy(address)


def test_the_token_is_compared_with_hmac_compare_digest(monkeypatch):
    calls = []

    def compare(a, b):
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(server_module.hmac, "compare_digest", compare)
    fake = types.SimpleNamespace(_token=TOKEN.encode())
    assert server_module.Server.authorized(fake, TOKEN) is True
    assert server_module.Server.authorized(fake, "nope") is False
    assert server_module.Server.authorized(fake, 7) is False
    assert calls == [(TOKEN.encode(), TOKEN.encode()), (b"nope", TOKEN.encode()),
                     (b"", TOKEN.encode())]


def test_a_quiet_connection_is_closed_after_the_idle_timeout_and_frees_its_slot():
    server = start_server("--pages-per-shard", "4", "--max-connections", "1",
                          "--idle-timeout-s", "1")
    address = server.address
    try:
        host, port = address.rsplit(":", 1)
        quiet = socket.create_connection((host, int(port)), timeout=30)
        t0 = time.monotonic()
        assert quiet.recv(1) == b""                  # closed by the server, nothing sent
        waited = time.monotonic() - t0
        assert 0.5 <= waited < 10, waited            # the clock starts at accept
        quiet.close()
        with cp_runtime.Client(address) as c:        # the only slot is free again
            assert c.stats()["connections"] == 1
    finally:
        stop_server(server)
