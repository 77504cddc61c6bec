"""Bad requests sent over real HTTP to a running server (s2d_jax/server/): each one is
answered 4xx in OpenAI's error shape naming the field (deep nesting, lone surrogates, a
body past the limit, values the server does not implement), every field OpenAI's APIs
define is accepted at its default value, /health answers within a second while a 50 MB
body is refused, a client that leaves costs one log line, and the server keeps serving
correct answers afterwards."""

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from test_serve_http import MODEL, PROMPTS, alone, client, start

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    srv = start("s2d")  # test_serve_http's server: its programs are compiled already
    yield srv
    srv.stop()


def chat(**fields):
    return CHAT_PATH, {"model": MODEL, "messages": HI, "max_tokens": 1, **fields}


def completion(**fields):
    return COMPLETIONS_PATH, {"model": MODEL, "prompt": "Hi", "max_tokens": 1, **fields}


def nested(depth: int) -> list:
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


def raw_completion(fields: bytes) -> bytes:
    return b'{"model": "target-s", "max_tokens": 1, ' + fields + b"}"


def post(http, path, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def openai_error(r, status, param=None) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (r.status_code == status and set(err) == {"message", "type", "param", "code"}
            and bool(err["message"]) and (param is None or err["param"] == param))


# what a client library sends when the caller leaves a field alone, or a value that changes
# nothing on this server: each answered 200
DEFAULTS = [
    *[chat(**{name: value}) for name, value in [
        ("logprobs", False), ("logprobs", None), ("top_logprobs", None), ("top_logprobs", 0),
        ("n", 1), ("n", None), ("presence_penalty", 0), ("presence_penalty", 0.0),
        ("frequency_penalty", 0), ("frequency_penalty", None), ("logit_bias", None),
        ("logit_bias", {}), ("response_format", {"type": "text"}), ("response_format", None),
        ("stream_options", None), ("stream_options", {"include_usage": False}),
        ("tools", None), ("tools", []), ("tool_choice", "none"), ("tool_choice", "auto"),
        ("tool_choice", None), ("functions", []), ("function_call", "none"),
        ("parallel_tool_calls", True), ("parallel_tool_calls", False), ("user", "alice"),
        ("seed", 7), ("seed", None), ("service_tier", "auto"), ("service_tier", "default"),
        ("service_tier", None), ("store", False), ("store", None),
        ("metadata", {"run": "ci"}), ("metadata", None), ("modalities", ["text"]),
        ("audio", None), ("prediction", None), ("reasoning_effort", None),
        ("reasoning_effort", "none"), ("verbosity", None), ("verbosity", "medium"),
        ("web_search_options", None), ("moderation", None), ("safety_identifier", "s1"),
        ("prompt_cache_key", "k1"), ("prompt_cache_retention", "in_memory"),
        ("max_completion_tokens", 1), ("stop", None), ("temperature", None),
        ("top_p", None), ("stream", False), ("stream", None), ("stop", [])]],
    chat(messages=[{"role": "user", "content": "Hi", "name": "ann"},
                   {"role": "assistant", "content": "Hello", "tool_calls": [],
                    "refusal": None, "function_call": None, "audio": None, "name": "bot"},
                   {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]),
    chat(messages=[{"role": "user", "content": "smile \ud83d\ude00"}]),  # a pair: valid
    *[completion(**{name: value}) for name, value in [
        ("echo", False), ("best_of", 1), ("best_of", None), ("suffix", None), ("suffix", ""),
        ("logprobs", None), ("logprobs", False), ("n", 1), ("presence_penalty", 0),
        ("frequency_penalty", 0), ("logit_bias", {}), ("user", "bob"), ("seed", 3),
        ("stream_options", None)]],
]


def test_every_field_at_its_default_value_is_accepted(server):
    problems = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body in DEFAULTS:
            r = post(http, path, body)
            if r.status_code != 200:
                problems.append((path, json.dumps(body)[:120], r.status_code, r.text[:200]))
    assert not problems, "\n".join(map(str, problems))
    # all of them at once, as the official client sends them
    answer = client(server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, logprobs=False, top_logprobs=0, n=1,
        presence_penalty=0, frequency_penalty=0, logit_bias={},
        response_format={"type": "text"}, tools=[], tool_choice="none", user="u",
        service_tier="auto", store=False, metadata={}, modalities=["text"], seed=1)
    assert answer.choices[0].message.role == "assistant"


OVER_LIMIT = raw_completion(b'"prompt": "' + b"a" * (5 << 20) + b'"')  # the default: 4 MiB
NAN_BODY = b'{"model": "target-s", "prompt": "x", "temperature": NaN}'
INF_BODY = b'{"model": "target-s", "prompt": "x", "top_p": Infinity}'
BAD = [  # (path, body (dict or raw bytes), status, the param named (None: not checked))
    ("/v1/completions", b"{bad json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", NAN_BODY, 400, None),
    ("/v1/completions", INF_BODY, 400, None),
    ("/v1/completions", b'{"model": "target-s", "prompt": "x", "temperature": 1e999}', 400,
     "temperature"),  # JSON's number, past float: inf
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "16"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400,
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 200}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 99999]}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": 7}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 5}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": ["hi"]}, 400, "messages[0]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "n": 3,
                              "messages": [{"role": "user", "content": "a"}]}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "tools": [{"type": "function"}],
                              "messages": [{"role": "user", "content": "a"}]}, 400, "tools"),
    ("/v1/nothing", {}, 404, None),
    (COMPLETIONS_PATH, raw_completion(b'"prompt": "x", "user": ' + b"[" * 100_000
                                      + b"]" * 100_000), 400, None),
    (*completion(metadata={"k": nested(200)}), 400, "metadata"),  # parses; too deep to take
    (*completion(user=nested(900)), 400, "user"),  # near Python's recursion limit
    (COMPLETIONS_PATH, raw_completion(b'"prompt": "a\\ud800"'), 400, "prompt"),
    (COMPLETIONS_PATH, raw_completion(b'"prompt": "\\udc00b"'), 400, "prompt"),
    (COMPLETIONS_PATH, raw_completion(b'"prompt": "x", "stop": ["\\ud800"]'), 400, "stop[0]"),
    (COMPLETIONS_PATH, raw_completion(b'"prompt": "x", "metadata": {"\\ud800": "v"}'), 400,
     "metadata"),
    (CHAT_PATH, b'{"model": "target-s", "messages": [{"role": "user", "content": "\\ud800"}]}',
     400, "messages[0].content"),
    (CHAT_PATH, b'{"model": "target-s", "messages": [{"role": "user", "content": [{"type": '
     b'"text", "text": "a\\udfff"}]}]}', 400, "messages[0].content[0].text"),
    (COMPLETIONS_PATH, raw_completion(b'"prompt": "\xff\xfe"'), 400, None),  # not UTF-8
    (COMPLETIONS_PATH, OVER_LIMIT, 413, None),
    (*completion(prompt=[5, 2 ** 70]), 400, None),
    (*completion(seed=2 ** 64), 400, "seed"),
    (*chat(logprobs=True), 400, "logprobs"),
    (*chat(logprobs=1), 400, "logprobs"),
    (*chat(top_logprobs=3), 400, "top_logprobs"),
    (*chat(n=True), 400, "n"),  # true is no count
    (*chat(n=2), 400, "n"),
    (*chat(response_format={"type": "json_object"}), 400, "response_format"),
    (*chat(presence_penalty=0.5), 400, "presence_penalty"),
    (*chat(frequency_penalty=-1), 400, "frequency_penalty"),
    (*chat(logit_bias={"5": 10}), 400, "logit_bias"),
    (*chat(tool_choice="required"), 400, "tool_choice"),
    (*chat(functions=[{"name": "f"}]), 400, "functions"),
    (*chat(service_tier="flex"), 400, "service_tier"),
    (*chat(store=True), 400, "store"),
    (*chat(modalities=["text", "audio"]), 400, "modalities"),
    (*chat(audio={"voice": "alloy", "format": "wav"}), 400, "audio"),
    (*chat(prediction={"type": "content", "content": "x"}), 400, "prediction"),
    (*chat(reasoning_effort="high"), 400, "reasoning_effort"),
    (*chat(verbosity="low"), 400, "verbosity"),
    (*chat(web_search_options={}), 400, "web_search_options"),
    (*chat(user=5), 400, "user"),
    (*chat(metadata="x"), 400, "metadata"),
    (*chat(parallel_tool_calls="yes"), 400, "parallel_tool_calls"),
    (*chat(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    (*chat(stream_options=[1]), 400, "stream_options"),
    (*chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), 400,
     "messages[0].role"),
    # read as a system message, which the demo tokenizer (no chat template) has no place for
    (*chat(messages=[{"role": "developer", "content": "Be brief."}, *HI]), 400, "messages"),
    (*chat(messages=[{"role": "user", "content": "Hi", "name": 5}]), 400, "messages[0].name"),
    (*chat(messages=[*HI, {"role": "assistant", "content": "a", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        *HI]), 400, "messages[1].tool_calls"),
    (*completion(echo=True), 400, "echo"),
    (*completion(best_of=2), 400, "best_of"),
    (*completion(suffix="x"), 400, "suffix"),
    (*completion(logprobs=0), 400, "logprobs"),  # 0: the chosen token's logprob
    (*completion(logprobs=2), 400, "logprobs"),
]


def test_bad_bodies_and_values_get_openai_errors_and_the_server_keeps_serving(server):
    problems = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for path, body, status, param in BAD:
            r = post(http, path, body)
            if not openai_error(r, status, param):
                shown = body[:80] if isinstance(body, bytes) else json.dumps(body)[:120]
                problems.append((path, shown, r.status_code, r.text[:200]))
        r = http.get(COMPLETIONS_PATH)
        assert r.status_code == 405 and "error" in r.json()
    assert not problems, "\n".join(map(str, problems))
    text, _ = alone(server, PROMPTS[1], 12)
    good = client(server).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                             temperature=0)
    assert good.choices[0].text == text
    assert httpx.get(server.url + "/health").json()["failed"] == 0


def test_health_answers_within_a_second_while_a_50_mb_body_is_refused(server):
    big = raw_completion(b'"prompt": "' + b"word " * 10_000_000 + b'"')
    answers = []

    def send():  # with a Content-Length, then chunked (no length: read until the limit)
        for content in (big, (big[i:i + (1 << 16)] for i in range(0, len(big), 1 << 16))):
            try:
                answers.append(httpx.post(server.url + COMPLETIONS_PATH, content=content,
                                          timeout=20))
            except httpx.HTTPError as e:
                answers.append(e)

    sender = threading.Thread(target=send, daemon=True)
    began = time.monotonic()
    sender.start()
    waits = []
    with httpx.Client(base_url=server.url, timeout=5) as http:
        while (sender.is_alive() or len(waits) < 5) and time.monotonic() - began < 20:
            t0 = time.monotonic()
            try:
                assert http.get("/health").json()["status"] == "ok"
                waits.append(time.monotonic() - t0)
            except httpx.TimeoutException:
                waits.append(float("inf"))
            time.sleep(0.02)
    sender.join(1)
    assert not sender.is_alive(), "the 50 MB requests were still running after 20 s"
    assert len(answers) == 2 and all(openai_error(a, 413) for a in answers), answers
    assert max(waits) < 1.0, sorted(waits)[-5:]


def _disconnect_lines(caplog, since: int) -> list:
    return [r for r in caplog.records[since:] if r.name.startswith("s2d_jax.server")
            and "disconnected" in r.getMessage()]


def _wait_for_lines(caplog, since: int, n: int, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while len(_disconnect_lines(caplog, since)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # anything else it logs about the same client
    return _disconnect_lines(caplog, since)


def _send_raw(server, head: bytes, body: bytes, wait: float = 0.5) -> None:
    """A request written on a socket that is closed before any answer is read."""
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(head + body)
        time.sleep(wait)


def test_a_client_that_disconnects_costs_one_log_line(server, caplog):
    caplog.set_level(logging.INFO)
    cases = []
    # 1. leaves while sending its body (1000 bytes announced, 9 sent)
    mark = len(caplog.records)
    _send_raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: 1000\r\n\r\n", b'{"model"')
    cases.append(("uploading", _wait_for_lines(caplog, mark, 1)))
    worker = server.worker
    worker.pause()  # 2. and 3. leave while their request waits for a slot
    try:
        mark = len(caplog.records)
        body = json.dumps({"model": MODEL, "prompt": "ROMEO:", "max_tokens": 5}).encode()
        _send_raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body), body)
        cases.append(("waiting", _wait_for_lines(caplog, mark, 1)))
        mark = len(caplog.records)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", CHAT_PATH, json={"model": MODEL, "messages": HI,
                                                      "stream": True}) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))  # role
        cases.append(("streaming", _wait_for_lines(caplog, mark, 1)))
    finally:
        worker.resume()
    for name, lines in cases:
        assert len(lines) == 1 and "\n" not in lines[0].getMessage(), (name, lines)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(j is None for j in server.engine.jobs)
