"""Every standard sampling field: the device sampler (cp_runtime.model.sampler, with the step
arrays cp_runtime.engine.plans builds) against a numpy sampler applied to the same logits;
the fields' checks; and, through a real server, what an HTTP client (and a session-protocol
client) sees: n choices forked from one prefilled prompt, top log-probabilities, stop strings,
min_tokens and ignore_eos around the EOS, neutral values, unknown fields ignored, and
`--strict-fields` refusing them."""

import concurrent.futures
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

import cp_runtime
from cp_runtime.engine.plans import sampling_arrays
from cp_runtime.engine.requests import BadRequest, SamplingParams
from cp_runtime.model.sampler import (MAX_TOP_LOGPROBS, PENALTY_WINDOW, SamplingArrays,
                                      adjust_logits, sample_tokens)
from cp_runtime.serving.http import openai_format as fmt
from serving_helpers import start_server, stop_server
from test_http import request

sample = jax.jit(sample_tokens)
VOCAB = 300


# -- the numpy sampler ------------------------------------------------------------------------
def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def reference(logits: np.ndarray, p: SamplingParams, seed: int, position: int, log: list[int],
              produced: int) -> tuple[int, float, list[tuple[int, float]]]:
    """One row, as vLLM samples it: logit bias and min_tokens' bans, then the penalties over
    the log's last PENALTY_WINDOW ids (its last `produced` are the output), then greedy, or
    temperature, min_p, top_k, top_p and a Gumbel-max draw with the noise the sampler's
    docstring specifies. Returns the token, the model's log-probability of it, and the
    `top_logprobs` most likely (id, log-probability) pairs."""
    x = logits.astype(np.float32).copy()
    vocab = x.size
    for t, b in p.logit_bias:
        x[t] += np.float32(b)
    if produced < p.min_tokens:
        x[list(p.stop)] = -np.inf
    if p.penalized:
        recent = np.asarray(log[-PENALTY_WINDOW:], np.int64)
        output = recent[len(recent) - min(produced, len(recent)):]
        counts = np.bincount(output, minlength=vocab).astype(np.float32)
        seen = np.zeros(vocab, bool)
        seen[recent] = True
        r = np.float32(p.repetition_penalty)
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
        x = (x - np.float32(p.frequency_penalty) * counts
             - np.float32(p.presence_penalty) * (counts > 0).astype(np.float32))
    if p.temperature == 0:
        token = int(np.argmax(x))
    else:
        s = x / np.float32(p.temperature)
        noise = np.asarray(jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), position),
                                             (vocab,), jnp.float32))
        order = np.lexsort((np.arange(vocab), -s))         # descending, lowest id on a tie
        values = s[order]
        probs = _softmax(values)
        keep = probs >= np.float32(p.min_p) * probs[0]
        if p.top_k:
            keep &= np.arange(vocab) < p.top_k
        if p.top_p < 1:
            kept = _softmax(np.where(keep, values, -np.inf))
            keep &= np.cumsum(kept) - kept < np.float32(p.top_p)
        token = int(order[np.argmax(np.where(keep, values + noise[order], -np.inf))])
    model = _log_softmax(logits)
    best = np.lexsort((np.arange(vocab), -model))[:p.top_logprobs]
    return token, float(model[token]), [(int(i), float(model[i])) for i in best]


ROWS = 16
# A row that carries every token list (history, bias, alternatives): padding a batch with it
# gives every call the same program, compiled once.
BUSY = SamplingParams(frequency_penalty=0.1, logit_bias={0: 1.0}, logprobs=True,
                      top_logprobs=1)


def run_rows(logits, params, seeds, produced, logs, positions, busy: bool = True):
    """The device sampler on the arrays the engine builds for these rows (in a batch of
    ROWS, the rest BUSY unless not `busy`); per row (token, logprob, alternatives)."""
    n = len(params)
    pad = ROWS - n if busy else 0
    arrays = sampling_arrays(list(params) + [BUSY] * pad, list(seeds) + [0] * pad,
                             list(produced) + [0] * pad, list(logs) + [[1]] * pad)
    rows = arrays.temperature.shape[0]
    padded = np.zeros((rows, logits.shape[1]), np.float32)
    padded[:n] = logits
    pos = np.zeros(rows, np.int32)
    pos[:n] = positions
    tokens, logprobs = sample(jnp.asarray(padded), arrays, jnp.asarray(pos))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    out = []
    for i, p in enumerate(params):
        if tokens.ndim == 1:
            out.append((int(tokens[i]), float(logprobs[i]), []))
        else:
            k = p.top_logprobs
            out.append((int(tokens[i, 0]), float(logprobs[i, 0]),
                        list(zip(tokens[i, 1:1 + k].tolist(), logprobs[i, 1:1 + k].tolist()))))
    return out


def check_rows(logits, params, seeds, produced, logs, positions):
    got = run_rows(logits, params, seeds, produced, logs, positions)
    for i, p in enumerate(params):
        want = reference(logits[i], p, seeds[i], positions[i], logs[i], produced[i])
        assert got[i][0] == want[0], (i, p, got[i], want[:2])
        np.testing.assert_allclose(got[i][1], want[1], atol=1e-5, err_msg=str(p))
        assert [t for t, _ in got[i][2]] == [t for t, _ in want[2]], (i, p)
        np.testing.assert_allclose([lp for _, lp in got[i][2]], [lp for _, lp in want[2]],
                                   atol=1e-5)
    return got


def _logits(rows: int, seed: int) -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(seed), (rows, VOCAB)) * 3, np.float32)


# -- the device sampler against it ----------------------------------------------------------
def test_every_field_matches_the_numpy_sampler():
    """One batch, each row with its own fields (greedy and drawn, alone and together)."""
    logits = _logits(10, 0)
    rng = np.random.default_rng(1)
    logs = [rng.integers(0, VOCAB, 60).tolist() for _ in range(10)]
    top = [int(np.argmax(row)) for row in logits]
    logs[2][-5] = top[2]                             # the argmax is in the log (repeated)
    logs[3][-3:] = [top[3]] * 3                      # ... and in the output, three times
    params = [
        SamplingParams(),
        SamplingParams(logit_bias={int(np.argmin(logits[1])): 50.0, top[1]: -20}),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(frequency_penalty=1.5, presence_penalty=0.7),
        SamplingParams(temperature=0.8, min_p=0.1),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(min_tokens=3, stop=(top[6], 5)),
        SamplingParams(temperature=1.0, seed=3, repetition_penalty=0.7, frequency_penalty=-0.5,
                       presence_penalty=1.0, logit_bias={7: 3}, min_p=0.05, top_k=50,
                       top_p=0.95, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0.5, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS),
        SamplingParams(temperature=2.0, top_p=0.5),
    ]
    produced = [0, 0, 10, 10, 0, 0, 1, 20, 0, 0]
    seeds = list(range(100, 110))
    positions = list(range(60, 70))
    got = check_rows(logits, params, seeds, produced, logs, positions)
    # The fields do something: each greedy row with one leaves the plain argmax.
    for i in (1, 2, 3, 6):
        assert got[i][0] != top[i], i
    assert len(got[8][2]) == MAX_TOP_LOGPROBS


def test_draws_match_the_numpy_sampler_at_many_positions():
    """Sampled rows, 15 draws each of three settings: token for token."""
    logits = np.repeat(_logits(1, 2), 15, axis=0)
    logs = [[1, 2, 3, 4] * 10] * 15
    for p in (SamplingParams(temperature=1.0, min_p=0.05),
              SamplingParams(temperature=0.7, top_k=10, presence_penalty=2.0, seed=1),
              SamplingParams(temperature=1.5, top_p=0.8, repetition_penalty=1.3,
                             logit_bias={9: -100, 10: 5})):
        check_rows(logits, [p] * 15, [5] * 15, [8] * 15, logs, list(range(15)))


def test_penalties_are_vllms():
    """By hand: repetition divides positive and multiplies negative logits of ids in the
    history (prompt or output); frequency and presence count the output only."""
    logits = jnp.asarray([[2.0, -1.0, 0.5, 3.0, 1.0]])
    arrays = dataclasses.replace(
        SamplingArrays.greedy(1, window=6), repetition=np.array([2.0], np.float32),
        frequency=np.array([0.5], np.float32), presence=np.array([0.25], np.float32),
        history=np.array([[-1, 0, 1, 4, 4, 1]], np.int32),    # prompt 0, 1; output 4, 4, 1
        history_output=np.array([3], np.int32))
    np.testing.assert_allclose(np.asarray(adjust_logits(logits, arrays))[0],
                               [1.0, -2.0 - 0.5 - 0.25, 0.5, 3.0, 0.5 - 1.0 - 0.25])


def test_penalties_see_the_last_window_of_the_log():
    logits = _logits(2, 3)
    top = int(np.argmax(logits[0]))
    log = [top] + [int(np.argmin(logits[0]))] * (PENALTY_WINDOW + 5)
    params = [SamplingParams(repetition_penalty=100.0)] * 2
    # Out of the window the argmax is not penalised; in it, it is.
    got = check_rows(logits[:1].repeat(2, 0), params, [0, 0], [0, 0],
                     [log, log[:PENALTY_WINDOW]], [0, 0])
    assert sampling_arrays(params, [0, 0], [0, 0], [log, log]).history.shape == \
        (2, PENALTY_WINDOW)
    assert got[0][0] == top and got[1][0] != top


def test_neutral_values_change_nothing_beside_rows_that_use_them():
    """Neutral penalties, an empty logit_bias and min_p 0 are the plain sampler, bit for bit,
    even in a step whose other rows carry penalties, biases and alternatives."""
    logits = _logits(4, 4)
    logs = [list(range(40))] * 4
    plain = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.7, seed=2)]
    neutral = [dataclasses.replace(p, presence_penalty=0.0, frequency_penalty=0.0,
                                   repetition_penalty=1.0, logit_bias={}, min_p=0.0,
                                   min_tokens=0) for p in plain]
    assert sampling_arrays(neutral, [1, 2]).history.shape[1] == 0
    busy = SamplingParams(temperature=1.0, frequency_penalty=1.0, logit_bias={3: 2.0},
                          min_tokens=2, stop=(4,), logprobs=True, top_logprobs=4)
    alone = run_rows(logits[:2], plain, [1, 2], [5, 5], logs[:2], [40, 41], busy=False)
    beside = run_rows(logits, neutral + [busy, busy], [1, 2, 3, 4], [5, 5, 0, 0], logs,
                      [40, 41, 42, 43])
    assert [r[0] for r in beside[:2]] == [r[0] for r in alone]
    np.testing.assert_allclose([r[1] for r in beside[:2]], [r[1] for r in alone], rtol=1e-6)


def test_min_tokens_bans_the_stop_ids_until_reached():
    logits = _logits(1, 5)
    stop = int(np.argmax(logits[0]))
    p = SamplingParams(min_tokens=2, stop=(stop,))
    for made, banned in ((0, True), (1, True), (2, False)):
        (token, _, _), = run_rows(logits, [p], [0], [made], [[1]], [1])
        assert (token != stop) == banned


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", "1"),
    ("min_p", 1.5), ("min_p", -0.1), ("top_logprobs", MAX_TOP_LOGPROBS + 1),
    ("top_logprobs", 2), ("min_tokens", 17), ("min_tokens", -1), ("logit_bias", {"a": 1}),
    ("logit_bias", {1: float("inf")}), ("logit_bias", [1, 2]),
    ("logit_bias", {i: 1.0 for i in range(300)})])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(BadRequest, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_logit_bias_takes_json_keys_and_is_clamped_as_vllms():
    p = SamplingParams(logit_bias={"5": 200, 3: -1e9, "-0": 0.5})
    assert p.logit_bias == ((0, 0.5), (3, -100.0), (5, 100.0))
    with pytest.raises(BadRequest, match="outside the vocabulary"):
        SamplingParams(logit_bias={300: 1}).check_vocab(VOCAB)


# -- the HTTP fields, parsed ------------------------------------------------------------------
SERVED = dict(model="tiny", tokenizer=None, vocab_size=VOCAB)


def test_http_bodies_map_to_the_engines_fields():
    req = fmt.parse_completion({"prompt": [1, 2], "logit_bias": {"5": 1}, "logprobs": 3,
                                "n": 2, "stop": [7], "stop_token_ids": [8], "min_tokens": 2,
                                "presence_penalty": 0.5, "top_k": -1, "seed": 4}, **SERVED,
                               eos=(9,))
    s = req.sampling
    assert (req.n, req.logprobs, s.top_logprobs, s.stop, s.min_tokens, s.top_k) == \
        (2, True, 3, (8, 7, 9), 2, 0)
    assert fmt.parse_completion({"prompt": [1], "ignore_eos": True}, **SERVED,
                                eos=(9,)).sampling.stop == ()
    # Neutral values are accepted, and so are unknown fields, unless strict.
    neutral = {"prompt": [1], "presence_penalty": 0, "frequency_penalty": 0,
               "repetition_penalty": 1, "logit_bias": {}, "min_p": 0, "min_tokens": 0,
               "echo": False, "best_of": 1, "suffix": None, "n": 1, "ignore_eos": False}
    assert fmt.parse_completion({**neutral, "chat_template_kwargs": {}}, **SERVED).sampling == \
        fmt.parse_completion({"prompt": [1]}, **SERVED).sampling
    with pytest.raises(BadRequest, match="chat_template_kwargs") as e:
        fmt.parse_completion({**neutral, "chat_template_kwargs": {}}, **SERVED, strict=True)
    assert e.value.param == "chat_template_kwargs"


# -- through a server -----------------------------------------------------------------------
EOS = 0xF6           # the byte tokenizer's <|eos|> (cp_runtime.model.byte_tokenizer)
# Each decode program costs the server 10-20 s to compile here, so the tests below share
# three: one row with every token list carried (history, bias and alternatives: the fields
# LOADED and a logit_bias), and four rows (n=3) with none.
LOADED = {"frequency_penalty": 0.5, "logprobs": 3}


@pytest.fixture(scope="module")
def servers():
    """The test model's server with its HTTP door, and one with --strict-fields (started
    beside it: it compiles nothing, every request it gets being refused)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        strict = pool.submit(start_server, "--http-port", "0", "--strict-fields")
        try:
            server = start_server("--http-port", "0")
        except BaseException:
            if strict.exception() is None:
                strict.result().stop()
            raise
        if strict.exception() is not None:
            server.stop()
        other = strict.result()
    try:
        yield server, other
    finally:
        stop_server(other)
        stop_server(server)


@pytest.fixture(scope="module")
def served(servers):
    server = servers[0]
    return server, openai.OpenAI(base_url=f"http://{server.http_address}/v1", api_key="none",
                                 max_retries=0)


def _stats(server) -> dict:
    with cp_runtime.Client(server.address) as c:
        return c.stats()


def test_n_choices_fork_one_prefilled_prompt(served):
    server, sdk = served
    prompt = np.random.default_rng(7).integers(0, 240, 50).tolist()
    before = _stats(server)
    ask = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=11,
               extra_body={"return_token_ids": True, "ignore_eos": True})
    done = sdk.completions.create(n=3, **ask)
    after = _stats(server)
    total = {k: before.get(f"{k}_total", 0) for k in ("prefill_tokens", "decode_tokens")}
    ids = [c.token_ids for c in done.choices]
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert len({tuple(t) for t in ids}) == 3 and all(len(t) == 6 for t in ids)
    # The prompt was prefilled once, the forks shared it; 18 tokens generated.
    assert after["prefill_tokens_total"] - total["prefill_tokens"] == len(prompt)
    assert after["decode_tokens_total"] - total["decode_tokens"] == 18
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (50, 18)
    # The forks are closed; the prompt's session is kept as a prefix-cache entry.
    assert after["sessions"] == before["sessions"]
    assert after["prefix_cache"]["entries"] == before["prefix_cache"]["entries"] + 1
    # Choice i draws with seed + i, so the same request draws the same; streamed too.
    chunks = list(sdk.completions.create(n=3, stream=True, **ask))
    streamed = {i: [t for c in chunks for ch in c.choices if ch.index == i for t in ch.token_ids]
                for i in range(3)}
    assert [streamed[i] for i in range(3)] == ids
    assert sorted(ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason) == \
        ["length"] * 3


def test_top_logprobs_eos_min_tokens_and_ignore_eos(served):
    server, sdk = served
    prompt = [5, 6, 7, 8, 9, 10]
    base = dict(model="tiny", prompt=prompt, max_tokens=5, temperature=0, **LOADED)
    force = {"logit_bias": {str(EOS): 100}, "return_token_ids": True,
             "return_tokens_as_token_ids": True}        # byte tokens' texts are not unique
    # The EOS, made the likeliest, ends the generation at once: a stop, its text left out.
    done = sdk.completions.create(**base, extra_body=force).choices[0]
    assert (done.token_ids, done.finish_reason, done.text) == ([EOS], "stop", "")
    # Not with ignore_eos; with min_tokens, only after them (banned until then).
    done = sdk.completions.create(**base, extra_body={**force, "ignore_eos": True}).choices[0]
    assert (done.token_ids, done.finish_reason) == ([EOS] * 5, "length")
    done = sdk.completions.create(**base, extra_body={**force, "min_tokens": 3}).choices[0]
    assert done.finish_reason == "stop" and len(done.token_ids) == 4
    assert EOS not in done.token_ids[:3] and done.token_ids[3] == EOS
    # Each token's top log-probabilities: the 3 likeliest (the sampled one added if not
    # among them), the model's own, so the biased EOS is not the likeliest.
    lp = done.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.tokens == [f"token_id:{t}" for t in done.token_ids]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) in (3, 4) and top[token] == pytest.approx(logprob)
        assert max(top.values()) >= logprob
    # Chat: logprobs true with top_logprobs N.
    chat = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3, frequency_penalty=0.5,
        extra_body={"logit_bias": {str(EOS): -100}})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[2].logprob for c in content)
    # The session protocol: the same fields on generate.
    with cp_runtime.Client(server.address) as c, c.create_session() as s:
        s.extend(prompt)
        out = s.generate(max_tokens=5, logit_bias={EOS: 100}, min_tokens=2, stop=[EOS],
                         frequency_penalty=0.5, logprobs=True, top_logprobs=3)
        assert out.finish_reason == "stop" and out.tokens[2] == EOS and len(out.tokens) == 3
        assert [len(t) for t in out.top_logprobs] == [3, 3, 3]
        assert out.top_logprobs[0][0][1] >= out.top_logprobs[0][2][1]


def test_stop_strings_end_the_text_before_them(served):
    server, sdk = served
    ask = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0,
               **LOADED, extra_body={"return_token_ids": True, "ignore_eos": True,
                                     "logit_bias": {str(EOS): -1}})
    whole = sdk.completions.create(**ask).choices[0]
    text = request(server.http_address, "POST", "/detokenize", {"tokens": whole.token_ids},
                   token=None)[2]["prompt"]
    assert whole.text == text and whole.finish_reason == "length"
    stop = next((ch for ch in text[1:] if ch.isascii() and ch.isprintable()), None)
    assert stop is not None, f"no ASCII character to stop at in {text!r}"
    cut = sdk.completions.create(**ask, stop=[stop]).choices[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        **ask, stop=[stop, "\x00never"], stream=True) if c.choices)
    assert streamed == cut.text


def test_neutral_values_and_unknown_fields_are_accepted_bad_values_refused(served):
    server, sdk = served
    # n=3 greedy: three equal choices (and the four-row program of the test above).
    body = {"model": "tiny", "prompt": [3, 1, 4, 1, 5], "max_tokens": 3, "temperature": 0,
            "return_token_ids": True, "n": 3}
    status, _, plain = request(server.http_address, "POST", "/v1/completions", body,
                               token=None)
    assert status == 200
    ids = [c["token_ids"] for c in plain["choices"]]
    assert ids == [ids[0]] * 3
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
               "logit_bias": {}, "min_p": 0, "min_tokens": 0, "top_k": -1, "best_of": 3,
               "echo": False, "suffix": None, "ignore_eos": False, "tools": [],
               "chat_template_kwargs": {"x": 1}, "some_future_field": [1, 2]}
    status, _, same = request(server.http_address, "POST", "/v1/completions",
                              {**body, **neutral}, token=None)
    assert status == 200
    assert [c["token_ids"] for c in same["choices"]] == ids
    before = _stats(server)
    for bad, param in [({"presence_penalty": 3}, "presence_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"logit_bias": {"9999": 1}}, "logit_bias"),
                       ({"logit_bias": {"1": "x"}}, "logit_bias"),
                       ({"min_tokens": 9}, "min_tokens"), ({"logprobs": 21}, "logprobs"),
                       ({"n": 0}, "n"), ({"session": True}, "n"),
                       ({"best_of": 5}, "best_of"), ({"echo": True}, "echo"),
                       ({"min_p": 2}, "min_p"), ({"ignore_eos": "yes"}, "ignore_eos"),
                       ({"stop_token_ids": ["x"]}, "stop_token_ids")]:
        status, _, answer = request(server.http_address, "POST", "/v1/completions",
                                    {**body, **bad}, token=None)
        assert (status, answer["error"]["code"], answer["error"]["param"]) == \
            (400, "bad_request", param), (bad, answer)
        assert param in answer["error"]["message"]
    after = _stats(server)
    for key in ("sessions", "requests", "pages_used_per_shard", "prefill_tokens_total",
                "prefix_cache"):
        assert after[key] == before[key], key


def test_strict_fields_refuse_unknown_fields(servers):
    server = servers[1]
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "presence_penalty": 0}
    status, _, answer = request(server.http_address, "POST", "/v1/completions",
                                {**body, "some_future_field": 1}, token=None)
    assert (status, answer["error"]["param"]) == (400, "some_future_field")
    assert "some_future_field" in answer["error"]["message"]
    status, _, answer = request(server.http_address, "POST", "/v1/responses",
                                {"input": [1, 2], "frobnicate": True}, token=None)
    assert (status, answer["error"]["param"]) == (400, "frobnicate")
    stats = _stats(server)
    assert stats["sessions"] == 0 and stats["requests"] == 0
    assert stats["pages_used_per_shard"] == [0] * len(stats["pages_used_per_shard"])
