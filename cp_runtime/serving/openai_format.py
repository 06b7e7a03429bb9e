"""The OpenAI HTTP API's request and response shapes, as pure functions (no I/O): a request
body checked into what the engine runs, and the engine's results shaped into OpenAI's objects.

    parse_completion(body, model, tokenizer, vocab_size) -> CompletionRequest
    parse_chat(body, model, tokenizer, vocab_size, template) -> CompletionRequest
    completion_object / completion_chunk / chat_object / chat_chunk / usage / error_body
    context_length_error: vLLM's 400 for a request past max_model_len
    need / is_int / check_fields / encode_prompt / sampled: the checks the /v1/responses
    shapes (openai_responses) share

Field names and meanings follow OpenAI's `/v1/completions` and vLLM's extensions
(`return_token_ids`, `stop_token_ids`, `top_k`); docs/http.md lists what is supported.
"""

from __future__ import annotations

import dataclasses
import numbers
import secrets
import time

from cp_runtime.engine.requests import BadRequest, SamplingParams

__all__ = ["CompletionRequest", "ERROR_STATUS", "chat_chunk", "chat_object", "check_fields",
           "completion_chunk", "completion_object", "context_length_error", "encode_prompt",
           "error_body", "is_int", "need", "new_id", "now", "parse_chat", "parse_completion",
           "sampled", "usage"]

# code -> (HTTP status, OpenAI error type); the retryable ones carry Retry-After.
ERROR_STATUS = {
    "bad_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),     # OpenAI's and vLLM's code
    "unauthorized": (401, "authentication_error"),
    "not_found": (404, "not_found_error"),
    "capacity": (429, "rate_limit_error"),
    "overloaded": (429, "rate_limit_error"),
    "unavailable": (503, "service_unavailable_error"),
    "storage": (503, "service_unavailable_error"),
    "internal": (500, "server_error"),
}
SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "stream", "stream_options", "return_token_ids", "n",
                   "user", "session"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "logprobs", "max_completion_tokens"}
MAX_LOGPROBS = 1                  # the sampled token's log-probability, no alternatives


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A checked /v1/completions body: one prompt's token ids and how to sample."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: bool
    # The extension field `session`: None, a stateless request (an ephemeral session, kept as a
    # prefix-cache entry); True, a new session that lives on; a session id, that session (its
    # log continues with the prompt).
    session: str | bool | None = None
    # With a session id: continue it from this length (a fork when it has moved on since).
    continue_at: int | None = None
    # The body's names for the prompt and the generation's bound (an error's `param`).
    prompt_field: str = "prompt"
    max_tokens_field: str = "max_tokens"


def need(ok: bool, message: str) -> None:
    if not ok:
        raise BadRequest(message)


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def encode_prompt(prompt, tokenizer, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        need(tokenizer is not None, "this model has no tokenizer: send 'prompt' as a list of "
                                    "token ids (and read 'token_ids' with return_token_ids)")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        ids = [int(t) for t in prompt]
    elif isinstance(prompt, list) and len(prompt) == 1:
        return encode_prompt(prompt[0], tokenizer, vocab_size)
    else:
        raise BadRequest("'prompt' must be a string or a non-empty list of token ids (one "
                         f"prompt per request), got {type(prompt).__name__}")
    need(len(ids) > 0, "'prompt' is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    need(bad is None, f"token {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_fields(body, allowed: set[str], model: str) -> None:
    need(isinstance(body, dict), f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    need(not unknown, f"unsupported field(s) {unknown}; supported: {sorted(allowed)}")
    if body.get("model") not in (None, model):
        raise LookupError(f"the model {body['model']!r} does not exist; this server serves "
                          f"{model!r}")
    need(body.get("n", 1) == 1, "only n=1 is supported")


def parse_completion(body, *, model: str, tokenizer, vocab_size: int) -> CompletionRequest:
    """Check a /v1/completions body; raises BadRequest (400) or LookupError (404: another
    model) naming the field."""
    check_fields(body, COMPLETION_FIELDS, model)
    need(body.get("echo", False) is False, "echo is not supported")
    ids = encode_prompt(body.get("prompt"), tokenizer, vocab_size)
    logprobs = body.get("logprobs")
    need(logprobs is None or (is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS),
         f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}] (the sampled token's "
         "log-probability; alternatives are not returned)")
    return sampled(body, ids, tokenizer, logprobs is not None)


def parse_chat(body, *, model: str, tokenizer, vocab_size: int, template) -> CompletionRequest:
    """Check a /v1/chat/completions body and render its messages with the model's chat
    template (`template(messages) -> str`, None: the model has none)."""
    check_fields(body, CHAT_FIELDS, model)
    need(tokenizer is not None and template is not None,
         "this model has no chat template (tokenizer_config.json's chat_template): use "
         "/v1/completions")
    messages = body.get("messages")
    need(isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages),
        "'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
    need(isinstance(body.get("logprobs", False), bool), "'logprobs' must be a boolean")
    bound = "max_tokens"
    if "max_completion_tokens" in body:
        body, bound = {**body, "max_tokens": body["max_completion_tokens"]}, \
            "max_completion_tokens"
    ids = encode_prompt(template(messages), tokenizer, vocab_size)
    return dataclasses.replace(sampled(body, ids, tokenizer, bool(body.get("logprobs", False))),
                               prompt_field="messages", max_tokens_field=bound)


def sampled(body: dict, ids: list[int], tokenizer, logprobs: bool) -> CompletionRequest:
    """The sampling and streaming fields both endpoints share."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    need(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
         "'stop' must be a string or a list of non-empty strings")
    need(not stop or tokenizer is not None, "'stop' strings need a tokenizer: this model has "
                                            "none; give 'stop_token_ids'")
    options = body.get("stream_options") or {}
    need(isinstance(options, dict), "'stream_options' must be an object")
    for flag in ("stream", "return_token_ids"):
        need(isinstance(body.get(flag, False), bool), f"'{flag}' must be a boolean")
    session = body.get("session")
    need(session is None or session is True or isinstance(session, str),
         "'session' must be true (a new session that lives on) or a session id")
    sampling = SamplingParams(
        max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 1.0),
        top_p=body.get("top_p", 1.0), top_k=_top_k(body.get("top_k", 0)),
        seed=body.get("seed"), stop=tuple(body.get("stop_token_ids") or ()),
        logprobs=logprobs)
    return CompletionRequest(
        prompt_ids=ids, sampling=sampling, stop_strings=tuple(stop),
        stream=body.get("stream", False), include_usage=bool(options.get("include_usage")),
        return_token_ids=body.get("return_token_ids", False), logprobs=logprobs,
        session=session)


def _top_k(value):
    """OpenAI clients send top_k -1 (vLLM's spelling of 'no limit'); the engine's is 0."""
    return 0 if value == -1 else value


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _choice(text: str, finish_reason: str | None, token_ids: list[int] | None,
            logprobs: dict | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def logprobs_object(tokens_text: list[str], logprobs: list[float], offset: int) -> dict:
    """OpenAI's completion `logprobs`: each generated token, its log-probability, and the
    character offset where it starts in the text."""
    offsets, at = [], offset
    for piece in tokens_text:
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens_text, "token_logprobs": logprobs,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens_text, logprobs)],
            "text_offset": offsets}


def _envelope(kind: str, rid: str, model: str, created: int, choices: list[dict],
              usage_: dict | None, prompt_ids: list[int] | None) -> dict:
    """What every answer object and chunk carries around its choices."""
    out = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    if prompt_ids is not None:
        out["prompt_token_ids"] = prompt_ids
    return out


def completion_object(*, rid: str, model: str, created: int, text: str, finish_reason: str,
                      usage_: dict, token_ids: list[int] | None = None,
                      prompt_ids: list[int] | None = None, logprobs: dict | None = None
                      ) -> dict:
    return _envelope("text_completion", rid, model, created,
                     [_choice(text, finish_reason, token_ids, logprobs)], usage_, prompt_ids)


def completion_chunk(*, rid: str, model: str, created: int, text: str | None = None,
                     finish_reason: str | None = None, token_ids: list[int] | None = None,
                     logprobs: dict | None = None, usage_: dict | None = None,
                     prompt_ids: list[int] | None = None) -> dict:
    """One server-sent event's object; a usage-only chunk (text None) has no choices."""
    choices = [] if text is None else [_choice(text, finish_reason, token_ids, logprobs)]
    return _envelope("text_completion", rid, model, created, choices, usage_, prompt_ids)


def chat_logprobs(tokens_text: list[str], logprobs: list[float]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": []} for t, lp in zip(tokens_text, logprobs)]}


def chat_object(*, rid: str, model: str, created: int, text: str, finish_reason: str,
                usage_: dict, token_ids: list[int] | None = None,
                prompt_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return _envelope("chat.completion", rid, model, created, [choice], usage_, prompt_ids)


def chat_chunk(*, rid: str, model: str, created: int, text: str | None = None,
               finish_reason: str | None = None, token_ids: list[int] | None = None,
               logprobs: dict | None = None, usage_: dict | None = None,
               prompt_ids: list[int] | None = None, role: bool = False) -> dict:
    """One streamed chat event: the first carries the role, then content deltas."""
    choices = []
    if text is not None:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        choices.append(choice)
    return _envelope("chat.completion.chunk", rid, model, created, choices, usage_, prompt_ids)


def error_body(code: str, message: str, param: str | None = None) -> tuple[int, dict]:
    """(HTTP status, OpenAI's error object) for an error code of the session protocol;
    `param`: the body's field at fault, if one is."""
    status, kind = ERROR_STATUS.get(code, ERROR_STATUS["internal"])
    return status, {"error": {"message": message, "type": kind, "code": code,
                              "param": param}}


def context_length_error(req: CompletionRequest, limit: int, held: int = 0
                         ) -> tuple[str, str] | None:
    """(message, param) of a request that can never fit: the `held` tokens of the session it
    continues, its prompt and its `max_tokens` pass `limit` (max_model_len); None if it fits.
    The message is vLLM's (clients parse its numbers); `param` names the prompt's field when
    the prompt alone is too long, else the generation's bound."""
    prompt, completion = len(req.prompt_ids), req.sampling.max_tokens
    total = held + prompt + completion
    if total <= limit:
        return None
    noun = req.prompt_field
    parts = f"{held} in the session, " if held else ""
    message = (f"This model's maximum context length is {limit} tokens. However, you "
               f"requested {total} tokens ({parts}{prompt} in the {noun}, {completion} in the "
               f"completion). Please reduce the length of the {noun} or completion.")
    return message, req.prompt_field if held + prompt > limit else req.max_tokens_field


def now() -> int:
    return int(time.time())
