"""Helpers for tests that talk to a real server process: starting one on the test model, frames,
a raw connection that collects replies, and the `World` check that a hostile input changed
nothing (free pages, requests in flight, sessions, and every other session's next greedy
token)."""

from __future__ import annotations

import dataclasses
import socket
import struct
import time

import msgpack
import numpy as np

import cp_runtime
from cp_runtime.serving.process import ServerProcess

__all__ = ["STARTUP_S", "TINY_SERVER", "RawConnection", "World", "frame", "pack", "start_server",
           "stop_server"]

# The test model on 16 shards with exact (f32) caches and short chunks; a later flag wins.
TINY_SERVER = ("--model", "tiny", "--shards", "16", "--kv-cache-dtype", "f32",
               "--pages-per-shard", "24", "--chunk-size", "64")
STARTUP_S = 120


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def frame(body) -> bytes:
    """A length-prefixed frame of `body` (bytes as they are, anything else msgpack-packed)."""
    if not isinstance(body, (bytes, bytearray)):
        body = pack(body)
    return struct.pack(">I", len(body)) + bytes(body)


def start_server(*extra: str, env: dict[str, str] | None = None) -> ServerProcess:
    """A listening `cp-runtime serve` on the test model, `extra` flags after TINY_SERVER's;
    `env` adds variables to its environment."""
    return ServerProcess([*TINY_SERVER, *extra], env=env, startup_s=STARTUP_S)


def stop_server(server: ServerProcess) -> None:
    """SIGTERM, and the clean exit it must bring (the log's tail says why not)."""
    assert server.stop() == 0, server.log()[-4000:]


class RawConnection:
    """A raw socket to the server; `replies()` reads frames until a predicate or the end."""

    def __init__(self, address: str, timeout: float = 60.0, rcvbuf: int | None = None):
        host, port = address.rsplit(":", 1)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect((host, int(port)))
        self.closed_by_server = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, message: dict) -> None:
        self.send(frame(message))

    def read(self) -> dict | None:
        """The next reply map, or None when the server has closed the connection."""
        try:
            head = self._exactly(4)
            if head is None:
                return None
            (n,) = struct.unpack(">I", head)
            body = self._exactly(n)
            if body is None:
                return None
        except (ConnectionResetError, BrokenPipeError):
            self.closed_by_server = True
            return None
        return msgpack.unpackb(body, raw=False, strict_map_key=False)

    def _exactly(self, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(n - got)
            if not chunk:
                self.closed_by_server = True
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def until_done(self, rid) -> tuple[list[dict], dict | None]:
        """Replies up to the last event (done or error) of request `rid`: (every reply read,
        that last event or None when the connection ended first)."""
        seen = []
        while (reply := self.read()) is not None:
            seen.append(reply)
            if reply.get("id") == rid and reply.get("event") in ("done", "error"):
                return seen, reply
        return seen, None

    def call(self, op: str, rid=0, **fields) -> dict:
        self.request({"id": rid, "op": op, **fields})
        _, last = self.until_done(rid)
        assert last is not None, f"{op}: connection closed"
        return last

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclasses.dataclass
class World:
    """Sessions that hostile inputs must not touch, and the state to compare against.

    `victims` are sessions with prompts; `probe()` forks each, generates one greedy token on
    the fork, closes the fork, and returns the tokens. `snapshot()` is pages per shard,
    requests in flight, session count, victims' lengths and the probe tokens."""

    client: cp_runtime.Client
    victims: list

    @classmethod
    def build(cls, client: cp_runtime.Client, vocab_size: int, lengths=(37, 70)) -> "World":
        victims = []
        for i, n in enumerate(lengths):
            s = client.create_session()
            s.extend(np.random.default_rng(100 + i).integers(0, vocab_size, n).tolist())
            victims.append(s)
        return cls(client, victims)

    def probe(self) -> list[int]:
        out = []
        for v in self.victims:
            child = v.fork()
            out.append(child.generate(max_tokens=1).tokens[0])
            child.close()
        return out

    def snapshot(self, settle_s: float = 10.0) -> dict:
        """The state; waits (up to settle_s) for requests in flight to end first."""
        deadline = time.monotonic() + settle_s
        while True:
            stats = self.client.stats()
            if stats["requests"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return {"pages": stats["pages_used_per_shard"], "requests": stats["requests"],
                "sessions": stats["sessions"],
                "lengths": [v.info()["length"] for v in self.victims],
                "busy": [v.info()["busy"] for v in self.victims],
                "probe": self.probe()}
