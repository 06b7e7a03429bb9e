"""The HTTP door's bounds on one real `cp-runtime serve --http-port` process
(cp_runtime.serving.http.listener): a client trickling its request head or body is answered 408
and closed after the read timeout, and one trickling the rest of a body already answered is
closed, while others are served; a connection past max_connections is answered 503 in
OpenAI's shape with Retry-After, and /health and /metrics are still answered on it; /health
says 503 "restoring" while sessions come back from --state-dir, then 200."""

import json
import secrets
import socket
import threading
import time

import numpy as np
import pytest

from cp_runtime.serving.state.token_store import TokenStore
from serving_helpers import stop_server
from test_http import request, start_http_server

READ_TIMEOUT_S = 3              # --idle-timeout-s 3 caps the listener's read timeout at 3 s
MAX_CONNECTIONS = 5
# Sessions restored at start: 8 logs of 4 prefill chunks each (one step shape, the one the
# other server tests compile) take ~32 steps, a window /health cannot miss.
RESTORED_SESSIONS, RESTORED_TOKENS = 8, 256
VOCAB = 256                     # the tiny model's


def _state_dir(root) -> str:
    store = TokenStore(root)
    for i in range(RESTORED_SESSIONS):
        session = secrets.token_hex(16)
        store.create(session)
        store.append({session: np.random.default_rng(i).integers(0, VOCAB, RESTORED_TOKENS)
                      .tolist()})
    return str(root)


class _HealthWatch:
    """/health polled from the server's first moment until it says 200: (status, headers,
    body) of each answer."""

    def __init__(self, http: str, deadline_s: float = 120):
        self.answers: list[tuple] = []
        self._thread = threading.Thread(target=self._poll, args=(http, deadline_s))
        self._thread.start()

    def _poll(self, http: str, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            answer = request(http, "GET", "/health", token=None)
            self.answers.append(answer)
            if answer[0] == 200:
                return
            time.sleep(0.05)

    def done(self) -> list[tuple]:
        self._thread.join()
        return self.answers


@pytest.fixture(scope="module")
def limited_http(tmp_path_factory):
    state = _state_dir(tmp_path_factory.mktemp("state"))
    server = start_http_server("--state-dir", state, "--max-connections", str(MAX_CONNECTIONS),
                               "--idle-timeout-s", str(READ_TIMEOUT_S))
    health = _HealthWatch(server.http_address)
    yield server.http_address, health
    health.done()
    stop_server(server)


def _connect(http: str) -> socket.socket:
    host, port = http.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _trickle(sock: socket.socket, data: bytes, gap_s: float = 0.1) -> tuple[bytes, float]:
    """Send `data` a byte every `gap_s` until the server closes the connection: (what it
    answered, seconds until it closed)."""
    t0, got = time.monotonic(), b""
    sock.settimeout(gap_s)
    for i in range(len(data) * 100):
        try:
            if i < len(data):
                sock.send(data[i: i + 1])
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except OSError:                          # reset after the answer: closed all the same
            break
        if not chunk:
            break
        got += chunk
    return got, time.monotonic() - t0


def _parse(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _in_background(fn, *args):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    return thread, out


def _post(length: int) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % length)


def test_a_trickled_request_is_closed_within_the_read_timeout(limited_http):
    http, _ = limited_http
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode() + b" " * 500
    with _connect(http) as slow_head, _connect(http) as slow_body, _connect(http) as rest:
        slow_body.sendall(_post(len(body)))      # the head whole at once, then the body slowly
        rest.sendall(_post(1 << 40))             # answered 413 at once; its body never ends
        heads = _in_background(_trickle, slow_head, head)
        bodies = _in_background(_trickle, slow_body, body)
        rests = _in_background(_trickle, rest, b"x" * 1000)
        time.sleep(1)
        # Meanwhile another client is served (the slow ones hold three slots of five).
        status, _, models = request(http, "GET", "/v1/models", token=None)
        assert status == 200 and models["data"][0]["id"] == "tiny"
        answers = {}
        for part, (thread, out) in (("head", heads), ("body", bodies), ("rest", rests)):
            thread.join()
            raw, closed_after = out[0]
            assert READ_TIMEOUT_S - 0.5 < closed_after < READ_TIMEOUT_S + 3, (part, closed_after)
            answers[part] = _parse(raw)
    for part in ("head", "body"):
        status, headers, answer = answers[part]
        assert status == 408 and headers["connection"] == "close"
        assert answer["error"]["code"] == "bad_request"
        assert f"the request {part} was not received" in answer["error"]["message"]
    status, _, answer = answers["rest"]                  # its own answer, and no 408 after it
    assert status == 413 and answer["error"]["code"] == "bad_request"


def test_a_connection_past_the_limit_is_refused_in_openai_shape(limited_http):
    http, health = limited_http
    health.done()                        # its polls would take slots of their own
    holders = [_connect(http) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in holders:              # each holds a slot, kept alive after its answer
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        status, headers, answer = request(http, "GET", "/v1/models", token=None)
        headers = {k.lower(): v for k, v in headers.items()}
        assert status == 503 and headers["retry-after"] == "1"
        assert headers["connection"] == "close"
        assert answer["error"]["code"] == "unavailable"
        assert answer["error"]["type"] == "service_unavailable_error"
        assert f"max_connections={MAX_CONNECTIONS}" in answer["error"]["message"]
        # Probes and scrapers are answered past the limit (a liveness probe failing here would
        # restart a server that is merely busy).
        assert request(http, "GET", "/health", token=None)[:3:2] == (200, {"status": "ok"})
        assert request(http, "GET", "/metrics", token=None)[0] == 200
    finally:
        for sock in holders:
            sock.close()
    deadline = time.monotonic() + 10     # the slots come back once the holders are gone
    while request(http, "GET", "/v1/models", token=None)[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_an_unparseable_request_is_answered_in_openai_shape(limited_http):
    http, _ = limited_http
    with _connect(http) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status, _, answer = _parse(raw)
    assert status == 400 and answer["error"]["code"] == "bad_request"


def test_health_is_503_restoring_while_sessions_come_back_then_200(limited_http):
    _, health = limited_http
    answers = health.done()
    statuses = [status for status, _, _ in answers]
    assert statuses[-1] == 200 and answers[-1][2] == {"status": "ok"}
    assert statuses[0] == 503 and set(statuses[:-1]) == {503}, statuses
    status, headers, body = answers[0]
    assert body["status"] == "restoring"
    assert 1 <= body["sessions_restoring"] <= RESTORED_SESSIONS
    assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
