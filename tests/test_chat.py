"""Vicuna v1.1 template: exact text, ids as Vicuna saw them, assistant-only mask token by token."""

import json
import os

import pytest
import sentencepiece as spm

from s2d_jax.data.chat import (VICUNA_SYSTEM, MalformedConversation, parse_conversation,
                          render_conversation, tokenize_conversation, vicuna_prompt)
from s2d_jax.errors import S2DError
from s2d_jax.io.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "assets", "llama2_tokenizer")

PAIRS = [("Hi, who are you?", "I am Vicuna.  Nice to meet you!"),
         ("Count:  1 2", "8 apples\n\n```python\ndef f():\n    return 1\n```"),
         ("caf\u00e9?", "\u4e16\u754c \U0001F916 done.")]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(LLAMA)


@pytest.fixture(scope="module")
def sp():
    return spm.SentencePieceProcessor(model_file=os.path.join(LLAMA, "tokenizer.model"))


def as_sharegpt(pairs):
    turns = []
    for q, a in pairs:
        turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    return turns


def test_rendering_matches_fastchat_vicuna_v11():
    assert VICUNA_SYSTEM == ("A chat between a curious user and an artificial intelligence "
                             "assistant. The assistant gives helpful, detailed, and polite "
                             "answers to the user's questions.")
    assert render_conversation([("q1", "a1"), ("q2", "a2")], "SYS") == \
        "SYS USER: q1 ASSISTANT: a1</s>USER: q2 ASSISTANT: a2</s>"
    assert vicuna_prompt(["q1"], system="SYS") == "SYS USER: q1 ASSISTANT:"
    assert vicuna_prompt(["q1", "q2"], ["a1"], system="SYS") == \
        "SYS USER: q1 ASSISTANT: a1</s>USER: q2 ASSISTANT:"
    assert vicuna_prompt(["q"]).startswith(VICUNA_SYSTEM + " USER: q")
    with pytest.raises(S2DError):
        vicuna_prompt(["q1"], ["a1"])


def test_ids_equal_sentencepiece_of_rendered_conversation(tok, sp):
    ids, mask = tokenize_conversation(tok, as_sharegpt(PAIRS))
    # Vicuna's training ids: BOS, then each "</s>"-free piece by sentencepiece, joined by EOS.
    want = [sp.bos_id()]
    for piece in render_conversation(PAIRS).split("</s>")[:-1]:
        want += sp.encode(piece) + [sp.eos_id()]
    assert ids == want
    assert len(mask) == len(ids)


def masked_spans(mask):
    spans, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def check_mask(tok, ids, mask, pairs):
    assert set(mask) <= {0, 1}
    spans = masked_spans(mask)
    assert len(spans) == len(pairs)
    for (s, e), (q, a) in zip(spans, pairs):
        assert ids[e - 1] == tok.eos_id  # each reply's </s> is learned
        assert tok.decode(ids[s:e - 1]) == a  # exactly the reply, token by token
        # Everything before the span, up to the previous one, is the prompt of this turn.
        assert tok.decode(ids[:s]).endswith(f"USER: {q} ASSISTANT:")
    assert mask[0] == 0 and tok.decode([i for i, m in zip(ids, mask) if not m]).startswith(
        VICUNA_SYSTEM)


def test_mask_is_exactly_the_replies_and_their_eos(tok):
    ids, mask = tokenize_conversation(tok, as_sharegpt(PAIRS))
    check_mask(tok, ids, mask, PAIRS)
    # The reply starting with a digit: sentencepiece has no "▁8", so the separator space
    # is its own "▁" token; it belongs to the reply (the model must learn to emit it).
    s, _ = masked_spans(mask)[1]
    assert tok.hf.convert_ids_to_tokens(ids[s - 1:s + 2]) == [":", "\u2581", "8"]


def test_mask_on_real_sharegpt_conversation(tok):
    with open(os.path.join(ROOT, "data", "sharegpt_axolotl_conversation.json")) as f:
        turns = json.load(f)["conversations"]
    ids, mask = tokenize_conversation(tok, turns, system="custom system")
    system, pairs = parse_conversation(turns, "custom system")
    assert system == "custom system" and len(pairs) == 6
    spans = masked_spans(mask)
    assert [tok.decode(ids[s:e - 1]) for s, e in spans] == [a for _, a in pairs]
    assert tok.decode(ids).startswith("custom system USER: how could i implement")


def test_parse_rules():
    h = lambda v: {"from": "human", "value": v}  # noqa: E731
    g = lambda v: {"from": "gpt", "value": v}  # noqa: E731
    # A leading reply is dropped (FastChat), a trailing question without reply too.
    assert parse_conversation([g("x"), h("q"), g("a"), h("dangling")]) == \
        (VICUNA_SYSTEM, [("q", "a")])
    # A first system turn replaces the system prompt; role/content keys are accepted.
    assert parse_conversation([{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                               {"role": "assistant", "content": "a"}]) == ("S", [("q", "a")])
    bad = {
        "empty": [], "not a list": None, "unknown role": [h("q"), {"from": "bard", "value": "a"}],
        "not alternating": [h("q"), h("q2"), g("a")], "empty value": [h("q"), g("")],
        "no reply": [h("q")], "late system": [h("q"), {"from": "system", "value": "s"}, g("a")],
        "not a dict": [h("q"), "a"],
    }
    for name, turns in bad.items():
        with pytest.raises(MalformedConversation):
            parse_conversation(turns)
    assert issubclass(MalformedConversation, S2DError)
