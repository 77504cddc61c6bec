"""The OpenAI-compatible server (s2d_jax/server/app.py) live on localhost, driven by the
official `openai` client and raw httpx: chat and completions, streamed and not, stop
strings, finish reasons, usage; 16 concurrent clients x 4 greedy requests equal to each
prompt decoded alone (AR and S2D); a client that disconnects frees its slot; a full wait
list answers 429. Bad requests: test_serve_bad_requests.py."""

import concurrent.futures
import json
import os
import time

import httpx
import openai
import pytest

import s2d_jax
from s2d_jax.server.launch import build_server
from test_serve_slots import compilations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "demo")
MODEL = "target-s"
PROMPTS = ["ROMEO:", "JULIET: O Romeo, Romeo! wherefore art thou Romeo?", "KING HENRY:",
           "First Citizen:\nBefore we proceed any further", "MENENIUS:", "Hark",
           "HAMLET: To be, or not", "GLOUCESTER:\nNow is the winter"]
BUDGETS = [12, 20, 9, 16]


# the slot engine of tests/test_serve_slots.py (3 slots, 64 tokens, 3-round chunks): the same
# programs, so the server's warm-up finds them compiled (CI time)
SETTINGS = dict(slots=3, max_len=64, chunk_rounds=3, max_queue=64, default_max_tokens=16)


def start(method):
    if method == "s2d":  # through the API's entry point
        return s2d_jax.serve(os.path.join(DEMO, MODEL), os.path.join(DEMO, "draft"),
                             method="s2d", port=0, block=False, **SETTINGS)
    return build_server(os.path.join(DEMO, MODEL), method=method, port=0, **SETTINGS).start()


@pytest.fixture(scope="module")
def s2d_server():
    srv = start("s2d")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ar_server():
    srv = start("ar")
    yield srv
    srv.stop()


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def alone(srv, prompt, max_tokens):
    """The prompt decoded alone by the engine's Decoder (greedy), as text."""
    eng = srv.engine
    ids = eng.tok.encode(prompt, bos=True)
    out = eng.decoder.generate([ids], max_new_tokens=max_tokens, eos_id=eng.eos_id)[0]
    return eng.tok.decode(out["token_ids"]), out["token_ids"]


def test_models_and_health(s2d_server):
    c = client(s2d_server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    health = httpx.get(s2d_server.url + "/health").json()
    assert health["status"] == "ok" and health["slots"] == 3 and health["method"] == "s2d"
    assert health["rows"] in (1, 2, 3) and isinstance(health["speculating"], bool)
    assert health["tokens_per_round"] > 0  # the warmed server's occupancy policy


def test_chat_and_completions_streamed_and_not(s2d_server):
    c = client(s2d_server)
    text, ids = alone(s2d_server, PROMPTS[1], 20)
    whole = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    assert whole.choices[0].text == text
    reason = "stop" if ids[-1] == s2d_server.engine.eos_id else "length"
    assert whole.choices[0].finish_reason == reason
    u = whole.usage
    assert u.completion_tokens == len(ids) and u.total_tokens == u.prompt_tokens + len(ids)
    spec = u.speculation
    assert spec["method"] == "s2d" and spec["target_calls"] >= 1
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["tokens_per_target_call"] == pytest.approx(len(ids) / spec["target_calls"])

    pieces = list(c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20,
                                       temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == text
    assert pieces[-1].choices[0].finish_reason == reason

    # the demo tokenizer has no chat template: a user message is the prompt as it is
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == text and chat.choices[0].finish_reason == reason
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)

    sampled = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                   temperature=0.9, top_p=0.9, seed=4)
    assert 1 <= sampled.usage.completion_tokens <= 10


def test_stop_strings_and_finish_reasons(s2d_server):
    c = client(s2d_server)
    prompt, text = max(((p, alone(s2d_server, p, 30)[0]) for p in PROMPTS[:4]),
                       key=lambda pt: len(pt[1]))
    stop = text[6:9]
    assert len(stop) == 3 and stop in text
    for stream in (False, True):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
        if stream:
            parts = list(c.completions.create(stream=True, **kw))
            got = "".join(p.choices[0].text for p in parts)
            reason = parts[-1].choices[0].finish_reason
        else:
            r = c.completions.create(**kw)
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (got, reason) == (text[:text.index(stop)], "stop"), stream
    short = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2


@pytest.mark.parametrize("which", ["ar_server", "s2d_server"])
def test_16_concurrent_clients_equal_alone(which, request):
    srv = request.getfixturevalue(which)
    # the warm-up past the first requests' programs runs in the background while idle:
    # once it is done (/health "warming": null), serving compiles nothing
    deadline = time.monotonic() + 600
    while httpx.get(srv.url + "/health").json()["warming"] is not None:
        assert time.monotonic() < deadline, "the background warm-up did not finish"
        time.sleep(0.2)
    before = httpx.get(srv.url + "/health").json()["finished"]
    jobs = [(i, k, PROMPTS[(i + k) % len(PROMPTS)], BUDGETS[k]) for i in range(16)
            for k in range(4)]

    def one_client(i):
        c = client(srv)
        return [(p, n, c.completions.create(model=MODEL, prompt=p, max_tokens=n,
                                            temperature=0).choices[0].text)
                for j, k, p, n in jobs if j == i]

    with compilations() as seen, concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = [a for batch in pool.map(one_client, range(16)) for a in batch]
    assert len(answers) == 64
    assert seen == [], f"compiled while serving: {seen}"
    expected = {(p, n): alone(srv, p, n)[0] for p, n in {(p, n) for p, n, _ in answers}}
    wrong = [(p, n) for p, n, text in answers if text != expected[(p, n)]]
    assert not wrong, wrong
    health = httpx.get(srv.url + "/health").json()
    assert health["finished"] - before == 64 and health["active"] == 0
    assert health["failed"] == 0


def test_a_client_that_disconnects_frees_its_slot(s2d_server, monkeypatch):
    eng = s2d_server.engine
    real_step = eng.step

    def slow_step():  # room to disconnect before the answer could end
        real_step()
        time.sleep(0.3)

    monkeypatch.setattr(eng, "step", slow_step)
    before = httpx.get(s2d_server.url + "/health").json()["cancelled"]
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 40, "temperature": 0,
            "stream": True}
    with httpx.Client(base_url=s2d_server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        health = httpx.get(s2d_server.url + "/health").json()
        if health["cancelled"] == before + 1 and health["active"] == 0:
            break
        time.sleep(0.1)
    assert health["cancelled"] == before + 1 and health["active"] == 0, health
    assert all(j is None for j in eng.jobs)


def test_a_full_wait_list_answers_429(s2d_server, monkeypatch):
    worker = s2d_server.worker
    monkeypatch.setattr(worker, "max_queue", 2)
    worker.pause()
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 5, "temperature": 0}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(httpx.post, s2d_server.url + "/v1/completions", json=body,
                                   timeout=60) for _ in range(2)]
            deadline = time.monotonic() + 20
            while worker.engine.pending() < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            full = httpx.post(s2d_server.url + "/v1/completions", json=body, timeout=60)
            assert full.status_code == 429 and full.headers["Retry-After"] == "1"
            assert full.json()["error"]["type"] == "rate_limit_error"
            worker.resume()
            assert [w.result().status_code for w in waiting] == [200, 200]
    finally:
        worker.resume()
