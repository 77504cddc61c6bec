"""The data of one point of the data-scaling study (bench/study.py): exactly `budget`
unique supervised tokens of one kind, taken from a data-engine work dir (engine.py).

    on_policy       the target's answers: the engine's first answer shards, in order (the
                    engine answers prompt batches in a seeded random order, so any prefix
                    of its shards is a fair sample); only answer tokens count (the loss
                    is on answers)
    teacher_forced  text the target did not write: GSM8K-train reference solutions and
                    documents, as the engine's teacher stage tokenizes them
                    (engine.token_rows), in a seeded random order; built here from the
                    source files rather than read from the teacher stage, so that a point
                    is the same data whether or not that stage has run yet

A smaller budget's rows are a prefix of a larger one's; the last row taken is cut so the
slice holds exactly `budget` supervised tokens.
"""

from __future__ import annotations

import os

import numpy as np

from s2d_jax.data import engine, shards
from s2d_jax.errors import S2DError

KINDS = ("on_policy", "teacher_forced")
STAGES = ("prompts", "answers")  # what makes a dir an engine work dir


def supervised_tokens(row: dict) -> int:
    """Tokens a row's loss is on: its targets ids[1:] from position learn_from on."""
    return len(row["input_ids"]) - max(row["learn_from"], 1)


def check_engine_dir(work: str) -> None:
    missing = [s for s in STAGES if not os.path.isfile(os.path.join(work, s, shards.MANIFEST))]
    if missing:
        raise S2DError(f"{work} is not a data-engine work dir (no {missing[0]}/"
                       f"{shards.MANIFEST}); start one with python -m train.data_engine "
                       f"--work {work}")


def answer_rows(work: str):
    """The token rows of the engine's answer shards finished so far, in shard order."""
    return ({"input_ids": r["input_ids"], "learn_from": r["learn_from"], "kind": "answer"}
            for r in shards.prefix_rows(os.path.join(work, "answers")))


def text_rows(work: str, tok, template: str, document_files, eval_files, max_tokens: int,
              seed: int = 0) -> list[dict]:
    """Teacher-forced token rows: every reference solution of a kept training prompt and
    every document window, without any n-gram of the evaluation sets, shuffled (seeded)."""
    from s2d_jax.data.overlap import eval_ngrams
    from s2d_jax.data.prompt_pool import documents
    pool = [r["prompt"] for r in shards.read_rows(os.path.join(work, "prompts"))]
    refs = engine.reference_items(engine.REFERENCES, pool, len(pool), eval_ngrams(eval_files))
    docs = documents(document_files, eval_files)[0] if document_files else []
    items = engine.supervision_items([], refs, docs)
    rows = [r for item in items for r in engine.token_rows(item, tok, template, max_tokens)
            if len(r["input_ids"]) >= 2 and r["learn_from"] < len(r["input_ids"])]
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]


def take_budget(rows, budget: int) -> tuple[list[dict], int]:
    """(the first rows holding exactly `budget` supervised tokens, the last one cut; [] if
    the rows hold fewer) and how many supervised tokens were seen (all of them when short)."""
    taken, seen = [], 0
    for row in rows:
        n = supervised_tokens(row)
        if n <= 0:
            continue
        if seen + n >= budget:
            keep = len(row["input_ids"]) - (seen + n - budget)
            return taken + [{**row, "input_ids": row["input_ids"][:keep]}], budget
        taken.append(row)
        seen += n
    return [], seen
