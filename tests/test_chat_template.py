"""--chat-template auto: the tokenizer's own template, exact text and ids (no doubled BOS),
its end-of-turn token as EOS, the fallback without a template, and Spec-Bench's two-turn
questions through the bench (the second turn asked after the method's own first answer)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from s2d_jax.bench import runner as bench
from s2d_jax.config import ModelConfig
from s2d_jax.data.prompts import (end_of_turn_id, prompt_ids, render_chat,
                                  resolve_template)
from s2d_jax.errors import S2DError
from s2d_jax.io.hf import export_hf
from s2d_jax.io.tokenizer import load_tokenizer
from s2d_jax.model import transformer as model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "You are a tiny assistant."
# SmolLM2's template: a default system turn, ChatML turns, BOS = <|im_start|>
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' "
          "%}{{ '<|im_start|>system\n" + SYSTEM + "<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
# a Llama-style template that writes BOS itself
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + "
                "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
CORPUS = ["the cat sat on the mat", "what is the capital of france", "paris is the capital",
          "system user assistant", "you are a tiny assistant.", "hello there, how are you?"]


def save_tokenizer(path, template, bos, eos):
    """A small byte-level BPE over printable ASCII (every token decodes to text), with the
    ChatML special tokens and `template` in its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    ascii_ = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]  # + " " and "\n"
    bpe.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=200, special_tokens=SPECIALS, initial_alphabet=ascii_))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos,
                            pad_token=eos, chat_template=template).save_pretrained(str(path))
    return load_tokenizer(str(path))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    # eos_token is <|endoftext|>: the end of a turn must come from the template
    return save_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML, "<|im_start|>",
                          "<|endoftext|>")


def special(tok, s):
    return tok.hf.convert_tokens_to_ids(s)


def test_auto_renders_the_templates_exact_text_and_ids(chatml):
    text = render_chat(chatml, ["what is the capital of france"])
    assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nwhat is the "
                    f"capital of france<|im_end|>\n<|im_start|>assistant\n")
    ids = prompt_ids(chatml, "auto", ["what is the capital of france"])
    start, end = special(chatml, "<|im_start|>"), special(chatml, "<|im_end|>")
    # special-token strings are their ids, and BOS (= <|im_start|>) is not added again
    assert chatml.bos_id == start and ids[0] == start and ids[1] != start
    assert ids.count(start) == 3 and ids.count(end) == 2
    expected = []
    for piece in ("system\n" + SYSTEM, "\n", "user\nwhat is the capital of france", "\n",
                  "assistant\n"):
        if piece == "\n":
            expected += [end] + chatml.encode("\n", bos=False)
        else:
            expected += [start] + chatml.encode(piece, bos=False)
    assert ids == expected
    # the end of the assistant's turn, not the tokenizer's <|endoftext|>
    assert chatml.eos_id == special(chatml, "<|endoftext|>")
    assert end_of_turn_id(chatml, "auto") == end
    assert end_of_turn_id(chatml, "none") == chatml.eos_id


def test_a_template_writing_bos_gets_it_once(tmp_path):
    tok = save_tokenizer(tmp_path / "bos", BOS_TEMPLATE, "<s>", "</s>")
    ids = prompt_ids(tok, "auto", ["hello there"])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert ids[1:] == tok.encode("user: hello there\nassistant:", bos=False)
    assert end_of_turn_id(tok, "auto") == tok.eos_id  # no special token after a reply


def test_later_turns_hold_the_earlier_answers(chatml):
    ids = prompt_ids(chatml, "auto", ["hello there", "the cat"], ["paris is the capital"])
    assert chatml.hf.decode(ids) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n"
        f"<|im_start|>assistant\nparis is the capital<|im_end|>\n<|im_start|>user\nthe cat"
        f"<|im_end|>\n<|im_start|>assistant\n")
    llama = load_tokenizer(os.path.join(REPO, "assets", "llama2_tokenizer"))
    from s2d_jax.data.chat import tokenize_conversation, vicuna_prompt
    one = prompt_ids(llama, "vicuna", ["Hi there"])
    assert one == llama.encode(vicuna_prompt(["Hi there"]), bos=True)  # unchanged path
    two = prompt_ids(llama, "vicuna", ["Hi there", "More?"], ["Hello!"])
    trained, _ = tokenize_conversation(llama, [("Hi there", "Hello!")])
    assert two[:len(trained)] == trained  # the first exchange as Vicuna was trained on it
    assert llama.decode(two[len(trained):]) == "USER: More? ASSISTANT:"


def test_auto_falls_back_without_a_template(chatml, tmp_path):
    plain = save_tokenizer(tmp_path / "plain", None, "<s>", "</s>")
    assert plain.chat_template is None
    template, note = resolve_template(plain, "auto")
    # one fallback in every entry point and the API (issue 44): the text as is
    assert template == "none" and "no chat template" in note and "as none" in note
    assert resolve_template(plain, "none") == ("none", None)
    assert resolve_template(chatml, "auto") == ("auto", None)
    assert resolve_template(chatml, "vicuna") == ("vicuna", None)


# --- two-turn questions through the bench -----------------------------------------------

def export_family(root, tok_dir, vocab):
    cfg = ModelConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=3,
                      num_heads=2, num_kv_heads=1, max_position_embeddings=256)
    rng = np.random.default_rng(0)

    def leaf(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(x.shape, np.float32)
        return (0.5 * rng.standard_normal(x.shape)).astype(np.float32)

    target = jax.tree_util.tree_map_with_path(leaf, model.abstract_params(cfg))
    export_hf(target, cfg, str(root / "target"), tokenizer_dir=tok_dir)
    draft_cfg = ModelConfig(**{**cfg.__dict__, "num_layers": 2})
    draft = dict(target, layers=jax.tree.map(lambda x: x[:2], target["layers"]))
    export_hf(draft, draft_cfg, str(root / "draft"), extra={"s2d_exits": [1, 2]},
              tokenizer_dir=tok_dir)
    q = root / "q.jsonl"
    q.write_text(json.dumps({"question_id": 7, "category": "writing",
                             "turns": ["hello there", "the cat sat"]}) + "\n"
                 + json.dumps({"question_id": 8, "category": "qa",
                               "turns": ["what is the capital of france"]}) + "\n")
    return root


def test_second_turn_prompt_holds_the_methods_own_first_answer(chatml):
    class Stub:
        """Answers each prompt with its own fixed tokens; records the prompts it saw."""

        def __init__(self, answer):
            self.answer, self.prompts = answer, []

        def generate(self, prompts, temperature, seed=0, **kw):
            self.prompts.append(list(prompts[0]))
            return [{"token_ids": list(self.answer),
                     "stats": {"batch_seconds": 1.0, "compile_seconds": 0.0}}]

    questions = [{"question_id": 1, "category": "c", "text": "hello there",
                  "turns": ["hello there", "the cat sat"]},
                 {"question_id": 2, "category": "c", "text": "the mat", "turns": ["the mat"]}]
    turns = bench.Conversations(chatml, "auto", questions, max_new_tokens=4)
    end = special(chatml, "<|im_end|>")
    a = Stub(chatml.encode("paris", bos=False) + [end])
    b = Stub(chatml.encode("the mat", bos=False) + [end])
    out = bench.run_target({"a": a, "b": b}, turns.first_prompts, temperatures=[1.0],
                           max_new_tokens=4, max_len=64, eos_id=turns.eos_id,
                           next_turn=turns.next_prompt(width=64))
    assert out["items"] == [(0, 0), (0, 1), (1, 0)]
    for stub, text in ((a, "paris"), (b, "the mat")):
        rows = out["runs"][1.0]["a" if stub is a else "b"]
        second = prompt_ids(chatml, "auto", ["hello there", "the cat sat"], [text])
        assert rows[1]["prompt"] == second and second in stub.prompts
        assert chatml.hf.decode(second).count(f"assistant\n{text}<|im_end|>") == 1
        assert [r["prompt"] for r in rows] == [turns.first_prompts[0], second,
                                               turns.first_prompts[1]]
    with pytest.raises(S2DError, match="lower --max-new-tokens"):  # no room reserved
        turns.next_prompt(width=8)(0, [a.answer])


@pytest.mark.slow  # CI time: a whole bench run; infer.generate's every-turn test stays fast
def test_bench_runs_both_turns_and_writes_them(chatml, tmp_path, capsys):
    from infer.bench import main

    fam = export_family(tmp_path, chatml.path, chatml.vocab_size)
    out = tmp_path / "out"
    rc = main(["--target", f"t={fam / 'target'}", "--draft", str(fam / "draft"),
               "--questions", str(fam / "q.jsonl"), "--methods", "ar,s2d",
               "--temperatures", "0,1", "--max-new-tokens", "6", "--gamma", "2",
               "--out", str(out)])
    assert rc == 0
    assert "no chat template" not in capsys.readouterr().err
    rep = json.loads((out / "report.json").read_text())
    assert rep["settings"]["chat_template"] == "auto" and rep["settings"]["turns"] == 3
    for t in ("0", "1"):
        answers = {label: [json.loads(x) for x in
                           (out / "answers" / "t" / f"{label}-T{t}.jsonl").read_text()
                           .splitlines()] for label in ("ar", "s2d-0.5")}
        for label, rows in answers.items():
            assert [r["question_id"] for r in rows] == [7, 8]
            two, one = rows[0]["choices"][0], rows[1]["choices"][0]
            assert len(two["turns"]) == len(two["new_tokens"]) == len(two["wall_time"]) == 2
            assert len(one["turns"]) == 1
            m = rep["targets"]["t"]["results"][f"{t}.0" if t == "0" else "1.0"][label]
            # every turn is counted: tokens and seconds of the three turns
            assert m["new_tokens"] == sum(two["new_tokens"]) + sum(one["new_tokens"])
            assert m["seconds"] == pytest.approx(sum(two["wall_time"]) + sum(one["wall_time"]))
            assert m["per_category"]["mt_bench"]["prompts"] == 2
        if t == "0":  # greedy: the second turn, asked after the same answer, is AR's too
            assert answers["s2d-0.5"][0]["choices"][0]["turns"] == \
                answers["ar"][0]["choices"][0]["turns"]
    assert rep["targets"]["t"]["results"]["0.0"]["s2d-0.5"]["exact_match_vs_ar"] == 1.0


SMOLLM2 = os.path.expanduser("~/.cache/s2d-jax/SmolLM2-135M-Instruct")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(SMOLLM2),
                    reason="SmolLM2-135M-Instruct is not fetched (python -m infer.fetch_smollm2)")
def test_smollm2_answers_in_its_own_template_and_stops_at_im_end(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "infer.generate", "--target", f"r={SMOLLM2}", "--method", "ar",
         "--prompt", "What is the capital of France?", "--max-new-tokens", "32",
         "--out-file", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr
    assert "no chat template" not in proc.stderr
    row = json.loads(out.read_text())
    tok = load_tokenizer(SMOLLM2)
    assert row["text"] == "The capital of France is Paris."
    assert row["token_ids"][-1] == tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert row["stats"]["new_tokens"] < 32
