"""A checkpoint's chat template: `chat_template` of tokenizer_config.json (a string, or a list of
named templates, "default" taken), or a chat_template.jinja file beside it, rendered with jinja2
in a sandbox the way Hugging Face's tokenizers render it (trim_blocks, lstrip_blocks,
`raise_exception`, `tojson`, the BOS and EOS token text, `add_generation_prompt`). A built-in
model's tokenizer carries its template (cp_runtime.model.byte_tokenizer.CHAT_TEMPLATE).
"""

from __future__ import annotations

import json
import pathlib

__all__ = ["ChatTemplate", "load_chat_template"]


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class ChatTemplate:
    """`template(messages) -> str`: the prompt text of a conversation, ending where the
    assistant's reply begins."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError, ext, sandbox     # the `http` extra

        def raise_exception(message):
            raise TemplateError(message)

        env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent,
                                                                  ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(source)
        self._error = TemplateError
        self.bos_token, self.eos_token = bos_token, eos_token

    def __call__(self, messages: list[dict]) -> str:
        return self._render(messages, add_generation_prompt=True)

    def continuation(self, messages: list[dict]) -> str:
        """The text of new turns that follow a conversation already in a session (ending
        with the assistant's reply as generated), up to where the next reply begins: the
        render of a stand-in history plus `messages`, less the stand-in's own render."""
        from cp_runtime.engine.requests import BadRequest
        history = [{"role": "user", "content": "\x00"}, {"role": "assistant", "content": "\x01"}]
        whole = self._render(history + messages, add_generation_prompt=True)
        base = self._render(history, add_generation_prompt=False)
        if not whole.startswith(base):
            raise BadRequest("this chat template does not render a conversation turn by turn: "
                             "send the whole conversation instead of continuing a response")
        return whole[len(base):]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        from cp_runtime.engine.requests import BadRequest
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except self._error as e:
            raise BadRequest(f"the chat template refused these messages: {e}") from None


def load_chat_template(checkpoint: str | pathlib.Path | None,
                       tokenizer=None) -> ChatTemplate | None:
    """The checkpoint's chat template, or without a checkpoint the one `tokenizer` carries
    (`chat_template`, `bos_token`, `eos_token`: a built-in model's byte tokenizer); None when
    there is none."""
    if checkpoint is None:
        source = getattr(tokenizer, "chat_template", None)
        if not isinstance(source, str):
            return None
        return ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)
    d = pathlib.Path(checkpoint)
    config_path = d / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None and (d / "chat_template.jinja").exists():
        source = (d / "chat_template.jinja").read_text()
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, _token_text(config.get("bos_token")),
                        _token_text(config.get("eos_token")))
