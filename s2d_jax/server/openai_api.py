"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions:
a JSON body -> a checked Request (or an ApiError in OpenAI's error shape), a Result ->
the response body, and the streamed chunks.

Bodies are read as plain JSON and checked here, field by field, with the API's validators
(s2d_jax/validate.py), so every bad request is a 4xx with {"error": {"message", "type",
"param", "code"}} naming the field, as OpenAI answers, and never a 500. Fields OpenAI has
and this server does not implement are refused when set to anything but their default
(n > 1, logprobs, tools, ...); unknown fields are ignored, as OpenAI's server does.
"""

from __future__ import annotations

import json
import time
import uuid

from s2d_jax import validate
from s2d_jax.errors import S2DError
from s2d_jax.server.request import MAX_STOPS, Request, Result

# field: its default; any other value is refused (what this server does not implement)
UNSUPPORTED = {"n": 1, "best_of": 1, "logprobs": None, "top_logprobs": None, "echo": False,
               "suffix": None, "logit_bias": None, "tools": None, "functions": None,
               "tool_choice": None, "function_call": None, "response_format": None,
               "presence_penalty": 0, "frequency_penalty": 0}
ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def _field(body: dict, name: str, check, default=None):
    """body[name] checked by `check(value, name)`; absent or null -> default."""
    value = body.get(name)
    if value is None:
        return default
    try:
        return check(value, name)
    except S2DError as e:
        raise ApiError(400, str(e), param=name) from None


def read_body(raw: bytes) -> dict:
    """The JSON object of a request body (NaN / Infinity literals refused)."""
    def no_constant(name):
        raise ApiError(400, f"{name} is not a number JSON allows; send a finite number",
                       code="invalid_json")
    try:
        body = json.loads(raw or b"", parse_constant=no_constant)
    except ApiError:
        raise
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    return body


def _check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model must be a non-empty string naming a served model "
                       f"({served!r}; GET /v1/models lists it)", param="model")
    if model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{served!r}", param="model", code="model_not_found")
    return model


def _check_unsupported(body: dict) -> None:
    for name, default in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != default and not (name == "logit_bias" and value == {}):
            raise ApiError(400, f"{name}={json.dumps(value)[:40]} is not supported by this "
                           f"server; leave it out (or {default!r})", param=name)


def _stop(value, name):
    stops = [value] if isinstance(value, str) else value
    stops = validate.strings_list(stops, name)
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise S2DError(f"{name} must be up to {MAX_STOPS} non-empty strings")
    return tuple(stops)


def _number(lo, hi=None, lo_open=False):
    return lambda v, name: validate.number(v, name, lo, hi, lo_open=lo_open)


def request_settings(body: dict, default_max_tokens: int, room: int) -> dict:
    """The decoding settings of a body: max_tokens (OpenAI's newer max_completion_tokens
    too; default: default_max_tokens, at most the `room` left after the prompt),
    temperature (OpenAI's default 1), top_p, seed, stop."""
    _check_unsupported(body)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _field(body, name, lambda v, n: validate.integer(v, n, 1), None)
    if max_tokens is None:
        max_tokens = max(min(default_max_tokens, room), 1)
    settings = {"max_new_tokens": max_tokens,
                "temperature": _field(body, "temperature", _number(0.0, 2.0), 1.0),
                "top_p": _field(body, "top_p", _number(0.0, 1.0, lo_open=True), 1.0),
                "seed": _field(body, "seed", lambda v, n: validate.integer(v, n, 0), 0),
                "stop": _field(body, "stop", _stop, ())}
    if settings["max_new_tokens"] > room:
        raise ApiError(400, f"{name} {max_tokens} is past the context: the prompt leaves room "
                       f"for {room} new tokens; ask for at most {room}", param=name,
                       code="context_length_exceeded")
    return settings


def _message_text(m, i: int) -> dict:
    """A chat message with its content as text (OpenAI's list of text parts joined)."""
    if not isinstance(m, dict):
        raise ApiError(400, f"messages[{i}] must be an object with role and content",
                       param=f"messages[{i}]")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ApiError(400, f"messages[{i}].role {role!r:.40} is not one of {', '.join(ROLES)}",
                       param=f"messages[{i}].role")
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
                 for p in content]
        if any(not isinstance(p, str) for p in parts):
            raise ApiError(400, f"messages[{i}].content holds a part that is not text; this "
                           f"server reads text parts only", param=f"messages[{i}].content")
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string, got "
                       f"{type(content).__name__}", param=f"messages[{i}].content")
    return {"role": role, "content": content}


def chat_prompt(body: dict, tok, template: str) -> list[int]:
    """The prompt ids of a chat body's messages in the chat template."""
    from s2d_jax.data.prompts import messages_ids, split_messages
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects",
                       param="messages")
    messages = [_message_text(m, i) for i, m in enumerate(messages)]
    try:
        split_messages(messages)
        return messages_ids(tok, template, messages)
    except S2DError as e:
        raise ApiError(400, str(e), param="messages") from None


def completion_prompt(body: dict, tok) -> list[int]:
    """The prompt ids of a completions body: a string (encoded after BOS), token ids, or
    a list of one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tok.encode(prompt, bos=True)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be one non-empty string or list of token ids (one "
                   "prompt per request)", param="prompt")


def parse(body: dict, chat: bool, served: str, tok, template: str, max_len: int,
          default_max_tokens: int) -> tuple[Request, dict]:
    """A request body -> (Request, {"stream", "include_usage"})."""
    _check_model(body, served)
    stream = _field(body, "stream", validate.switch, False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    ids = chat_prompt(body, tok, template) if chat else completion_prompt(body, tok)
    if len(ids) >= max_len:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server holds {max_len} "
                       f"tokens per request (prompt + answer): shorten it",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    settings = request_settings(body, default_max_tokens, max_len - len(ids))
    try:
        request = Request(tuple(ids), **settings)
    except S2DError as e:
        raise ApiError(400, str(e)) from None
    return request, {"stream": stream, "include_usage": bool(options.get("include_usage"))}


def usage(result: Result, method: str) -> dict:
    """OpenAI's usage with the request's speculation figures (vLLM's names)."""
    s = result.stats
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": result.prompt_tokens + len(result.token_ids),
            "speculation": {"method": method, "target_calls": s.get("target_calls", 0),
                            "tokens_per_target_call": s.get("tokens_per_target_call"),
                            "num_draft_tokens": s.get("drafted", 0),
                            "num_accepted_tokens": s.get("accepted", 0),
                            "acceptance_rate": s.get("draft_acceptance")}}


class Reply:
    """The response objects of one request (ids and timestamps shared by its chunks)."""

    def __init__(self, chat: bool, model: str, method: str):
        self.chat, self.model, self.method = chat, model, method
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str, finish: str | None, delta: bool, first: bool = False):
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if delta:
            body = {"role": "assistant", "content": text} if first else \
                ({"content": text} if text else {})
            return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}

    def full(self, result: Result) -> dict:
        return {**self._head(self.object),
                "choices": [self._choice(result.text, result.finish_reason, False)],
                "usage": usage(result, self.method)}

    def chunk(self, text: str, finish: str | None = None, first: bool = False) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [self._choice(text, finish, True, first)]}

    def usage_chunk(self, result: Result) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(result, self.method)}


def sse(data) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"

