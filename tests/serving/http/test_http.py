"""The OpenAI-compatible HTTP API of a real `cp-runtime serve --http-port` process, driven by
the `openai` SDK and by raw sockets: the same engine as the session protocol, exact greedy
tokens, streaming, errors in OpenAI's shape, a client leaving mid-stream, health, metrics, and
chat through a checkpoint's template."""

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

import cp_runtime
from conftest import random_tokens
from cp_runtime.serving.process import ServerProcess
from serving_helpers import start_server, stop_server
from test_state import greedy_continuation

TOKEN = "s3cret-token"


def start_http_server(*extra: str) -> ServerProcess:
    """The test model's server with its HTTP door on a free port."""
    return start_server("--http-port", "0", *extra)


@pytest.fixture(scope="module")
def served_http():
    server = start_http_server("--auth-token", TOKEN, "--max-frame-bytes", "65536")
    yield server.address, server.http_address, server
    stop_server(server)


def request(http, method, path, body=None, *, token=TOKEN, raw: bytes | None = None,
            headers=None):
    """(status, headers, parsed JSON or text) of one HTTP request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://{http}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"}
                                             if token else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, head, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, head, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, head, json.loads(text)
    except ValueError:
        return status, head, text


def test_completions_equal_the_session_protocol_and_the_oracle(served_http, tiny, tiny_params):
    address, http, _ = served_http
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key=TOKEN, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = random_tokens(tiny, 40, 11)
    want = greedy_continuation(tiny_params, tiny, prompt, 5)
    done = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                     logprobs=1, extra_body={"return_token_ids": True})
    choice = done.choices[0]
    assert choice.token_ids == want and done.prompt_token_ids == prompt
    assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == 5
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (40, 5)
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    streamed = [t for c in chunks for ch in c.choices for t in ch.token_ids]
    assert streamed == want and chunks[-1].usage.completion_tokens == 5
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "length"
    # A stop token ends it early, as in the session protocol.
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                        temperature=0,
                                        extra_body={"return_token_ids": True,
                                                    "stop_token_ids": [want[2]]})
    assert stopped.choices[0].token_ids == want[:3]
    with cp_runtime.Client(address, token=TOKEN) as c:
        sessions = c.stats()["sessions"]
        s = c.create_session()
        s.extend(prompt[:20])
        # A session of the session protocol, continued over HTTP by its id, and back.
        more = client.completions.create(model="tiny", prompt=prompt[20:], max_tokens=5,
                                         temperature=0, extra_body={"return_token_ids": True,
                                                                    "session": s.id})
        assert more.choices[0].token_ids == want and more.session == s.id
        assert s.info()["length"] == 45
        assert s.generate(max_tokens=2).tokens == greedy_continuation(
            tiny_params, tiny, prompt + want, 2)
        kept = client.completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                         temperature=0, extra_body={"session": True})
        assert c.session(kept.session).info()["length"] == 41
        # Only the two kept: a stateless completion's session is a prefix-cache entry.
        assert c.stats()["sessions"] == sessions + 2


def test_errors_have_openai_shape_and_change_nothing(served_http, tiny):
    address, http, _ = served_http
    with cp_runtime.Client(address, token=TOKEN) as c:
        before = c.stats()
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
    cases = [
        (dict(body=body, token=None), 401, "unauthorized"),
        (dict(body=body, token="wrong"), 401, "unauthorized"),
        (dict(body={**body, "model": "gpt-9"}), 404, "not_found"),
        (dict(raw=b"{not json"), 400, "bad_request"),
        (dict(body={**body, "max_tokens": "many"}), 400, "bad_request"),
        (dict(body={**body, "prompt": [1, 999]}), 400, "bad_request"),
        (dict(body={**body, "best_of": 3}), 400, "bad_request"),
        (dict(body={**body, "prompt": ""}), 400, "bad_request"),            # empty text
        (dict(raw=b"x" * 70000), 413, "bad_request"),                       # max_frame_bytes
        # Never fits (past max_model_len): 400, not a 429 a client would retry.
        (dict(body={**body, "max_tokens": 10 ** 6}), 400, "context_length_exceeded"),
    ]
    for kw, status, code in cases:
        got, head, answer = request(http, "POST", "/v1/completions", **kw)
        assert (got, answer["error"]["code"]) == (status, code), (kw, answer)
        assert set(answer["error"]) >= {"message", "type", "code", "param"}
        assert "retry-after" not in {k.lower() for k in head}
    assert answer["error"]["param"] == "max_tokens"
    assert "maximum context length is 6144 tokens" in answer["error"]["message"]
    got, _, answer = request(http, "POST", "/v1/chat/completions",   # tiny's template: 400
                             {"messages": [{"role": "narrator", "content": "hi"}]})
    assert got == 400 and "chat template" in answer["error"]["message"]
    sdk = openai.OpenAI(base_url=f"http://{http}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        sdk.completions.create(model="tiny", prompt=[1], max_tokens=1)
    with cp_runtime.Client(address, token=TOKEN) as c:           # nothing changed
        after = c.stats()
    for key in ("sessions", "requests", "pages_used_per_shard", "prefill_tokens_total"):
        assert after[key] == before[key], key


def _ids(response) -> list[int]:
    return response.output[0].content[0].token_ids


def test_responses_continue_their_session_and_fork_where_two_continue(served_http, tiny,
                                                                      tiny_params):
    address, http, _ = served_http
    sdk = openai.OpenAI(base_url=f"http://{http}/v1", api_key=TOKEN, max_retries=0)
    prompt = random_tokens(tiny, 30, 21)
    ask = dict(model="tiny", max_output_tokens=3, temperature=0,
               extra_body={"return_token_ids": True})
    first = sdk.responses.create(input=prompt, **ask)
    a = _ids(first)
    assert a == greedy_continuation(tiny_params, tiny, prompt, 3)
    assert first.status == "incomplete" and first.incomplete_details.reason == \
        "max_output_tokens"
    # Continued in place: only the new input is sent and prefilled.
    second = sdk.responses.create(input=[7, 8], previous_response_id=first.id, **ask)
    b = _ids(second)
    assert b == greedy_continuation(tiny_params, tiny, prompt + a + [7, 8], 3)
    assert second.usage.input_tokens == 2 and second.session == first.session
    # A second continuation of `first` forks at its end, beside `second`'s.
    third = sdk.responses.create(input=[9], previous_response_id=first.id, **ask)
    assert _ids(third) == greedy_continuation(tiny_params, tiny, prompt + a + [9], 3)
    assert third.session != first.session and third.previous_response_id == first.id

    async def stream_on():                          # the async SDK, streamed
        client = openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key=TOKEN, max_retries=0)
        events = [e async for e in await client.responses.create(
            input=[4], previous_response_id=second.id, stream=True, **ask)]
        await client.close()
        return events
    events = asyncio.run(stream_on())
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    deltas = [t for e in events if e.type == "response.output_text.delta" for t in e.token_ids]
    assert deltas == greedy_continuation(tiny_params, tiny, prompt + a + [7, 8] + b + [4], 3)
    assert events[-1].type == "response.incomplete" and events[-1].response.id.startswith(
        f"resp_{first.session}_")
    with cp_runtime.Client(address, token=TOKEN) as c:        # the session protocol sees it
        assert c.session(first.session).info()["length"] == 30 + 3 + 2 + 3 + 1 + 3
    # Unknown, malformed and deleted ids are 404 in OpenAI's shape.
    sdk.responses.delete(third.id)
    for rid in (third.id, "resp_" + "0" * 32 + "_3", "resp_nope", first.id[:-2] + "99999"):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.create(input=[1], previous_response_id=rid, **ask)


def test_stateless_prompts_reuse_cached_prefixes_exactly(served_http, tiny, tiny_params):
    _, http, _ = served_http
    sdk = openai.OpenAI(base_url=f"http://{http}/v1", api_key=TOKEN, max_retries=0)
    doc = random_tokens(tiny, 100, 31)
    questions = [[3, 1, 4], [3, 2, 7]]
    done = [sdk.completions.create(model="tiny", prompt=doc + q, max_tokens=3, temperature=0,
                                   extra_body={"return_token_ids": True}) for q in questions]
    for q, d in zip(questions, done):
        assert d.choices[0].token_ids == greedy_continuation(tiny_params, tiny, doc + q, 3)
    # The second reuses the first's document and the question's first token, no more.
    assert done[1].usage.prompt_tokens_details.cached_tokens == 101
    text = request(http, "GET", "/metrics", token=None)[2]
    assert "cp_runtime_cached_prompt_tokens_total" in text and "cp_runtime_prefix_cache_hits"\
        in text
    # The raw framing of both streams: `data: {json}` events ending in `data: [DONE]`; the
    # responses' with an `event:` line naming each type, and no [DONE].
    for path, body in (("/v1/completions", {"prompt": doc, "max_tokens": 2, "stream": True}),
                       ("/v1/responses", {"input": doc, "max_output_tokens": 2,
                                          "stream": True, "store": False})):
        status, head, raw = request(http, "POST", path, body)
        head = {k.lower(): v for k, v in head.items()}
        assert status == 200 and head["content-type"].startswith("text/event-stream")
        events = raw.split("\n\n")
        assert events[-1] == "" and all(e.startswith(("data: ", "event: ")) for e in events[:-1])
        if path == "/v1/completions":
            assert events[-2] == "data: [DONE]" and len(events) == 2 + 3   # 2 tokens, the end
            assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-2])
        else:
            kinds = [e.split("\n")[0][7:] for e in events[:-1]]
            assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
            assert all(json.loads(e.split("\n")[1][6:])["type"] == k
                       for e, k in zip(events, kinds))


def test_a_client_leaving_mid_stream_gives_its_pages_back(served_http):
    address, http, _ = served_http
    with cp_runtime.Client(address, token=TOKEN) as c:
        before = c.stats()
        body = json.dumps({"prompt": [5] * 30, "max_tokens": 2000, "stream": True}).encode()
        host, port = http.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            got = b""
            while b"data: " not in got:               # streaming has begun
                got += sock.recv(65536)
            assert c.stats()["sessions"] == before["sessions"] + 1
        deadline = time.monotonic() + 30
        while c.stats()["requests"] and time.monotonic() < deadline:
            time.sleep(0.1)
        after = c.stats()
        assert after["requests"] == 0 and after["sessions"] == before["sessions"]
        assert after["pages_used_per_shard"] == before["pages_used_per_shard"]
        assert after["decode_tokens_total"] - before["decode_tokens_total"] < 1000


def test_health_is_open_and_metrics_count_what_was_served(served_http):
    _, http, _ = served_http
    assert request(http, "GET", "/health", token=None)[:3:2] == (200, {"status": "ok"})
    request(http, "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    status, _, text = request(http, "GET", "/metrics", token=None)
    assert status == 200
    for name in ("cp_runtime_http_requests_total", "cp_runtime_prompt_tokens_total",
                 "cp_runtime_generation_tokens_total", "cp_runtime_time_to_first_token_seconds",
                 "cp_runtime_inter_token_seconds", "cp_runtime_step_seconds",
                 "cp_runtime_queued_requests", "cp_runtime_pages_used", "cp_runtime_sessions",
                 "cp_runtime_sessions_restoring"):
        assert name in text, name
    assert 'cp_runtime_http_requests_total{code="200",endpoint="completions"}' in text
    assert 'cp_runtime_http_requests_total{code="401",endpoint="completions"}' in text


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_through_a_checkpoints_template(tmp_path):
    from test_checkpoint import HF_CONFIG, checkpoint_tensors, expected_config, split_shards
    from test_checkpoint import write_shards, write_tokenizer

    d = tmp_path / "tiny-v32"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    write_shards(d, split_shards(checkpoint_tensors(expected_config(d.name), seed=3)[0]))
    write_tokenizer(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config,
                                                         "chat_template": CHAT_TEMPLATE}))
    server = start_http_server("--checkpoint", str(d))
    address, http = server.address, server.http_address
    try:
        messages = [{"role": "user", "content": "what is the registered code?"}]
        sdk = openai.OpenAI(base_url=f"http://{http}/v1", api_key="none", max_retries=0)
        done = sdk.chat.completions.create(model=str(d), messages=messages, max_tokens=4,
                                           temperature=0, extra_body={"return_token_ids": True})
        status, _, rendered = request(http, "POST", "/tokenize", {
            "prompt": "<｜begin▁of▁sentence｜><|user|>what is the registered code?"
                      "<|assistant|>"})
        assert done.prompt_token_ids == rendered["tokens"]
        chunks = list(sdk.chat.completions.create(model=str(d), messages=messages,
                                                  max_tokens=4, temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == done.choices[0].message.content
        assert request(http, "POST", "/detokenize",
                       {"tokens": done.choices[0].token_ids})[2]["prompt"] == text
        # A response continued renders only the new turn, after the tokens its session holds.
        first = sdk.responses.create(model=str(d), input="what is the registered code?",
                                     max_output_tokens=3, temperature=0)
        assert first.usage.input_tokens == len(rendered["tokens"])
        more = sdk.responses.create(model=str(d), input="and the other?", max_output_tokens=3,
                                    temperature=0, previous_response_id=first.id)
        turn = request(http, "POST", "/tokenize",
                       {"prompt": "<|user|>and the other?<|assistant|>"})[2]["tokens"]
        assert more.usage.input_tokens == len(turn) and more.session == first.session
        with cp_runtime.Client(address) as c:
            assert c.session(first.session).info()["length"] == \
                len(rendered["tokens"]) + 3 + len(turn) + 3
    finally:
        stop_server(server)
