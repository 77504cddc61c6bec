"""The fields of OpenAI's chat-completions and completions requests that this server does not
implement, and the values of each that it accepts: null, the API's default (what a client
library sends for a field its caller left alone: logprobs false, response_format {"type":
"text"}, n 1, ...) and values that change nothing here (tool_choice "auto" with no tools, a
user id, a cache key). Any other value is a 400 naming the field, so that no answer is made
without what the request asked for.

The fields it implements (model, messages, prompt, max_tokens, max_completion_tokens,
temperature, top_p, seed, stop, stream, stream_options) are checked in openai_api.py.
Fields of neither API are ignored, as OpenAI's own server did. The lists follow the
`openai` client's request types (openai 3.63: CompletionCreateParams of both APIs, and
the chat message types).
"""

from __future__ import annotations

import json

from s2d_jax.server.api_error import ApiError


def _metadata(value, name):
    if not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
        raise ApiError(400, f"{name} must be an object of strings, got "
                       f"{_shown(value)}", param=name)


# field -> what is accepted besides null: a tuple of JSON values, a type (any value of it),
# or a check(value, name)
BOTH = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
        "user": str}
CHAT = {
    **BOTH, "logprobs": (False,), "top_logprobs": (0,),
    "response_format": ({"type": "text"},), "modalities": (["text"],),
    # no tools: "auto" picks none of them, as "none" does
    "tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": bool,
    "functions": ([],), "function_call": ("none", "auto"),
    "audio": (), "prediction": (), "web_search_options": (), "moderation": (),
    "reasoning_effort": ("none",), "verbosity": ("medium",),  # no reasoning; the default
    "service_tier": ("auto", "default"), "store": (False,), "metadata": _metadata,
    "safety_identifier": str, "prompt_cache_key": str, "prompt_cache_retention": str,
    "prompt_cache_options": dict}
# logprobs 0 still asks for the chosen token's logprob
COMPLETIONS = {**BOTH, "logprobs": (False,), "best_of": (1,), "echo": (False,),
               "suffix": ("",)}
STREAM_OPTIONS = {"include_usage": bool, "include_obfuscation": bool}
# a message's fields besides role and content, by role
MESSAGE = {"name": str}
ASSISTANT_MESSAGE = {**MESSAGE, "tool_calls": ([],), "function_call": (), "audio": (),
                     "refusal": ()}


def same(a, b) -> bool:
    """JSON equality: true is not 1, 0 is not false, 0 is 0.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check(body: dict, fields: dict, prefix: str = "") -> None:
    """Refuse (400 naming it) each field of `fields` in `body` set to a value not accepted."""
    for name, accepted in fields.items():
        value, param = body.get(name), prefix + name
        if value is None:
            continue
        if isinstance(accepted, type):
            if not isinstance(value, accepted):
                kind = {str: "a string", bool: "true or false", dict: "an object"}[accepted]
                raise ApiError(400, f"{param} must be {kind}, got {_shown(value)}",
                               param=param)
        elif callable(accepted):
            accepted(value, param)
        elif not any(same(value, a) for a in accepted):
            allowed = " or ".join(["null", *map(json.dumps, accepted)])
            raise ApiError(400, f"{param}={_shown(value)} is not supported by this server; "
                           f"leave it out (or send {allowed})", param=param,
                           code="unsupported_value")
