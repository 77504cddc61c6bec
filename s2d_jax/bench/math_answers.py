"""Final-answer accuracy on Spec-Bench's math_reasoning questions (GSM8K): the last number
of the model's answer against the number after the reference's "####".

A lossless method must score exactly AR's accuracy at T = 0; at T = 1 the accuracy is a
check that sampling through the draft keeps the target's answers as good as its own.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _to_float(text: str) -> float | None:
    try:
        return float(text.replace("$", "").replace(",", "").rstrip("."))
    except ValueError:
        return None


def final_number(text: str) -> float | None:
    """The last number in an answer ("The answer is $1,000." -> 1000.0), None if none."""
    found = NUMBER.findall(text or "")
    return _to_float(found[-1]) if found else None


def reference_number(reference) -> float | None:
    """GSM8K's reference: the number after its last "####" (else its last number)."""
    ref = reference[0] if isinstance(reference, list) and reference else reference
    if not isinstance(ref, str):
        return None
    tail = ref.rsplit("####", 1)[-1] if "####" in ref else ref
    return final_number(tail)


def math_accuracy(questions: list[dict], items, rows: list[dict], decode) -> dict | None:
    """{"correct", "total", "accuracy"} over the first turns of math_reasoning questions
    with a reference; None if there are none. `items[k]` = (question index, turn) of
    `rows[k]`; `decode(ids)` -> text."""
    correct = total = 0
    for (i, j), row in zip(items, rows):
        q = questions[i]
        want = reference_number(q.get("reference"))
        if j != 0 or q.get("task") != "math_reasoning" or want is None:
            continue
        got = final_number(decode(row["token_ids"]))
        total += 1
        correct += int(got is not None and abs(got - want) < 1e-6)
    if not total:
        return None
    return {"correct": correct, "total": total, "accuracy": correct / total}
