"""Conversations on a tiny chat model with its own template (no download): s2d_jax.generate
with a string or chat messages, s2d_jax.Chat over two turns, `python -m infer.chat
--script`, and the readable statistics line. Greedy S2D answers equal AR's in every turn."""

import json

import pytest

import s2d_jax
from s2d_jax.data.prompts import prompt_ids, split_messages
from s2d_jax.decode.stats_line import stats_line
from s2d_jax.errors import S2DError
from test_chat_template import export_family, save_tokenizer, CHATML

NEW = 8


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatfam")
    tok = save_tokenizer(root / "tok", CHATML, "<|im_start|>", "<|endoftext|>")
    export_family(root, tok.path, tok.vocab_size)
    return root, tok


U1, U2 = "hello there", "the cat sat"


@pytest.fixture(scope="module")
def answers(family):
    """Per method, the answers of s2d_jax.generate to U1 and then, as chat messages, to U2
    after U1 and that answer (every later test reuses these compilations)."""
    root, _ = family
    out = {}
    for method in ("ar", "s2d"):
        one = s2d_jax.generate(U1, target=str(root / "target"), draft=str(root / "draft"),
                               method=method, max_new_tokens=NEW, gamma=2)
        messages = [{"role": "user", "content": U1},
                    {"role": "assistant", "content": one["reply"]},
                    {"role": "user", "content": U2}]
        two = s2d_jax.generate(messages, target=str(root / "target"),
                               draft=str(root / "draft"), method=method,
                               max_new_tokens=NEW, gamma=2)
        out[method] = (one, two)
    return out


def test_generate_renders_a_string_in_the_template(family, answers):
    _, tok = family
    one = answers["s2d"][0]
    assert one["prompt_ids"] == prompt_ids(tok, "auto", [U1])
    assert tok.hf.decode(one["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert one["token_ids"] == answers["ar"][0]["token_ids"] and one["text"]
    assert one["summary"].startswith(f"{one['stats']['new_tokens']} new tokens in ")


def test_generate_answers_the_last_of_several_messages_in_context(family, answers):
    _, tok = family
    one, two = answers["s2d"]
    assert two["prompt_ids"] == prompt_ids(tok, "auto", [U1, U2], [one["reply"]])
    assert two["token_ids"] == answers["ar"][1]["token_ids"]
    messages = [{"role": "user", "content": U1}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": U2}]
    with pytest.raises(S2DError, match="alternate user and assistant"):
        split_messages(messages[:1] + messages[2:])
    with pytest.raises(S2DError, match="last message must be the user's"):
        split_messages(messages[:2])


def test_generate_expands_home_and_variables_in_paths(family, answers, monkeypatch):
    root, _ = family
    monkeypatch.setenv("HOME", str(root))
    monkeypatch.setenv("S2D_TINY", str(root))
    out = s2d_jax.generate(U1, target="~/target", draft="$S2D_TINY/draft",
                           max_new_tokens=NEW, gamma=2)
    assert out["token_ids"] == answers["s2d"][0]["token_ids"]


def test_chat_keeps_the_conversation_as_generate_would(family, answers):
    root, _ = family
    chat = s2d_jax.Chat(str(root / "target"), str(root / "draft"), gamma=2,
                        max_new_tokens=NEW)
    one, two = chat.say(U1), chat.say(U2)
    assert [one["token_ids"], two["token_ids"]] == [a["token_ids"] for a in answers["ar"]]
    assert two["prompt_ids"] == answers["s2d"][1]["prompt_ids"]
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 2
    assert chat.summary().startswith("2 turn(s): ")
    chat.reset()
    assert chat.messages == [] and chat.say(U1)["token_ids"] == one["token_ids"]


def test_chat_cli_runs_a_script_of_two_turns_as_ar_answers(family, answers, tmp_path,
                                                          capsys):
    from infer.chat import main

    root, _ = family
    script = tmp_path / "turns.txt"
    script.write_text(f"{U1}\n{U2}\n/stats\n/reset\n{U1}\n")
    out = tmp_path / "s2d.jsonl"
    assert main(["--target", str(root / "target"), "--draft", str(root / "draft"),
                 "--gamma", "2", "--max-new-tokens", str(NEW), "--script", str(script),
                 "--out-file", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.count("you> ") == 5 and printed.out.count("assistant> ") == 3
    assert "2 turn(s): " in printed.out and "(conversation cleared)" in printed.out
    assert printed.err.count(" new tokens in ") == 3
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["conversation"], r["turn"]) for r in rows] == [(1, 1), (1, 2), (2, 1)]
    ar = [a["text"] for a in answers["ar"]]
    assert [r["text"] for r in rows] == ar + ar[:1]  # greedy S2D = AR; /reset forgot turn 1
    for r, a in zip(rows, ar):  # streamed: each answer printed whole after its prompt
        assert f"assistant> {a}\n" in printed.out


def test_chat_cli_checks_arguments_before_loading(tmp_path, capsys):
    from infer.chat import main
    from tiny_models import cli_error

    missing = str(tmp_path / "no-such-model")
    assert "needs --draft PATH" in cli_error(main, capsys, ["--target", missing])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert "holds no turns" in cli_error(main, capsys, ["--target", missing, "--method", "ar",
                                                         "--script", str(empty)])


def test_stats_line_names_exits_and_shows_compile_once():
    s = {"method": "s2d", "new_tokens": 112, "target_calls": 92,
         "tokens_per_target_call": 112 / 92, "drafted_by_exit": {"2": 25, "4": 137},
         "draft_acceptance": 0.2469, "batch_tokens_per_s": 4.6312, "compile_seconds": 19.13}
    assert stats_line(s) == ("112 new tokens in 92 target calls (1.22 tokens per call); "
                             "drafted 162 tokens (25 by exit 2, 137 by exit 4), 0.25 of them "
                             "accepted; 4.63 tok/s after a 19.1 s compile")
    again = dict(s, drafted_by_exit={"2": 91, "4": 0}, compile_seconds=0.001)
    assert stats_line(again) == ("112 new tokens in 92 target calls (1.22 tokens per call); "
                                 "drafted 91 tokens by exit 2, 0.25 of them accepted; "
                                 "4.63 tok/s")
    assert "no draft (ar)" in stats_line(dict(s, method="ar", drafted_by_exit={}))
