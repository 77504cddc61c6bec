"""Question files (Spec-Bench / MT-bench jsonl: question_id, category, turns) -> prompts."""

from __future__ import annotations

import json
import os

from s2d_jax.errors import S2DError
from s2d_jax.readers import read_text


def read_questions(path: str, categories=None, max_prompts: int | None = None) -> list[dict]:
    """[{question_id, category, target, text (first turn)}], filtered by category; with
    max_prompts, the first N taken round-robin over the categories. `target` is an optional
    per-line field naming the target a multi-target engine routes the prompt to."""
    if not os.path.isfile(path):
        raise S2DError(f"questions file {path} does not exist; check the path")
    out = []
    for n, line in enumerate(read_text(path, "questions file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row["turns"], list):  # a bare string would give its 1st char
                raise TypeError
            text = row["turns"][0]
            if not isinstance(text, str) or not text:
                raise TypeError
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise S2DError(f"{path}:{n} is not a JSON line with a non-empty 'turns' list; "
                           f"write one {{\"turns\": [\"...\"]}} object per line (Spec-Bench / "
                           f"MT-bench format)")
        out.append({"question_id": row.get("question_id", n), "category":
                    row.get("category"), "target": row.get("target"), "text": text})
    if categories:
        known = sorted({str(q["category"]) for q in out})
        missing = [c for c in categories if c not in known]
        if missing:
            raise S2DError(f"category {missing[0]!r} is not in {path}; known: {', '.join(known)}")
        out = [q for q in out if q["category"] in categories]
    if max_prompts is not None:
        if max_prompts < 1:
            raise S2DError(f"--max-prompts must be >= 1, got {max_prompts}")
        # Spec-Bench files are grouped by category: take the first prompts of every
        # category in turn, so a short run still covers every task
        groups = {}
        for q in out:
            groups.setdefault(q["category"], []).append(q)
        rounds = [q for i in range(max(len(g) for g in groups.values()))
                  for g in groups.values() if i < len(g) for q in [g[i]]]
        out = rounds[:max_prompts]
    if not out:
        raise S2DError(f"questions file {path} holds no prompts; write one JSON line with a "
                       f"'turns' list per prompt")
    return out


def encode_questions(tok, questions: list[dict], chat_template: str = "none") -> list[list[int]]:
    """Token ids per question (BOS first), optionally in the Vicuna chat template."""
    if chat_template not in ("none", "vicuna"):
        raise S2DError(f"unknown chat template {chat_template!r}; use none or vicuna")
    if chat_template == "vicuna":
        from s2d_jax.data.chat import vicuna_prompt
        return [tok.encode(vicuna_prompt([q["text"]]), bos=True) for q in questions]
    return [tok.encode(q["text"], bos=True) for q in questions]
