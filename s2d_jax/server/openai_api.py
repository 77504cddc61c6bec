"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions:
a JSON body -> a checked Request (or an ApiError in OpenAI's error shape), a Result ->
the response body, and the streamed chunks.

Bodies arrive decoded and checked for size, depth and Unicode (body.py) and are checked
here, field by field, with the API's validators (s2d_jax/validate.py), so every bad request
is a 4xx with {"error": {"message", "type", "param", "code"}} naming the field, as OpenAI
answers, and never a 500. Fields OpenAI has and this server does not implement are refused
unless they hold their default (fields.py); unknown fields are ignored, as OpenAI's server
did.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

from s2d_jax import validate
from s2d_jax.errors import S2DError
from s2d_jax.server import fields
from s2d_jax.server.api_error import ApiError
from s2d_jax.server.request import MAX_STOPS, Request, Result

log = logging.getLogger(__name__)
# Requests are parsed on worker threads (app.py), and a transformers tokenizer is not
# thread-safe: each call sets its backend's encode_special_tokens (special-token text is
# split in a completion prompt, parsed in a rendered chat template), so two at once could
# encode one prompt with the other's setting. One encodes at a time.
_TOKENIZING = threading.Lock()
ROLES = ("system", "user", "assistant")
# OpenAI's newer name of the system message (what its reasoning models read instead)
ROLE_ALIASES = {"developer": "system"}


def _field(body: dict, name: str, check, default=None):
    """body[name] checked by `check(value, name)`; absent or null -> default."""
    value = body.get(name)
    if value is None:
        return default
    try:
        return check(value, name)
    except S2DError as e:
        raise ApiError(400, str(e), param=name) from None


def _check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model must be a non-empty string naming a served model "
                       f"({served!r}; GET /v1/models lists it)", param="model")
    if model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{served!r}", param="model", code="model_not_found")
    return model


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
    role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    if role not in ROLES:
        raise ApiError(400, f"messages[{i}].role {role!r:.40} is not one of "
                       f"{', '.join([*ROLES, *ROLE_ALIASES])} (this server has no tools)",
                       param=f"messages[{i}].role")
    fields.check(m, fields.ASSISTANT_MESSAGE if role == "assistant" else fields.MESSAGE,
                 f"messages[{i}].")
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
    except S2DError as e:
        raise ApiError(400, str(e), param="messages") from None
    return _tokenized(lambda: messages_ids(tok, template, messages), "messages")


def _tokenized(encode, param: str) -> list[int]:
    """encode() -> ids; whatever the template or the tokenizer raises on the client's text
    is a 400 naming its field (one log line, not a 500 with a traceback)."""
    try:
        with _TOKENIZING:
            return encode()
    except S2DError as e:
        raise ApiError(400, str(e), param=param) from None
    except Exception as e:  # the tokenizer's own types (TypeError, pyo3 panics, ...)
        log.warning("the tokenizer refused a request's %s: %s: %s", param, type(e).__name__,
                    str(e)[:200])
        raise ApiError(400, f"the tokenizer cannot encode this {param} ({type(e).__name__}: "
                       f"{str(e)[:120]}); send plain text", param=param) from None


def completion_prompt(body: dict, tok) -> list[int]:
    """The prompt ids of a completions body: a string (encoded after BOS), token ids, or
    a list of one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return _tokenized(lambda: tok.encode(prompt, bos=True), "prompt")
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be one non-empty string or list of token ids (one "
                   "prompt per request)", param="prompt")


def parse(body: dict, chat: bool, served: str, tok, template: str, max_len: int,
          default_max_tokens: int) -> tuple[Request, dict]:
    """A request body -> (Request, {"stream", "include_usage"})."""
    _check_model(body, served)
    fields.check(body, fields.CHAT if chat else fields.COMPLETIONS)
    stream = _field(body, "stream", validate.switch, False)
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object such as {\"include_usage\": "
                       "true}", param="stream_options")
    fields.check(options, fields.STREAM_OPTIONS, "stream_options.")
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

