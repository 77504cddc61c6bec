"""The slot engine (s2d_jax/server/slots.py) on the demo family: more requests than slots,
prompts of different lengths and budgets, every greedy answer equal to the prompt decoded
alone (Decoder.generate), stop strings and cancellation freeing slots, and no compilation
after warm-up."""

import contextlib
import logging
import os

import jax
import pytest

from s2d_jax.decode.chat import load_decoder
from s2d_jax.errors import S2DError
from s2d_jax.server.request import Request
from s2d_jax.server.slots import SlotEngine, width_buckets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "demo")
TEXTS = ["ROMEO:", "JULIET: O Romeo, Romeo! wherefore art thou Romeo? Deny thy father",
         "KING HENRY:", "First Citizen:\nBefore we proceed any further, hear me speak.",
         "MENENIUS:", "Hark"]
NEW = [20, 33, 8, 25, 30, 17]
MAX_LEN = 64


def make_engine(method, slots=3, **kw):
    draft = os.path.join(DEMO, "draft") if method in ("sd", "s2d", "ladder") else None
    dec, tok, _ = load_decoder(os.path.join(DEMO, "target-s"), draft, method=method,
                               exit=2 if method in ("self", "sd") else None, **kw)
    return SlotEngine(dec, tok, slots=slots, max_len=MAX_LEN, chunk_rounds=3), tok


@contextlib.contextmanager
def compilations():
    """The names of the programs XLA compiles inside the block (jax's compile log)."""
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Compiling "):
                seen.append(msg.split(" ")[1])

    handler, logger = Catch(level=logging.DEBUG), logging.getLogger("jax")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def check_alone(eng, tok, requests, results):
    """Every greedy result equals the request decoded alone by Decoder.generate."""
    for r, res in zip(requests, results):
        alone = eng.decoder.generate([list(r.prompt_ids)], max_new_tokens=r.max_new_tokens,
                                     eos_id=eng.eos_id)[0]["token_ids"]
        assert res.token_ids == alone, (tok.decode(r.prompt_ids), res.token_ids, alone)
        ended_by_eos = bool(alone) and alone[-1] == eng.eos_id
        assert res.finish_reason == ("stop" if ended_by_eos else "length")
        assert res.stats["new_tokens"] == len(alone)


@pytest.fixture(scope="module")
def s2d_engine():
    eng, tok = make_engine("s2d")
    warmed = eng.warm()
    assert warmed["prefill"] == len(width_buckets(MAX_LEN)) == 3  # 16, 32, 64
    return eng, tok


def test_width_buckets():
    assert width_buckets(64) == (16, 32, 64)
    assert width_buckets(100) == (16, 32, 64, 100)
    assert width_buckets(16) == (16,)
    assert width_buckets(1280) == (16, 32, 64, 128, 256, 512, 768, 1024, 1280)
    # the corpus generator's: each width at most 25% above the one before, in steps of 16
    fine = width_buckets(512, 0.25)
    assert fine == (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 240, 288, 352, 432, 512)
    assert all(b - a <= max(16, a // 4) for a, b in zip(fine[:-2], fine[1:-1]))
    with pytest.raises(S2DError, match="growth"):
        width_buckets(512, 0.0)


def test_s2d_slots_equal_alone_and_never_compile_after_warm_up(s2d_engine):
    eng, tok = s2d_engine
    reqs = [Request(tuple(tok.encode(t)), max_new_tokens=n) for t, n in zip(TEXTS, NEW)]
    assert len({len(r.prompt_ids) > 16 for r in reqs}) == 2  # two width buckets in use
    sampled = Request(tuple(tok.encode("ROMEO:")), max_new_tokens=12, temperature=0.8,
                      top_p=0.9, seed=3)
    with compilations() as seen:
        results = eng.run(reqs + [sampled])  # 7 requests through 3 slots, one sampled
    assert seen == [], f"compiled after warm-up: {seen}"
    assert all(j is None for j in eng.jobs) and eng.pending() == 0
    check_alone(eng, tok, reqs, results[:-1])
    assert results[-1].stats["new_tokens"] >= 1
    assert any(r.stats["accepted"] > 0 for r in results)  # speculation happened
    for r in results:
        s = r.stats
        assert s["target_calls"] >= 1 and s["accepted"] <= s["drafted"]


def test_stop_string_and_cancel_free_their_slots(s2d_engine):
    eng, tok = s2d_engine
    ids = tuple(tok.encode(TEXTS[1]))
    full = eng.run([Request(ids, max_new_tokens=30)])[0]
    stop = full.text[8:11]
    assert stop and stop in full.text
    events = []
    with compilations() as seen:
        stopped = eng.submit(Request(ids, max_new_tokens=30, stop=(stop,)), events.append)
        cancelled = eng.submit(Request(ids, max_new_tokens=30))
        cancelled.cancel()
        others = [eng.submit(Request(tuple(tok.encode(t)), max_new_tokens=10)) for t in TEXTS[:3]]
        while eng.busy():
            eng.step()
    assert seen == []
    res = stopped.result
    assert res.finish_reason == "stop" and res.text == full.text[:full.text.index(stop)]
    assert "".join(e["text"] for e in events if e["type"] == "text") == res.text
    assert events[-1] == {"type": "done", "result": res}
    assert res.token_ids == full.token_ids[:len(res.token_ids)]
    assert cancelled.result.finish_reason == "cancelled"
    assert all(o.result.finish_reason in ("stop", "length") for o in others)
    assert all(j is None for j in eng.jobs)


def test_a_prompt_asked_twice_in_a_row_is_prefilled_once(s2d_engine, monkeypatch):
    """The same prompt greedy, then sampled (a corpus prompt's two temperatures): one
    prefill, and the answers of prefilling each alone (another prompt between them). The
    sampled request asks for its first token only: later ones come from the batch's key."""
    from s2d_jax.server import programs as decode_engine  # the slot engine's programs
    eng, tok = s2d_engine
    monkeypatch.setattr(eng, "policy", None)  # every admission prefills the draft too
    ids, other = tuple(tok.encode(TEXTS[1])), tuple(tok.encode(TEXTS[0]))
    firsts = set()
    for seed in range(4):
        pair = [Request(ids, max_new_tokens=12),
                Request(ids, max_new_tokens=1, temperature=2.0, seed=seed)]
        apart = eng.run([pair[0], Request(other, max_new_tokens=4), pair[1]])
        calls = []
        real = decode_engine.prefill_caches
        monkeypatch.setattr(decode_engine, "prefill_caches",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
        together = eng.run(pair)
        monkeypatch.setattr(decode_engine, "prefill_caches", real)
        assert (seed, len(calls), eng.prefilled) == (seed, 1, None)  # kept for the next only
        assert [r.token_ids for r in together] == [apart[0].token_ids, apart[2].token_ids]
        firsts.add(together[1].token_ids[0])
    assert len(firsts) > 1  # each request drew its own first token from the shared prefill


def test_requests_the_slots_cannot_hold_are_refused(s2d_engine):
    eng, tok = s2d_engine
    with pytest.raises(S2DError, match="shorten the prompt"):
        eng.submit(Request(tuple([1] * MAX_LEN)))
    with pytest.raises(S2DError, match="ask for at most 54"):
        eng.submit(Request(tuple([1] * 10), max_new_tokens=55))
    with pytest.raises(S2DError, match="outside"):
        eng.submit(Request((1, 99999)))
    for bad, match in [(dict(prompt_ids=()), "empty"), (dict(prompt_ids=(1,), max_new_tokens=0),
                       "max_new_tokens"), (dict(prompt_ids=(1,), temperature=float("nan")),
                       "temperature"), (dict(prompt_ids=(1,), stop=("",)), "stop"),
                       (dict(prompt_ids=("a",)), "integer")]:
        with pytest.raises(S2DError, match=match):
            Request(**bad)


@pytest.mark.slow  # one engine (about a minute of compilation) per method
@pytest.mark.parametrize("method", ["ar", "sd", "self", "lookup", "ladder"])
def test_every_method_equals_alone_per_slot(method):
    eng, tok = make_engine(method)
    eng.warm()
    reqs = [Request(tuple(tok.encode(t)), max_new_tokens=n) for t, n in zip(TEXTS, NEW)]
    with compilations() as seen:
        results = eng.run(reqs)
    assert seen == []
    check_alone(eng, tok, reqs, results)
