"""Spec-Bench-format prompt sets of the demo family, cut from the held-out split.

Two disjoint sets with the same four categories:
  data/demo_questions.jsonl    the benchmark's prompts (python -m infer.bench)
  data/demo_calibration.jsonl  the dev prompts of python -m infer.calibrate

The dev set is drawn from held-out speeches the benchmark does not use (nor their
neighbours, which a dialogue prompt reads). Calibrating on training speeches instead
(what the family first did) overstated acceptance: the targets continue text they were
trained on far more predictably (MAT 5.25 vs 4.29 on target-l at gamma 6), so the
calibration chose a gamma that lost to plain SD on the benchmark.
"""

from __future__ import annotations

import re

import numpy as np

from s2d_jax.errors import S2DError

QUESTION_CATEGORIES = ("speaker", "line", "passage", "dialogue")
QUESTIONS_PER_CATEGORY = 10
DEV_PER_CATEGORY = 4  # 16 calibration prompts
# A speech in tinyshakespeare starts with its speaker tag on a line of its own.
_SPEAKER_TAG = re.compile(r"^[A-Z][A-Za-z' .,-]*:$")


def speech(paragraph: str) -> tuple[str, list[str]] | None:
    """(speaker tag, lines) if the paragraph is a speech, else None."""
    lines = paragraph.split("\n")
    if len(lines) < 2 or not _SPEAKER_TAG.match(lines[0]):
        return None
    return lines[0], lines[1:]


def _picks(held_out: list[str], seed: int, per_category: int,
           exclude: frozenset = frozenset()) -> list[tuple[str, int]]:
    """(category, paragraph index) of each prompt, seeded, skipping `exclude`."""
    speeches = [(i, s) for i, s in ((i, speech(p)) for i, p in enumerate(held_out))
                if s and i not in exclude]
    rng = np.random.default_rng(seed)
    candidates = {
        "speaker": [i for i, _ in speeches],
        "line": [i for i, _ in speeches],
        "passage": [i for i, (_, lines) in speeches if len(lines) >= 4],
        "dialogue": [i for i, (_, lines) in speeches
                     if i + 1 < len(held_out) and i + 1 not in exclude
                     and speech(held_out[i + 1]) and len(lines) <= 8],
    }
    out = []
    for cat in QUESTION_CATEGORIES:
        pool = candidates[cat]
        if len(pool) < per_category:
            raise S2DError(f"held-out split has {len(pool)} speeches usable for the {cat!r} "
                           f"prompts, need {per_category}; use a larger corpus")
        out += [(cat, i) for i in sorted(rng.choice(pool, size=per_category,
                                                    replace=False).tolist())]
    return out


def _prompt(held_out: list[str], cat: str, i: int) -> str:
    tag, lines = speech(held_out[i])
    if cat == "speaker":
        return f"{tag}\n"
    if cat == "line":
        return f"{tag}\n{lines[0]}\n"
    if cat == "passage":
        return f"{tag}\n" + "".join(f"{ln}\n" for ln in lines[:3])
    return f"{held_out[i]}\n\n{speech(held_out[i + 1])[0]}\n"


def _records(held_out: list[str], picks) -> list[dict]:
    return [{"question_id": qid, "category": cat, "turns": [_prompt(held_out, cat, i)]}
            for qid, (cat, i) in enumerate(picks, start=1)]


def make_questions(held_out: list[str], seed: int = 0,
                   per_category: int = QUESTIONS_PER_CATEGORY) -> list[dict]:
    """Spec-Bench-format prompts from held-out speeches, 4 categories, seeded.

    speaker: "TAG:\\n"; line: tag + first line; passage: tag + first 3 lines (speeches of
    >= 4 lines, so the model continues mid-speech); dialogue: a whole speech + a blank line
    + the next speaker's tag.
    """
    return _records(held_out, _picks(held_out, seed, per_category))


def make_question_sets(held_out: list[str], per_category: int = QUESTIONS_PER_CATEGORY,
                       dev_per_category: int = DEV_PER_CATEGORY
                       ) -> tuple[list[dict], list[dict]]:
    """(benchmark prompts, dev prompts): the benchmark's are make_questions(seed 0); the
    dev set (seed 1) avoids every paragraph the benchmark reads and its neighbours."""
    bench = _picks(held_out, 0, per_category)
    used = frozenset(j for _, i in bench for j in (i - 1, i, i + 1, i + 2))
    dev = _picks(held_out, 1, dev_per_category, exclude=used)
    return _records(held_out, bench), _records(held_out, dev)
