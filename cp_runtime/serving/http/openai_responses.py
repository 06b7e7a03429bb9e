"""OpenAI's `/v1/responses` shapes, as pure functions: a request body checked into what the
engine runs, and the results shaped into a response object or its stream of events.

A stored response (`store`, the default) lives on as a session, and its id names the point it
ended: `resp_<session>_<length>`. `previous_response_id` continues from that point, in the
session itself when nothing has moved it on since, else in a fork at that length (so two
continuations of one response do not see each other). The id needs no table: it survives a
restart as long as the session does, and a session of the session protocol is reached by its
id through the extension field `session`.
"""

from __future__ import annotations

import dataclasses
import re

from cp_runtime.serving.http import openai_format as fmt

__all__ = ["ResponseRequest", "ResponseStream", "parse_id", "parse_response", "response_id",
           "response_object"]

RESPONSE_FIELDS = {"model", "input", "instructions", "previous_response_id",
                   "max_output_tokens", "stream", "store", "metadata", "user", "text",
                   "return_token_ids", "session", "truncation", "parallel_tool_calls",
                   # sampling, as in completions (vLLM's extensions too)
                   "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "min_tokens", "ignore_eos"}
# Known, not supported here: refused unless neutral (openai_format.check_fields).
RESPONSE_UNSUPPORTED = {"tools": (None, []), "tool_choice": (None, "none"),
                        "reasoning": (None,), "top_logprobs": (None, 0),
                        "include": (None, [])}
_ID = re.compile(r"resp_([0-9a-f]{32})_([0-9]{1,12})")


@dataclasses.dataclass(frozen=True)
class ResponseRequest:
    """A checked /v1/responses body: the completion to run, and where it continues from."""

    completion: fmt.CompletionRequest
    previous: str | None            # previous_response_id as given
    instructions: str | None


def response_id(session: str, length: int) -> str:
    return f"resp_{session}_{length}"


def parse_id(rid) -> tuple[str, int]:
    """(session, length) a response id names; LookupError (404) for one that names none."""
    m = _ID.fullmatch(rid) if isinstance(rid, str) else None
    if m is None:
        raise LookupError(f"no response {str(rid)[:80]!r}: not a stored response's id")
    return m.group(1), int(m.group(2))


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    fmt.need(isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
        and isinstance(p.get("text"), str) for p in content),
        "a message's 'content' must be a string or a list of input_text parts")
    return "".join(p["text"] for p in content)


def _messages(value, instructions: str | None) -> list[dict]:
    if isinstance(value, str):
        items = [{"role": "user", "content": value}]
    else:
        fmt.need(isinstance(value, list) and value and all(
            isinstance(m, dict) and m.get("type", "message") == "message"
            and m.get("role") in ("user", "system", "developer", "assistant") for m in value),
            "'input' must be a string, a list of messages, or a list of token ids")
        items = [{"role": m["role"], "content": _content_text(m.get("content"))}
                 for m in value]
    head = [{"role": "system", "content": instructions}] if instructions else []
    return head + [{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                   for m in items]


def _input_ids(body: dict, tokenizer, vocab_size: int, template, continuing: bool
               ) -> list[int]:
    """The input's token ids: ids as given (the extension for models without a tokenizer),
    else the messages through the chat template (only the new turn when continuing), else a
    string as it is."""
    value, instructions = body.get("input"), body.get("instructions")
    fmt.need(instructions is None or isinstance(instructions, str),
             "'instructions' must be a string")
    if isinstance(value, list) and value and all(fmt.is_int(t) for t in value):
        return fmt.encode_prompt(value, tokenizer, vocab_size)
    if template is None:
        fmt.need(isinstance(value, str) and not instructions,
                 "this model has no chat template: send 'input' as a string or token ids, "
                 "without 'instructions'")
        return fmt.encode_prompt(value, tokenizer, vocab_size)
    fmt.need(tokenizer is not None, "this model has no tokenizer: send token ids")
    messages = _messages(value, instructions)
    text = template.continuation(messages) if continuing else template(messages)
    return fmt.encode_prompt(text, tokenizer, vocab_size)


def parse_response(body, *, model: str, tokenizer, vocab_size: int, template,
                   strict: bool = False, eos: tuple[int, ...] = ()) -> ResponseRequest:
    """Check a /v1/responses body; raises BadRequest (400) or LookupError (404). eos: the
    model's end-of-sequence ids (a stop unless `ignore_eos`)."""
    body = fmt.check_fields(body, RESPONSE_FIELDS, model, strict, RESPONSE_UNSUPPORTED)
    text = body.get("text")
    fmt.need(text is None or (isinstance(text, dict) and text.get("format", {"type": "text"})
                              == {"type": "text"}), "only text output is supported")
    store = body.get("store", True)
    fmt.need(isinstance(store, bool), "'store' must be a boolean")
    previous, session = body.get("previous_response_id"), body.get("session")
    fmt.need(previous is None or session is None,
             "give 'previous_response_id' or 'session', not both")
    continue_at = None
    if previous is not None:
        session, continue_at = parse_id(previous)
    fmt.need(session is None or isinstance(session, str),
             "'session' must be the id of a session to continue")
    fmt.need(store or session is None, "a response that continues a session is stored: "
                                       "drop 'store': false")
    ids = _input_ids(body, tokenizer, vocab_size, template, session is not None)
    sampling = {k: v for k, v in body.items() if k in fmt.SAMPLING_FIELDS - {"session"}}
    if "max_output_tokens" in body:
        sampling["max_tokens"] = body["max_output_tokens"]
    completion = fmt.sampled(sampling, ids, tokenizer, False, eos=eos,
                             max_tokens_field="max_output_tokens", vocab_size=vocab_size)
    completion = dataclasses.replace(completion, session=session if session else store or None,
                                     continue_at=continue_at, prompt_field="input",
                                     max_tokens_field="max_output_tokens")
    return ResponseRequest(completion=completion, previous=previous,
                           instructions=body.get("instructions"))


def _usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]
                                     ["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u["total_tokens"]}


def _message(item_id: str, text: str, status: str, token_ids: list[int] | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    if token_ids is not None:
        part["token_ids"] = token_ids
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part]}


def response_object(*, rid: str, model: str, created: int, req: ResponseRequest,
                    status: str = "completed", text: str = "", finish_reason: str | None = None,
                    usage_: dict | None = None, item_id: str = "",
                    token_ids: list[int] | None = None, session: str | None = None) -> dict:
    """A response object; `status` "in_progress" (no output yet), "completed" or
    "incomplete" (max_output_tokens reached)."""
    c = req.completion
    if status != "in_progress" and finish_reason == "length":
        status = "incomplete"
    out = {"id": rid, "object": "response", "created_at": created, "status": status,
           "model": model, "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
           else None,
           "instructions": req.instructions, "metadata": {}, "previous_response_id": req.previous,
           "max_output_tokens": c.sampling.max_tokens, "temperature": c.sampling.temperature,
           "top_p": c.sampling.top_p, "parallel_tool_calls": False, "tool_choice": "none",
           "tools": [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
           "store": session is not None,
           "output": [] if status == "in_progress" else
           [_message(item_id, text, "completed", token_ids)],
           "usage": _usage(usage_) if usage_ is not None else None}
    if session is not None:
        out["session"] = session
    if c.return_token_ids:
        out["prompt_token_ids"] = c.prompt_ids
    return out


class ResponseStream:
    """The events of one streamed response (dicts with `type` and `sequence_number`), in
    order: `opening`, a `delta` per piece of text, `closing`."""

    def __init__(self, item_id: str):
        self.item_id, self.seq, self.text = item_id, 0, ""
        self.where = {"item_id": item_id, "output_index": 0, "content_index": 0}

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def opening(self, start: dict) -> list[dict]:
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.created", response=start),
                self._event("response.in_progress", response=start),
                self._event("response.output_item.added", output_index=0,
                            item=_message(self.item_id, "", "in_progress", None)),
                self._event("response.content_part.added", **self.where, part=part)]

    def delta(self, text: str, token_ids: list[int] | None) -> dict:
        self.text += text
        extra = {"token_ids": token_ids} if token_ids is not None else {}
        return self._event("response.output_text.delta", **self.where, delta=text,
                           logprobs=[], **extra)

    def closing(self, final: dict) -> list[dict]:
        item = final["output"][0]
        return [self._event("response.output_text.done", **self.where, text=self.text,
                            logprobs=[]),
                self._event("response.content_part.done", **self.where,
                            part=item["content"][0]),
                self._event("response.output_item.done", output_index=0, item=item),
                self._event("response.completed" if final["status"] == "completed" else
                            "response.incomplete", response=final)]
