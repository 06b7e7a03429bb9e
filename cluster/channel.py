"""A persistent channel per worker: one TCP connection from the executor to each worker, frames
of (8-byte length, pickle). A step's plan goes out as one frame and its outputs come back as
one, skipping Ray's task submission and object store on the hot path (an actor call costs
about a millisecond; a frame on an open connection a fraction of that).

The connection opens with a secret the executor handed the worker through Ray (`open`); the
worker drops a connection that does not present it first, so nothing else on the network can
send it a pickle.
"""

from __future__ import annotations

import hmac
import pickle
import select
import socket
import struct

__all__ = ["ChannelClosed", "connect", "listen", "recv", "send", "wait_readable"]

_HEADER = struct.Struct("<Q")


class ChannelClosed(ConnectionError):
    """The other end went away (its process died)."""


def send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelClosed("channel closed")
        got += k
    return bytes(buf)


def recv(sock: socket.socket):
    (n,) = _HEADER.unpack(_exact(sock, _HEADER.size))
    return pickle.loads(_exact(sock, n))


def wait_readable(socks: list[socket.socket], timeout_s: float) -> list[socket.socket]:
    ready, _, _ = select.select(socks, [], [], timeout_s)
    return ready


def listen(host: str) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, 0))
    srv.listen(1)
    return srv


def accept(srv: socket.socket, secret: bytes, timeout_s: float = 60.0) -> socket.socket:
    """The first connection that presents `secret` (others are dropped)."""
    srv.settimeout(timeout_s)
    while True:
        conn, _ = srv.accept()
        conn.settimeout(timeout_s)
        try:
            presented = _exact(conn, len(secret))
        except (OSError, ChannelClosed):
            conn.close()
            continue
        if hmac.compare_digest(presented, secret):
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            srv.close()
            return conn
        conn.close()


def connect(address: str, secret: bytes, timeout_s: float = 60.0) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(secret)
    sock.settimeout(None)
    return sock
