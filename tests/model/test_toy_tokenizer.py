"""The built-in models' byte tokenizer (cp_runtime.model.byte_tokenizer): any UTF-8 text
round-trips in ids of the model's vocabulary, the special tokens take byte values UTF-8 never
uses, the recall model's tokens have names, the chat template renders turn by turn, the files it
writes read back through the checkpoint loader; and text completions, chat and a text-sending
session client on a real `cp-runtime serve --model tiny --http-port` process."""

import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_runtime
from conftest import random_tokens
from cp_runtime.config import load_model_config, model_names
from cp_runtime.engine.requests import BadRequest
from cp_runtime.model.byte_tokenizer import (CHAT_TEMPLATE, SPECIAL_TOKENS, byte_tokenizer,
                                             main, toy_tokenizer)
from cp_runtime.model.recall import RecallLayout
from cp_runtime.model.source import WeightsSource
from cp_runtime.serving.http.chat_template import ChatTemplate, load_chat_template
from cp_runtime.weights.checkpoint import load_tokenizer
from serving_helpers import start_server, stop_server
from test_state import greedy_continuation

TINY = WeightsSource(model="tiny").tokenizer()
SAMPLES = ["", "hello world", "  two  spaces\tand a tab\r\n", "héllo wörld",
           "日本語のテキスト", "emoji 🎉👩‍👩‍👧 and a flag 🇫🇷", "NUL \x00 and DEL \x7f",
           "e\u0301 combining", "\ufeffBOM", "\U0010ffff last code point",
           "<|user|>\nhi<|eos|>", "<|nope|> <|"]


# -- the tokenizer ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", SAMPLES)
def test_samples_round_trip_in_the_vocabulary(text):
    ids = TINY.encode(text)
    assert TINY.decode(ids) == text
    assert all(0 <= t < 256 for t in ids)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_round_trips(text):
    ids = TINY.encode(text)
    assert TINY.decode(ids) == text and all(0 <= t < 256 for t in ids)
    if not any(name in text for name in SPECIAL_TOKENS.values()):
        assert ids == list(text.encode("utf-8"))             # one id a byte, id = its value


def test_special_tokens_take_bytes_utf8_never_uses():
    for i, name in SPECIAL_TOKENS.items():
        assert TINY.encode(name) == [i] and TINY.decode([i]) == name
        with pytest.raises(UnicodeDecodeError):
            bytes([i]).decode("utf-8")
    assert (TINY.bos_token_id, TINY.eos_token_id) == (TINY.encode("<|bos|>")[0],
                                                       TINY.encode("<|eos|>")[0])


def test_the_same_tokenizer_every_time():
    assert byte_tokenizer().tokenizer.to_str() == TINY.tokenizer.to_str()


def test_odd_ids_and_text_decode_without_error():
    assert TINY.decode([0xC3]) == "\ufffd"                    # half a character
    assert TINY.decode([104, 0xC3, 0xA9]) == "hé"
    assert TINY.decode([104, 300, 105]) == "h<|300|>i"        # past the tokenizer's ids
    assert TINY.encode("a\ud800b") == TINY.encode("a\ufffdb")  # a lone surrogate (from JSON)


def test_every_preset_gets_a_tokenizer_that_fits_it():
    for name in model_names():
        cfg = load_model_config(name)
        tokenizer = WeightsSource(model=name).tokenizer()
        assert tokenizer is not None and tokenizer.vocab_size <= cfg.vocab_size, name


def test_the_recall_models_tokens_have_names():
    layout, tok = RecallLayout(), WeightsSource(model="recall").tokenizer()
    assert tok.vocab_size == layout.vocab_size == load_model_config("recall").vocab_size
    ids = tok.encode("filler <|fact:17=5|> more<|hub|> <|query:17|>")
    assert layout.fact(17, 5) in ids and layout.hub in ids and ids[-1] == layout.query(17)
    assert all(t < layout.n_filler for t in tok.encode("any text at all: é 🎉"))
    assert tok.decode([layout.answer(5)]) == "<|answer:5|>"
    assert toy_tokenizer(load_model_config("recall")).vocab_size == 256   # not named: bytes


def test_the_chat_template_renders_turn_by_turn():
    template = load_chat_template(None, TINY)
    messages = [{"role": "developer", "content": "Be terse."},
                {"role": "user", "content": "Hi 🎉"}]
    text = template(messages)
    assert text == ("<|bos|><|system|>\nBe terse.<|eos|>\n<|user|>\nHi 🎉<|eos|>\n"
                    "<|assistant|>\n")
    assert TINY.decode(TINY.encode(text)) == text
    assert template.continuation([{"role": "user", "content": "more"}]) == \
        "<|user|>\nmore<|eos|>\n<|assistant|>\n"
    with pytest.raises(BadRequest, match="unknown role tool"):
        template([{"role": "tool", "content": "x"}])
    assert load_chat_template(None, None) is None


def test_the_written_files_read_back_as_a_checkpoints(tmp_path, capsys):
    assert main([str(tmp_path / "tiny-tokenizer")]) == 0
    d = tmp_path / "tiny-tokenizer"
    assert str(d) in capsys.readouterr().out
    loaded = load_tokenizer(d)
    assert loaded.bos_token_id == TINY.bos_token_id and loaded.vocab_size == 256
    for text in SAMPLES:
        assert loaded.encode(text) == TINY.encode(text)
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hello"}]
    assert load_chat_template(d)(messages) == ChatTemplate(CHAT_TEMPLATE, "<|bos|>",
                                                           "<|eos|>")(messages)


# -- text on a real server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    server = start_server("--http-port", "0")
    yield server
    stop_server(server)


def test_text_completions_and_chat_on_tiny(served, tiny, tiny_params):
    sdk = openai.OpenAI(base_url=f"http://{served.http_address}/v1", api_key="none",
                        max_retries=0)
    prompt = "The capital of France is"
    # ignore_eos: the random model may sample <|eos|>, which would end the text early.
    done = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = done.choices[0].token_ids
    assert done.prompt_token_ids == list(prompt.encode())
    assert ids == greedy_continuation(tiny_params, tiny, list(prompt.encode()), 6)
    assert done.choices[0].text == TINY.decode(ids) and done.usage.completion_tokens == 6
    streamed = list(sdk.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text

    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Où est la tour Eiffel ?"}]
    chat = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                       temperature=0, extra_body={"return_token_ids": True})
    rendered = load_chat_template(None, TINY)(messages)
    assert chat.prompt_token_ids == TINY.encode(rendered)
    assert chat.choices[0].message.content == TINY.decode(chat.choices[0].token_ids)
    chunks = list(sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat.choices[0].message.content
    # A stored response continued in text: only the new turn is rendered and sent.
    first = sdk.responses.create(model="tiny", input="Hello", max_output_tokens=3,
                                 temperature=0)
    more = sdk.responses.create(model="tiny", input="Again", max_output_tokens=3,
                                temperature=0, previous_response_id=first.id)
    assert more.usage.input_tokens == len(TINY.encode("<|user|>\nAgain<|eos|>\n"
                                                      "<|assistant|>\n"))


def test_tokenize_and_a_text_sending_session_client(served, tiny):
    import urllib.request

    def post(path, body):
        req = urllib.request.Request(f"http://{served.http_address}{path}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    text = "déjà vu 🎉 <|user|>"
    tokens = post("/tokenize", {"prompt": text})["tokens"]
    assert tokens == TINY.encode(text) and post("/detokenize", {"tokens": tokens}) == \
        {"prompt": text}
    with cp_runtime.Client(served.address) as client:
        assert client.server["text"] is True
        with client.create_session() as session:
            assert session.extend("Once upon a time")["length"] == 16
            out = session.generate(max_tokens=4, temperature=0)
            assert out.text == TINY.decode(out.tokens)
            session.extend(random_tokens(tiny, 5, 1))            # ids and text mix
            assert session.info()["length"] == 25
