"""Training prompts without a hub: the 8-gram overlap filter on planted copies of
evaluation text, deduplication, the pool's sources, and Magpie user turns."""

import json
import os

import pytest

from s2d_jax.data import magpie, overlap, prompt_pool
from s2d_jax.errors import S2DError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MT_BENCH = os.path.join(ROOT, "data", "mt_bench_question.jsonl")  # shipped (data/README.md)


def _rows(path):
    with open(os.path.join(ROOT, path)) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def banned():
    cwd = os.getcwd()
    os.chdir(ROOT)  # EVAL_FILES are repository paths
    try:
        return overlap.eval_ngrams()
    finally:
        os.chdir(cwd)


def test_planted_overlaps_are_removed_and_clean_prompts_kept(banned):
    spec = _rows("data/spec_bench_question.jsonl")
    summary = next(q for q in spec if q["category"] == "summarization")["turns"][0]
    words = summary.split()
    second_turn = next(q for q in spec if q["question_id"] == 81)["turns"][1]
    gsm8k_test = _rows("data/gsm8k_test.jsonl")[500]["question"]
    calibration = _rows("data/smollm2_calibration.jsonl")[0]["turns"][0]
    planted = [
        # 8 words of a Spec-Bench article, in other case and punctuation, inside new text
        "Please rewrite this: " + ", ".join(words[40:48]).upper() + "! Thanks a lot.",
        "Before answering, think. " + second_turn,  # an MT-bench second turn
        gsm8k_test.replace(" ", "  "),  # a GSM8K test question, spaced out
        calibration,  # a held-out calibration prompt
    ]
    clean = ["Write a haiku about the first snow falling on a quiet mountain village.",
             "What is the boiling point of water at the top of Mount Everest?",
             # 7 of the article's words in a row: below the n-gram, kept
             "Consider: " + " ".join(words[40:47]) + " and say nothing else."]
    kept, dropped = overlap.without_overlap(planted + clean, banned)
    assert kept == clean and dropped == len(planted)


def test_spec_bench_holds_mt_bench_turn_for_turn(banned):
    """MT-bench needs no file of its own: every 8-gram of its questions is Spec-Bench's."""
    assert all(overlap.ngrams(t) <= banned for t in overlap.eval_texts(MT_BENCH))


def test_dedupe_keeps_the_first_of_texts_equal_but_for_case_and_punctuation():
    texts = ["What is 2 + 2?", "what is 2+2", "  WHAT IS 2 + 2 ?!", "What is 3 + 3?", "?!", ""]
    assert overlap.dedupe(texts) == (["What is 2 + 2?", "What is 3 + 3?"], 4)


def test_the_pool_cleans_files_and_generated_turns_naming_each_source(tmp_path):
    a, b, ev = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "eval.jsonl"
    leaked = "one two three four five six seven eight nine"
    a.write_text("".join(json.dumps({"question": q}) + "\n" for q in
                         ["How many apples are left?", leaked, "Name a prime number."]))
    b.write_text(json.dumps({"question": "how many apples are LEFT"}) + "\n")
    ev.write_text(json.dumps({"turns": ["Say " + leaked[:-5]]}) + "\n")
    rows, counts = prompt_pool.prompt_pool([str(a), str(b)], ["Tell me a joke.", "name a "
                                           "prime number"], eval_files=[str(ev)])
    assert [(r["prompt"], r["source"]) for r in rows] == [
        ("How many apples are left?", str(a)), ("Name a prime number.", str(a)),
        ("Tell me a joke.", "magpie")]
    assert counts == {"read": 6, "duplicates": 2, "overlapping": 1, "kept": 3}


def test_an_evaluation_file_without_text_is_one_error(tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"id": 1}) + "\n")
    with pytest.raises(S2DError, match="no turns"):
        overlap.eval_ngrams([str(bad)])
    with pytest.raises(S2DError, match="does not exist"):
        overlap.eval_ngrams([str(tmp_path / "nope.jsonl")])


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    from test_chat_template import CHATML, save_tokenizer
    return save_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML, "<|im_start|>",
                          "<|endoftext|>")


def test_the_magpie_prefix_is_the_template_up_to_the_users_text(chatml):
    from test_chat_template import SYSTEM
    prefix, end = magpie.user_turn_prefix(chatml)
    assert prefix == chatml.encode_rendered(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
                                            f"<|im_start|>user\n")
    assert end == chatml.hf.convert_tokens_to_ids("<|im_end|>")  # not EOS <|endoftext|>


class FakeDecoder:
    """Answers each batch with the planned rows; records how it was called."""

    def __init__(self, rows):
        self.rows, self.calls = list(rows), []

    def generate(self, prompts, **kw):
        self.calls.append((prompts, kw))
        out, self.rows = self.rows[:len(prompts)], self.rows[len(prompts):]
        return [{"token_ids": r} for r in out]


def test_magpie_keeps_the_turns_that_end_and_samples_each_batch_anew(chatml):
    prefix, end = magpie.user_turn_prefix(chatml)
    hello = chatml.encode("hello there, how are you?", bos=False)
    cat = chatml.encode("the cat sat on the mat", bos=False)
    dec = FakeDecoder([hello + [end], cat, [end], cat + [end], hello])  # cut, empty, cut
    turns = magpie.sample_user_turns(dec, chatml, 5, batch_size=2, seed=7, log=lambda m: None)
    assert turns == ["hello there, how are you?", "the cat sat on the mat"]
    assert [len(p) for p, _ in dec.calls] == [2, 2, 1]
    assert all(p == [prefix] * len(p) for p, _ in dec.calls)
    assert [kw["seed"] for _, kw in dec.calls] == [7, 8, 9]
    assert all(kw["temperature"] == 1.0 and kw["eos_id"] == end for _, kw in dec.calls)


def test_magpie_needs_a_chat_template(tmp_path):
    from s2d_jax.io.tokenizer import load_tokenizer
    with pytest.raises(S2DError, match="no chat template"):
        magpie.user_turn_prefix(load_tokenizer(os.path.join(ROOT, "models", "demo",
                                                            "target-l")))
