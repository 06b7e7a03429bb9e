"""The OpenAI HTTP API's request and response shapes, as pure functions (no I/O): a request
body checked into what the engine runs, and the engine's results shaped into OpenAI's objects.

    parse_completion(body, model, tokenizer, vocab_size) -> CompletionRequest
    parse_chat(body, model, tokenizer, vocab_size, template) -> CompletionRequest
    completion_object / completion_choice / chat_object / chat_chunk / chat_choice /
    chat_delta / logprobs_object / chat_logprobs / usage / error_body
    context_length_error: vLLM's 400 for a request past max_model_len
    need / is_int / check_fields / encode_prompt / sampled: the checks the /v1/responses
    shapes (openai_responses) share

Field names and meanings follow OpenAI's `/v1/completions` and vLLM's extensions
(`return_token_ids`, `stop_token_ids`, `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`); docs/http.md lists what is supported. Fields a body names that no endpoint
knows are ignored, as vLLM ignores them (each name logged once, at debug), unless the server
runs with `--strict-fields`, which refuses them (400 naming them). Fields of OpenAI's or vLLM's
that change the output in a way this server cannot (`echo`, `best_of` past `n`, `suffix`,
tools, response formats, beam search) are refused unless their value is neutral.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import secrets
import time

from cp_runtime.engine.requests import BadRequest, SamplingParams
from cp_runtime.model.sampler import MAX_TOP_LOGPROBS

__all__ = ["CompletionRequest", "ERROR_STATUS", "bad_field", "chat_choice", "chat_chunk",
           "chat_delta", "chat_logprobs", "chat_object", "check_fields", "completion_choice",
           "completion_object", "context_length_error", "encode_prompt", "error_body",
           "is_int", "logprobs_object", "need", "need_field", "new_id", "now", "parse_chat",
           "parse_completion", "sampled", "usage"]

log = logging.getLogger(__name__)

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
# The sampling fields every generating endpoint takes (/v1/responses: all but `n`).
SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "stop", "stop_token_ids", "stream", "stream_options", "return_token_ids",
                   "n", "user", "session", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos",
                   "return_tokens_as_token_ids"}
# Fields known but not supported: accepted with the value that changes nothing (`best_of`: n
# or less), refused with any other, never ignored.
UNSUPPORTED = {"echo": (False, None), "suffix": (None, ""), "tools": (None, []),
               "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "use_beam_search": (False, None),
               "prompt_logprobs": (None, 0), "include_stop_str_in_output": (False, None),
               "allowed_token_ids": (None,), "bad_words": (None, []),
               "response_format": (None, {"type": "text"}),
               **{f"guided_{kind}": (None,) for kind in ("json", "regex", "choice",
                                                          "grammar")}}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "logprobs", "best_of"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
MAX_N = 128                       # choices of one request (each a fork of its prompt's session)
_logged_unknown: set[str] = set()  # unknown field names logged so far (each once)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A checked /v1/completions body: one prompt's token ids and how to sample."""

    prompt_ids: list[int]
    sampling: SamplingParams       # `stop` holds stop_token_ids and the EOS (but ignore_eos)
    stop_strings: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: bool
    n: int = 1                     # choices, each generated in a fork of the prompt's session
    tokens_as_ids: bool = False    # vLLM's return_tokens_as_token_ids: "token_id:N" in logprobs
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


def bad_field(param: str, message: str) -> BadRequest:
    """A 400 whose error names the body's field at fault (`param`)."""
    error = BadRequest(message)
    error.param = param
    return error


def need_field(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise bad_field(param, message)


def check_fields(body, allowed: set[str], model: str, strict: bool = False,
                 unsupported: dict | None = None) -> dict:
    """The body, a JSON object for this server's model, without the fields `allowed` (or
    `unsupported`) does not name: those are refused with `strict` (400 naming them), else
    ignored (vLLM's way), each name logged once at debug. Known but unsupported fields
    (`unsupported`, default UNSUPPORTED: name -> its neutral values) are refused unless
    neutral."""
    need(isinstance(body, dict), f"the body must be a JSON object, got {type(body).__name__}")
    unsupported = UNSUPPORTED if unsupported is None else unsupported
    allowed = allowed | set(unsupported)
    unknown = sorted(set(body) - allowed)
    if unknown and strict:
        raise bad_field(unknown[0], f"unsupported field(s) {unknown} (this server runs with "
                                    f"--strict-fields); supported: {sorted(allowed)}")
    for name in unknown:
        if name not in _logged_unknown:
            _logged_unknown.add(name)
            log.debug("ignoring the unknown request field %r (as vLLM does; --strict-fields "
                      "refuses it)", name)
    body = {k: v for k, v in body.items() if k not in unknown}
    if body.get("model") not in (None, model):
        raise LookupError(f"the model {body['model']!r} does not exist; this server serves "
                          f"{model!r}")
    for name, neutral in unsupported.items():
        if name in body:
            need_field(any(body[name] == v and type(body[name]) is type(v) for v in neutral),
                       name, f"{name}={json.dumps(body[name])[:200]} is not supported (only "
                             f"{' or '.join(json.dumps(v) for v in neutral)})")
    return body


def _choices(body: dict) -> int:
    n = body.get("n", 1)
    n = 1 if n is None else n
    need_field(is_int(n) and 1 <= n <= MAX_N, "n", f"n={n!r} must be an integer in [1, {MAX_N}]")
    best_of = body.get("best_of")
    need_field(best_of is None or (is_int(best_of) and best_of == n), "best_of",
               f"best_of={best_of!r} is not supported (only null, or n={n})")
    need_field(n == 1 or body.get("session") is None, "n",
               "n > 1 runs its choices in forks of a stateless prompt: drop 'session'")
    return n


def parse_completion(body, *, model: str, tokenizer, vocab_size: int, strict: bool = False,
                     eos: tuple[int, ...] = ()) -> CompletionRequest:
    """Check a /v1/completions body; raises BadRequest (400) or LookupError (404: another
    model) naming the field. eos: the model's end-of-sequence ids (a stop unless
    `ignore_eos`)."""
    body = check_fields(body, COMPLETION_FIELDS, model, strict)
    n = _choices(body)
    ids = encode_prompt(body.get("prompt"), tokenizer, vocab_size)
    logprobs = body.get("logprobs")
    need_field(logprobs is None or (is_int(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS),
               "logprobs", f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] (the "
                           "sampled token's log-probability and that many alternatives)")
    return dataclasses.replace(sampled(body, ids, tokenizer, logprobs is not None,
                                       top_logprobs=logprobs or 0, eos=eos,
                                       vocab_size=vocab_size), n=n)


def parse_chat(body, *, model: str, tokenizer, vocab_size: int, template,
               strict: bool = False, eos: tuple[int, ...] = ()) -> CompletionRequest:
    """Check a /v1/chat/completions body and render its messages with the model's chat
    template (`template(messages) -> str`, None: the model has none)."""
    body = check_fields(body, CHAT_FIELDS, model, strict)
    n = _choices(body)
    need(tokenizer is not None and template is not None,
         "this model has no chat template (tokenizer_config.json's chat_template): use "
         "/v1/completions")
    messages = body.get("messages")
    need(isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages),
        "'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
    logprobs = body.get("logprobs")
    logprobs = False if logprobs is None else logprobs
    need_field(isinstance(logprobs, bool), "logprobs", "'logprobs' must be a boolean")
    top = body.get("top_logprobs")
    need_field(top is None or (is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS), "top_logprobs",
               f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    need_field(not top or logprobs, "top_logprobs",
               "'top_logprobs' needs 'logprobs' set to true")
    bound = "max_tokens"
    if "max_completion_tokens" in body:
        body, bound = {**body, "max_tokens": body["max_completion_tokens"]}, \
            "max_completion_tokens"
    ids = encode_prompt(template(messages), tokenizer, vocab_size)
    return dataclasses.replace(sampled(body, ids, tokenizer, logprobs, top_logprobs=top or 0,
                                       eos=eos, max_tokens_field=bound,
                                       vocab_size=vocab_size),
                               prompt_field="messages", max_tokens_field=bound, n=n)


# SamplingParams' names -> the body's (a BadRequest's `param`).
_BODY_NAMES = {"stop": "stop_token_ids"}


def sampled(body: dict, ids: list[int], tokenizer, logprobs: bool, *, top_logprobs: int = 0,
            eos: tuple[int, ...] = (), max_tokens_field: str = "max_tokens",
            vocab_size: int | None = None) -> CompletionRequest:
    """The sampling and streaming fields every endpoint shares. `stop` takes strings (they
    need a tokenizer) and token ids; the generation's stop ids are those, `stop_token_ids`,
    and the model's `eos` ids unless `ignore_eos`. With `vocab_size`, logit_bias ids outside
    the vocabulary are refused here (the engine would refuse them after the prefill)."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else \
        (stop or [])
    need_field(isinstance(stop, list) and all((isinstance(s, str) and s) or is_int(s)
                                              for s in stop), "stop",
               "'stop' must be a string or a list of non-empty strings (or token ids)")
    strings = [s for s in stop if isinstance(s, str)]
    need_field(not strings or tokenizer is not None, "stop",
               "'stop' strings need a tokenizer: this model has none; give token ids "
               "('stop_token_ids')")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    need_field(isinstance(stop_ids, list) and all(is_int(t) for t in stop_ids),
               "stop_token_ids", "'stop_token_ids' must be a list of token ids")
    options = body.get("stream_options") or {}
    need_field(isinstance(options, dict), "stream_options", "'stream_options' must be an object")
    for flag in ("stream", "return_token_ids", "ignore_eos", "return_tokens_as_token_ids"):
        need_field(isinstance(body.get(flag, False), bool), flag, f"'{flag}' must be a boolean")
    session = body.get("session")
    need_field(session is None or session is True or isinstance(session, str), "session",
               "'session' must be true (a new session that lives on) or a session id")
    stops = [*stop_ids, *(s for s in stop if not isinstance(s, str))]
    if not body.get("ignore_eos", False):
        stops += [t for t in eos if t not in stops]
    fields = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
              "seed": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
              "repetition_penalty": 1.0, "logit_bias": {}, "min_tokens": 0}
    # null is the default (as OpenAI's SDKs may send it), but for max_tokens: null there
    # means "no bound" to vLLM, which this server does not give.
    given = {k: fields[k] if body.get(k) is None and k not in ("seed", "max_tokens")
             else body.get(k, fields[k]) for k in fields}
    given["top_k"] = _top_k(given["top_k"])
    try:
        sampling = SamplingParams(**given, stop=tuple(stops), logprobs=logprobs,
                                  top_logprobs=top_logprobs)
        if vocab_size is not None:
            sampling.check_vocab(vocab_size)
    except BadRequest as e:
        name = e.param
        e.param = (max_tokens_field if name == "max_tokens" else
                   "logprobs" if name == "top_logprobs" and "top_logprobs" not in body else
                   _BODY_NAMES.get(name, name))
        raise
    return CompletionRequest(
        prompt_ids=ids, sampling=sampling, stop_strings=tuple(strings),
        stream=body.get("stream", False), include_usage=bool(options.get("include_usage")),
        return_token_ids=body.get("return_token_ids", False), logprobs=logprobs,
        session=session, tokens_as_ids=body.get("return_tokens_as_token_ids", False))


def _top_k(value):
    """OpenAI clients send top_k -1 (vLLM's spelling of 'no limit'); the engine's is 0."""
    return 0 if value == -1 and not isinstance(value, bool) else value


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def completion_choice(*, index: int, text: str, finish_reason: str | None,
                      token_ids: list[int] | None = None, logprobs: dict | None = None,
                      **_) -> dict:
    """One choice of a completion (or of a streamed chunk of one)."""
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(*, index: int, text: str, finish_reason: str | None,
                token_ids: list[int] | None = None, logprobs: dict | None = None, **_) -> dict:
    choice = {"index": index, "message": {"role": "assistant", "content": text},
              "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_delta(*, index: int, text: str, finish_reason: str | None,
               token_ids: list[int] | None = None, logprobs: dict | None = None,
               role: bool = False) -> dict:
    """One choice of a streamed chat chunk: its first carries the role."""
    delta = {"role": "assistant", "content": text} if role else {"content": text}
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def logprobs_object(tokens_text: list[str], logprobs: list[float], offset: int,
                    tops: list[list[tuple[str, float]]] | None = None) -> dict:
    """OpenAI's completion `logprobs`: each generated token, its log-probability, the most
    likely tokens at its place with theirs (`top_logprobs`, as vLLM gives them: the
    alternatives asked for, most likely first, and the sampled token), and the character
    offset where it starts in the text."""
    offsets, at = [], offset
    for piece in tokens_text:
        offsets.append(at)
        at += len(piece)
    tops = tops or [[] for _ in tokens_text]
    top_logprobs = []
    for text, lp, top in zip(tokens_text, logprobs, tops):
        entry = dict(top)
        entry.setdefault(text, lp)
        top_logprobs.append(entry)
    return {"tokens": tokens_text, "token_logprobs": logprobs, "top_logprobs": top_logprobs,
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


def completion_object(*, rid: str, model: str, created: int, choices: list[dict],
                      usage_: dict | None = None, prompt_ids: list[int] | None = None) -> dict:
    """A completion, or one streamed chunk of it (a usage-only chunk has no choices)."""
    return _envelope("text_completion", rid, model, created, choices, usage_, prompt_ids)


def _token_entry(text: str, lp: float) -> dict:
    return {"token": text, "logprob": lp, "bytes": list(text.encode())}


def chat_logprobs(tokens_text: list[str], logprobs: list[float],
                  tops: list[list[tuple[str, float]]] | None = None) -> dict:
    tops = tops or [[] for _ in tokens_text]
    return {"content": [{**_token_entry(t, lp), "top_logprobs": [_token_entry(*a) for a in top]}
                        for t, lp, top in zip(tokens_text, logprobs, tops)]}


def chat_object(*, rid: str, model: str, created: int, choices: list[dict],
                usage_: dict | None = None, prompt_ids: list[int] | None = None) -> dict:
    return _envelope("chat.completion", rid, model, created, choices, usage_, prompt_ids)


def chat_chunk(*, rid: str, model: str, created: int, choices: list[dict],
               usage_: dict | None = None, prompt_ids: list[int] | None = None) -> dict:
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
