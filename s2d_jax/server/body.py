"""A request's body, read and decoded within limits, so that no body can stall or crash the
server: at most `limit` bytes (413 as soon as the Content-Length or the bytes read so far
pass it: the rest is never read), JSON nested at most MAX_DEPTH deep, and every string
valid Unicode. Each bad body is an ApiError (400 or 413) in OpenAI's shape.

Reading is async (chunks as they arrive, on the event loop); decoding and checking (the
CPU work: milliseconds per MB) run on a worker thread (app.py), so a big body never holds
up /health or the other clients.
"""

from __future__ import annotations

import json

from s2d_jax.server.api_error import ApiError

# A slot holds at most the model's context (SmolLM2: 8k tokens, ~32 kB of text or ~60 kB as
# JSON token ids): 4 MiB leaves room for long chat histories and still refuses at once the
# bodies that would take the server seconds to parse and tokenize.
DEFAULT_MAX_BODY_BYTES = 4 << 20
# No field of OpenAI's APIs that this server reads nests past ~5 levels (messages[i].content
# [j].text); the deepest it accepts at all are tools' JSON schemas. 64 is generous, and far
# below the ~1000 where Python's recursion limit turns a parse or a repr into a crash.
MAX_DEPTH = 64


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over this server's limit of "
                    f"{limit / (1 << 20):g} MiB ({limit} bytes); send a smaller one (the "
                    f"server's --max-body-mb sets the limit)", code="request_too_large")


async def read(http, limit: int) -> bytes:
    """The body of starlette request `http`, refused (413) once past `limit` bytes: up front
    by its Content-Length, else as the chunks arrive. A client that leaves while sending
    raises starlette's ClientDisconnect."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode(raw: bytes) -> dict:
    """The JSON object of a request body: NaN / Infinity literals, nesting past MAX_DEPTH
    and strings that are not Unicode (a lone surrogate escape, "\\ud800") refused."""
    def no_constant(name):
        raise ApiError(400, f"{name} is not a number JSON allows; send a finite number",
                       code="invalid_json")
    try:
        body = json.loads(raw or b"", parse_constant=no_constant)
    except ApiError:
        raise
    except RecursionError:  # nested deeper than Python's recursion limit
        raise _too_deep(None) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    check_tree(body)
    return body


def _too_deep(field: str | None) -> ApiError:
    where = f" (in {field})" if field else ""
    return ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels{where}; no field of "
                    f"this API nests that deep: flatten it", param=field, code="invalid_json")


def check_tree(body: dict) -> None:
    """Walk the decoded body without recursion: depth and every string (keys too)."""
    stack = [(value, _key(key), _key(key), 2) for key, value in body.items()]
    for key in body:
        _check_text(key, _key(key))
    while stack:
        value, path, field, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise _too_deep(field)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, field)
                stack.append((item, f"{path}.{_key(key)}", field, depth + 1))
        else:
            stack.extend((item, f"{path}[{i}]", field, depth + 1)
                         for i, item in enumerate(value))


def _key(key: str) -> str:
    """A key as a param path shows it: at most 40 characters, lone surrogates escaped (a
    response body must be encodable)."""
    return key[:40].encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{path} holds a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x}"
                       f"), which is no character: send valid Unicode (the character itself, "
                       f"or its surrogate pair)", param=path, code="invalid_unicode") from None
