"""`s2d_jax.generate` with a list of prompts, stop strings and a streaming iterator (on the
slot engine, s2d_jax/server/batch.py), against the one-prompt path on the demo family."""

import os

import pytest

import s2d_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "demo")
KW = dict(target=os.path.join(DEMO, "target-s"), draft=os.path.join(DEMO, "draft"),
          method="s2d", chat_template="none", max_new_tokens=24)
PROMPTS = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak."]


@pytest.fixture(scope="module")
def alone():
    return [s2d_jax.generate(p, **KW) for p in PROMPTS]


def test_a_list_of_prompts_gives_one_result_each_equal_to_alone(alone):
    many = s2d_jax.generate(PROMPTS, **KW)
    assert len(many) == 2
    for one, res in zip(alone, many):
        assert res["token_ids"] == one["token_ids"] and res["text"] == one["text"]
        assert res["finish_reason"] == one["finish_reason"] in ("stop", "length")
        assert res["prompt_ids"] == one["prompt_ids"]
        assert res["stats"]["new_tokens"] == len(one["token_ids"])
        assert "target calls" in res["summary"]


def test_stream_and_stop(alone):
    text = max((a["text"] for a in alone), key=len)
    i = [a["text"] for a in alone].index(text)
    stop = text[5:8]
    events = list(s2d_jax.generate(PROMPTS, stop=[stop], stream=True, **KW))
    results = {e["index"]: e["result"] for e in events if "result" in e}
    assert sorted(results) == [0, 1]
    for k in (0, 1):
        pieces = "".join(e["text"] for e in events if e.get("index") == k and "text" in e)
        assert pieces == results[k]["text"]
    assert results[i]["text"] == text[:text.index(stop)]
    assert results[i]["finish_reason"] == "stop"


def test_bad_settings_are_refused_before_loading():
    with pytest.raises(s2d_jax.S2DError, match="stop"):
        s2d_jax.generate(["a", "b"], target="/nonexistent", stop=[""])
    with pytest.raises(s2d_jax.S2DError, match="top_k"):
        s2d_jax.generate(["a", "b"], target="/nonexistent", top_k=3)
    with pytest.raises(s2d_jax.S2DError, match="stream"):
        s2d_jax.generate("a", target="/nonexistent", stream="yes")


def test_the_api_serve_stays_the_function_once_the_server_package_loads():
    import s2d_jax.server.app  # noqa: F401  (a package named like the function would shadow it)
    assert callable(s2d_jax.serve) and s2d_jax.serve.__module__ == "s2d_jax"


def test_slot_decoder_answers_equal_the_batch_decoded_as_one():
    """The data engine's answers stage on the slot engine (--slots): greedy rows equal."""
    from s2d_jax.data.distill import answer_rows
    from s2d_jax.decode.serving import Decoder
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.tokenizer import load_tokenizer
    from s2d_jax.server.batch import SlotDecoder

    cfg, params, _ = load_model(KW["target"])
    tok = load_tokenizer(KW["target"])
    decoder = Decoder(cfg, params, method="ar")
    prompts = PROMPTS + ["KING HENRY:", "Hark"]
    kw = dict(temperature=0.0, seed=0, max_new_tokens=20)
    whole = answer_rows(decoder, tok, prompts, **kw)
    slots = answer_rows(SlotDecoder(decoder, tok, slots=2, max_len=64), tok, prompts, **kw)
    assert [r["input_ids"] for r in slots] == [r["input_ids"] for r in whole]
    assert all(len(r["input_ids"]) > r["learn_from"] for r in slots)
