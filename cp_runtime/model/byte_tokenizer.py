"""The built-in models' tokenizer: byte-level, built in code with the `tokenizers` library's own
pieces (a BPE model with no merges, the ByteLevel pre-tokenizer and decoder), so text works on
`tiny`, `small`, `recall` and the other presets with nothing downloaded. The same for every
run: no file, no training, no randomness.

    ids 0..255      the bytes of UTF-8 text, id = byte value; text of any kind round-trips
    special ids     five of the 13 byte values that UTF-8 never uses (0xC0, 0xC1, 0xF5..0xFF),
                    so they fit the 256-id vocabularies of tiny and small:
                    0xF5 <|bos|>  0xF6 <|eos|>  0xF7 <|system|>  0xF8 <|user|>
                    0xF9 <|assistant|>
    ids 256..       recall only: its layout's tokens by name (<|hub|>, <|fact:K=V|>,
                    <|query:K|>, <|answer:V|>; cp_runtime.model.recall), so a text client can
                    plant a fact and ask for it. Other ids past the tokenizer's vocabulary (a
                    preset's random weights can sample them) decode as <|ID|>.

`CHAT_TEMPLATE` is a Hugging Face style (jinja2) chat template over the special tokens:

    <|bos|><|system|>\\nYou are terse.<|eos|>\\n<|user|>\\nHello<|eos|>\\n<|assistant|>\\n

`python -m cp_runtime.model.byte_tokenizer --model tiny DIR` writes tokenizer.json and
tokenizer_config.json (with the chat template) into DIR, for tools that load a tokenizer from
a directory (transformers' AutoTokenizer, load generators); cp-runtime reads that directory the
way it reads a checkpoint's (cp_runtime.weights.checkpoint.load_tokenizer) with the same ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
from collections.abc import Mapping
from typing import Any

from cp_runtime.config import ModelConfig, load_model_config
from cp_runtime.model.recall import RecallLayout

__all__ = ["BYTES", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "ByteTokenizer", "byte_tokenizer",
           "recall_token_names", "toy_tokenizer"]

log = logging.getLogger(__name__)

BYTES = 256
# Byte values that never occur in UTF-8 (0xF5..0xF7 would start a character past U+10FFFF,
# 0xF8..0xFF none at all), so text never needs them as bytes: the special tokens take their ids.
SPECIAL_TOKENS = {0xF5: "<|bos|>", 0xF6: "<|eos|>", 0xF7: "<|system|>", 0xF8: "<|user|>",
                  0xF9: "<|assistant|>"}
BOS, EOS = SPECIAL_TOKENS[0xF5], SPECIAL_TOKENS[0xF6]
ROLES = ("system", "developer", "user", "assistant")

# Each turn: the role's token, a newline, the content, <|eos|>, a newline; OpenAI's `developer`
# role is the system's. Written without literal newlines outside expressions, so trim_blocks
# and lstrip_blocks (as Hugging Face renders) change nothing.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in " + repr(ROLES).replace("'", '"') + " %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ ': this template knows system, "
    "developer, user and assistant') }}"
    "{% endif %}"
    "{% set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{{ '<|' ~ role ~ '|>\\n' ~ message['content'] ~ eos_token ~ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def _byte_chars() -> list[str]:
    """The ByteLevel pieces' character for each byte (GPT-2's mapping): printable Latin-1
    bytes stand for themselves, the other 68 (controls, space, NBSP, soft hyphen) for the
    characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for b in range(BYTES):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(BYTES + shifted))
            shifted += 1
    return chars


class ByteTokenizer:
    """The interface of a checkpoint's tokenizer (cp_runtime.weights.checkpoint.HFTokenizer:
    `encode`, `decode`, `vocab_size`, `bos_token_id`, the `tokenizers.Tokenizer` as
    `.tokenizer`) plus its chat template (`chat_template`, `bos_token`, `eos_token`)."""

    chat_template = CHAT_TEMPLATE
    bos_token, eos_token = BOS, EOS
    bos_token_id, eos_token_id = 0xF5, 0xF6

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added (those written in it are matched).
        A lone surrogate (JSON's "\\ud800" parses to one) is not a character UTF-8 can hold:
        it reads as U+FFFD."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        """The text of `ids`: bytes that are not whole UTF-8 read as U+FFFD; special tokens as
        their names; an id past the tokenizer's vocabulary as <|ID|>."""
        ids = [int(t) for t in ids]
        if all(0 <= t < self._size for t in ids):
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        out, run = [], []
        for t in ids:
            if 0 <= t < self._size:
                run.append(t)
                continue
            if run:
                out.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run = []
            out.append(f"<|{t}|>")
        if run:
            out.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(out)

    @property
    def vocab_size(self) -> int:
        return self._size

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """Write tokenizer.json and tokenizer_config.json (BOS, EOS, the chat template) into
        `directory`, made if need be, as a Hugging Face fast tokenizer."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(d / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                  "eos_token": EOS, "add_bos_token": True, "clean_up_tokenization_spaces":
                  False, "model_max_length": 1 << 30, "chat_template": CHAT_TEMPLATE}
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return d


def byte_tokenizer(names: Mapping[int, str] | None = None) -> ByteTokenizer:
    """The byte-level tokenizer, with `names` (id -> text, ids from 256 on, contiguous) as
    more special tokens. Needs the `tokenizers` package."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    names = dict(names or {})
    if sorted(names) != list(range(BYTES, BYTES + len(names))):
        raise ValueError("named tokens must take the ids from 256 on, without gaps")
    chars = _byte_chars()
    vocab = {SPECIAL_TOKENS.get(b, chars[b]): b for b in range(BYTES)}
    vocab.update({text: i for i, text in names.items()})
    if len(vocab) != BYTES + len(names):
        raise ValueError("two tokens share a name")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: a byte-level model with no merges needs no words, and one pass is faster
    # (1 MB of text in about 0.7 s here).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False)
                            for text in [*SPECIAL_TOKENS.values(), *names.values()]])
    return ByteTokenizer(tok)


def recall_token_names() -> dict[int, str]:
    """The recall model's tokens past the bytes (which are its filler), by name."""
    layout = RecallLayout()
    if layout.n_filler != BYTES or layout.hub != BYTES:
        raise ValueError("the recall layout's filler is no longer the 256 byte ids")
    names = {layout.hub: "<|hub|>"}
    for key in range(layout.n_keys):
        for value in range(layout.n_values):
            names[layout.fact(key, value)] = f"<|fact:{key}={value}|>"
    names.update({layout.query(key): f"<|query:{key}|>" for key in range(layout.n_keys)})
    names.update({layout.answer(v): f"<|answer:{v}|>" for v in range(layout.n_values)})
    return names


def toy_tokenizer(config: ModelConfig, *, recall: bool = False) -> ByteTokenizer | None:
    """The tokenizer of a built-in model (random or hand-set weights, no checkpoint): the byte
    tokenizer, with the recall model's named tokens when `recall`. None (token ids only) when
    the vocabulary is smaller than the bytes, or the `tokenizers` package (a dependency) cannot
    be imported."""
    if config.vocab_size < BYTES:
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        log.warning("%s: no tokenizer (the tokenizers package cannot be imported): the model "
                    "takes and gives token ids only", config.name)
        return None
    return byte_tokenizer(recall_token_names() if recall else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cp_runtime.model.byte_tokenizer",
        description="Write a built-in model's tokenizer as tokenizer.json and "
                    "tokenizer_config.json (with its chat template), for tools that load a "
                    "tokenizer from a directory.")
    p.add_argument("directory", help="where to write the two files (made if need be)")
    p.add_argument("--model", default="tiny", help="the built-in model (default: tiny)")
    args = p.parse_args(argv)
    tokenizer = toy_tokenizer(load_model_config(args.model), recall=args.model == "recall")
    if tokenizer is None:
        p.error(f"{args.model} has no byte tokenizer")
    print(tokenizer.save(args.directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
