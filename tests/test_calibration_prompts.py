"""The real model's calibration prompts: Spec-Bench-shaped, and disjoint from everything the
benchmark asks and the draft was trained on (a calibration that saw those would be flattered)."""

import json

from s2d_jax.data.distill import training_prompts
from s2d_jax.data.prompts import read_questions
from train.smollm2_draft import PROMPT_QUOTA

CALIBRATION = "data/smollm2_calibration.jsonl"
SPEC_TASKS = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}


def test_calibration_prompts_cover_every_spec_bench_task_in_a_short_run():
    # the pipeline calibrates on the first 12: two of each task
    picked = read_questions(CALIBRATION, None, 12)
    tasks = [q["task"] for q in picked]
    assert set(tasks) == SPEC_TASKS
    assert all(tasks.count(t) == 2 for t in SPEC_TASKS)


def test_calibration_prompts_are_disjoint_from_spec_bench_and_the_distillation_prompts():
    turns = [t for q in read_questions(CALIBRATION) for t in q["turns"]]
    with open("data/spec_bench_question.jsonl", encoding="utf-8") as f:
        spec = {t.strip() for line in f for t in json.loads(line)["turns"]}
    distilled = {p.strip() for p in training_prompts(PROMPT_QUOTA, seed=0)}
    assert len(turns) == len(set(turns))
    assert not [t for t in turns if t.strip() in spec]
    assert not [t for t in turns if t.strip() in distilled]
    # the GSM8K questions are held out from distillation, not merely reworded
    gsm = [q["text"] for q in read_questions(CALIBRATION, ["math_reasoning"])]
    assert len(gsm) == 8 and not set(gsm) & distilled
