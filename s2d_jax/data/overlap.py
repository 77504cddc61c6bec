"""Training text kept apart from the evaluation sets: exact-duplicate removal and an n-gram
overlap filter.

A draft measured on Spec-Bench must not have trained on it: any training text that shares
one 8-gram of normalized words (lowercased Unicode word characters, so punctuation,
spacing and case do not hide a copy) with an evaluation question, turn or reference is
dropped. The default evaluation files: Spec-Bench (whose questions 81-160 are MT-bench's
80 two-turn questions, turn for turn), GSM8K test (Spec-Bench holds 80 of its 1319) and
the SmolLM2 calibration prompts (held out for choosing exits and thresholds).
"""

from __future__ import annotations

import json
import os
import re
import unicodedata

from s2d_jax.errors import S2DError
from s2d_jax.readers import read_text

NGRAM = 8
EVAL_FILES = ("data/spec_bench_question.jsonl", "data/gsm8k_test.jsonl",
              "data/smollm2_calibration.jsonl")
# the text fields of the evaluation files: Spec-Bench / MT-bench, GSM8K
_EVAL_FIELDS = ("turns", "reference", "question", "answer")
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Normalized word tokens: NFKC, lowercased, runs of word characters."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def ngrams(text: str, n: int = NGRAM) -> set[str]:
    """The text's n-grams of normalized words (a text shorter than n words has none)."""
    w = words(text)
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def eval_texts(path: str) -> list[str]:
    """Every question, turn, reference and answer text of a JSON-lines evaluation file."""
    if not os.path.isfile(path):
        raise S2DError(f"evaluation file {path} does not exist; check the path")
    out = []
    for n, line in enumerate(read_text(path, "evaluation file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise S2DError(f"{path}:{n} is not valid JSON ({e.msg}); fix the line") from e
        for field in _EVAL_FIELDS if isinstance(row, dict) else ():
            value = row.get(field)
            out += [value] if isinstance(value, str) else [
                v for v in (value or []) if isinstance(v, str)]
    if not out:
        raise S2DError(f"evaluation file {path} holds no {', '.join(_EVAL_FIELDS)} text; "
                       f"give a Spec-Bench, MT-bench or GSM8K JSON-lines file")
    return out


def eval_ngrams(paths=EVAL_FILES, n: int = NGRAM) -> set[str]:
    """The n-grams of every text of the evaluation files."""
    grams: set[str] = set()
    for path in paths:
        for text in eval_texts(path):
            grams |= ngrams(text, n)
    return grams


def overlaps(text: str, banned: set[str], n: int = NGRAM) -> bool:
    return not ngrams(text, n).isdisjoint(banned)


def without_overlap(texts, banned: set[str], n: int = NGRAM) -> tuple[list, int]:
    """(the texts sharing no n-gram with `banned`, in order; how many were dropped)."""
    kept = [t for t in texts if not overlaps(t, banned, n)]
    return kept, len(texts) - len(kept)


def dedupe(texts) -> tuple[list, int]:
    """(the first of every group of texts equal up to case, spacing and punctuation, in
    order; how many repeats were dropped). Texts without a word are dropped too."""
    seen, kept = set(), []
    for t in texts:
        key = " ".join(words(t))
        if key and key not in seen:
            seen.add(key)
            kept.append(t)
    return kept, len(texts) - len(kept)
