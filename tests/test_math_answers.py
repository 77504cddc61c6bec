"""math_reasoning final-answer accuracy (s2d_jax/bench/math_answers.py) and the HF-vs-AR
first-token agreement report (s2d_jax/bench/hf_baseline.first_token_agreement)."""

import pytest

from s2d_jax.bench.math_answers import final_number, math_accuracy, reference_number
from s2d_jax.bench.report import task_tables


@pytest.mark.parametrize("text, want", [("So the total is $1,000.", 1000.0),
                                        ("3 apples and 4.5 pears: 7.5", 7.5),
                                        ("It drops by -2", -2.0), ("no number here", None)])
def test_final_number(text, want):
    assert final_number(text) == want


def test_reference_number_reads_the_gsm8k_answer_after_the_marker():
    assert reference_number(["so 2+3=<<2+3=5>>5 and 10 more\n#### 15"]) == 15.0
    assert reference_number(None) is None


def test_math_accuracy_counts_first_turns_of_math_questions_only():
    qs = [{"task": "math_reasoning", "reference": ["#### 4"]},
          {"task": "math_reasoning", "reference": ["#### 9"]},
          {"task": "writing", "reference": ["#### 1"]}]
    items = [(0, 0), (1, 0), (1, 1), (2, 0)]
    rows = [{"token_ids": t} for t in ("2+2 = 4", "it is 8", "9", "1")]
    acc = math_accuracy(qs, items, rows, decode=lambda t: t)
    assert acc == {"correct": 1, "total": 2, "accuracy": 0.5}
    assert math_accuracy(qs[2:], [(0, 0)], rows[:1], decode=str) is None


def test_task_tables_show_tasks_accuracy_and_hf_divergence():
    cat = {"prompts": 1, "tokens_per_second": 2.0, "speedup_vs_ar": 1.5,
           "mean_accepted_tokens": 2.5}
    m = {"per_category": {"qa": cat, "rag": cat},
         "math_accuracy": {"correct": 3, "total": 8, "accuracy": 0.375}}
    rep = {"targets": {"t": {"results": {"0.0": {"ar": m}}, "hf_baseline": {"plain": {
        "first_tokens_vs_ar": {"tokens": 64, "agree": 0.5, "diverged": [
            {"prompt": 1, "position": 17, "hf_logit_gap": 0.0003}]}}}}}}
    text = task_tables(rep)
    assert "| ar | 1.50x / 2.50 | 1.50x / 2.50 |" in text
    assert "ar 3/8" in text and "at token 17" in text and "50%" in text


def test_first_token_agreement_finds_the_divergence_and_hf_prefers_its_token(tmp_path):
    torch = pytest.importorskip("torch")
    from s2d_jax.bench.hf_baseline import _load, first_token_agreement, hf_generate
    from test_bench import export_tiny_family

    root = export_tiny_family(tmp_path)
    lm = _load(str(root / "target"))
    prompts = [[1, 5, 9, 3], [1, 7, 2]]
    hf = hf_generate(str(root / "target"), prompts, max_new_tokens=8, eos_id=None,
                     lm=lm)["token_ids"]
    ours = [list(hf[0]), list(hf[1])]
    ours[1][3] = (hf[1][3] + 1) % 32000  # a divergence at the 4th new token
    rep = first_token_agreement(lm, prompts, hf, ours, n=8)
    assert rep["agree"] == 0.5 and len(rep["diverged"]) == 1
    d = rep["diverged"][0]
    assert (d["prompt"], d["position"], d["hf_token"]) == (1, 3, hf[1][3])
    assert d["hf_logit_gap"] > 0  # greedy HF took its argmax, not our token
    assert torch is not None
