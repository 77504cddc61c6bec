"""The data engine's stages: every one a `shards.run_stage` (resumable, idempotent, skipped
once complete) under one work dir, each recording the target's fingerprint.

    magpie/    user turns the target writes itself (magpie.py), one shard per batch
    prompts/   the training prompts: files + Magpie turns, deduplicated, without any
               8-gram of the evaluation and held-out sets (prompt_pool.py)
    answers/   the target's answers to the first N prompts of a seeded draw, greedy and at
               T = 1, one shard per generation batch (distill.answer_rows)
    teacher/   teacher-forced supervision: token rows of the answers, GSM8K reference
               solutions and documents, each shard with the target's final-normed states
               at its positions (teacher.py; what data.teacher feeds the KD term)
    train/     rows.jsonl + teacher/ (an index of the teacher shards' state files, not a
               copy): what the trainer reads

The model passes come in as callables (decode ranks above data): a `Decoder` for
generation, `states(rows) -> [tokens, D]` for the teacher forward.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from s2d_jax.data import shards
from s2d_jax.errors import S2DError
from s2d_jax.readers import sha256_of

ANSWER_TEMPERATURES = (0.0, 1.0)
REFERENCES = "data/gsm8k_train.jsonl"
# GSM8K's calculator annotations (<<48/2=24>>): the target never writes them
_CALC = re.compile(r"<<[^<>]*>>")


def target_fingerprint(target_dir: str) -> str:
    """sha256 over the target's config, tokenizer and weight files: which target a stage's
    rows come from."""
    import hashlib
    names = sorted(n for n in os.listdir(target_dir)
                   if n in ("config.json", "tokenizer.json") or n.endswith(".safetensors"))
    if "config.json" not in names:
        raise S2DError(f"{target_dir} has no config.json; give the target's HF dir")
    joined = "".join(f"{n}:{sha256_of(os.path.join(target_dir, n))}\n" for n in names)
    return hashlib.sha256(joined.encode()).hexdigest()


# What each stage records besides its items, target and shard size: every argument that
# changes the rows it writes (a resume with another value is refused, shards.run_stage).
def magpie_settings(batch_size: int, seed: int) -> dict:
    return {"--batch-size": batch_size, "--seed": seed}


def answers_settings(max_new_tokens: int, seed: int) -> dict:
    return {"--max-new-tokens": max_new_tokens, "--seed": seed,
            "temperatures": list(ANSWER_TEMPERATURES)}


def teacher_settings(max_tokens: int, template: str) -> dict:
    return {"--max-tokens": max_tokens, "chat template": template}


def magpie_stage(work: str, fp: str, decoder, tok, count: int, batch_size: int, seed: int,
                 log) -> list[str]:
    """`count` Magpie user turns asked for (fewer come back: cut-off ones are dropped)."""
    from s2d_jax.data.magpie import sample_user_turns
    batches = [min(batch_size, count - b) for b in range(0, count, batch_size)]

    def work_fn(sizes, k):
        turns = sample_user_turns(decoder, tok, sizes[0], batch_size=sizes[0],
                                  seed=seed + 1000 * k, log=lambda m: None)
        return [{"prompt": t} for t in turns]

    shards.run_stage(os.path.join(work, "magpie"), "magpie", fp, batches, 1, work_fn,
                     tokens=lambda r: 0, log=log, settings=magpie_settings(batch_size, seed))
    return [r["prompt"] for r in shards.read_rows(os.path.join(work, "magpie"))]


def prompts_stage(work: str, fp: str, files, generated, eval_files, log) -> list[str]:
    """The cleaned prompt pool, stored (which prompts) with its counts."""
    from s2d_jax.data.prompt_pool import prompt_pool
    rows, counts = prompt_pool(files, generated, eval_files)
    log(f"[prompts] {counts}")
    shards.run_stage(os.path.join(work, "prompts"), "prompts", fp, rows, 4096,
                     lambda items, k: items, log=log)
    return [r["prompt"] for r in shards.read_rows(os.path.join(work, "prompts"))]


def chosen_prompts(pool: list[str], count: int, batch_size: int, seed: int) -> list[str]:
    """`count` prompts (0 = all) of a seeded draw, in batches of similar length (a batch
    pads little) taken in a seeded random order: the first shards of a long run are
    already a fair sample of every length."""
    rng = np.random.default_rng(seed)
    picks = rng.permutation(len(pool))[:count or len(pool)]
    by_length = sorted((pool[i] for i in picks), key=len)
    batches = [by_length[k:k + batch_size] for k in range(0, len(by_length), batch_size)]
    return [p for b in rng.permutation(len(batches)) for p in batches[b]]


def answer_shard(decoder, tok, batch: list[str], k: int, seed: int, max_new_tokens: int
                 ) -> list[dict]:
    """Shard k's rows: the target's answers to `batch` at every temperature, seed
    seed + len(temperatures) * k + j (a shard depends only on its prompts and k)."""
    from s2d_jax.data.distill import answer_rows
    return [row for j, t in enumerate(ANSWER_TEMPERATURES)
            for row in answer_rows(decoder, tok, batch, temperature=t,
                                   seed=seed + len(ANSWER_TEMPERATURES) * k + j,
                                   max_new_tokens=max_new_tokens)]


def answers_stage(work: str, fp: str, decoder, tok, prompts: list[str], batch_size: int,
                  max_new_tokens: int, seed: int, log) -> list[dict]:
    """The target's answers, one shard per batch of prompts, each at every temperature."""
    def work_fn(batch, k):
        return answer_shard(decoder, tok, batch, k, seed, max_new_tokens)

    out = os.path.join(work, "answers")
    shards.run_stage(out, "answers", fp, prompts, batch_size, work_fn,
                     tokens=lambda r: len(r["input_ids"]) - r["learn_from"], log=log,
                     settings=answers_settings(max_new_tokens, seed))
    return shards.read_rows(out)


def reference_items(path: str, prompts: list[str], count: int, banned: set) -> list[dict]:
    """Up to `count` GSM8K reference solutions whose question is a kept training prompt and
    whose solution shares no n-gram with the evaluation sets."""
    from s2d_jax.data.distill import _jsonl
    from s2d_jax.data.overlap import overlaps
    kept = set(prompts)
    out = [{"kind": "reference", "prompt": r["question"].strip(),
            "answer": _CALC.sub("", r["answer"]).strip()}
           for r in _jsonl(path) if r.get("question", "").strip() in kept
           and not overlaps(r.get("answer", ""), banned)]
    return out[:count]


def supervision_items(answers: list[dict], references: list[dict], documents: list[dict]
                      ) -> list[dict]:
    """What the teacher stage reads: answer token rows as they are, texts to tokenize."""
    return ([{"kind": "answer", "input_ids": r["input_ids"], "learn_from": r["learn_from"]}
             for r in answers] + references
            + [{"kind": "document", "text": d["text"]} for d in documents])


def token_rows(item: dict, tok, template: str, max_tokens: int) -> list[dict]:
    """An item's token rows {"input_ids", "learn_from", "kind"}: a reference solution after
    its prompt in the chat template (loss on the solution), a document in windows of
    max_tokens (loss on all of it), an answer row as it is."""
    from s2d_jax.data.prompts import end_of_turn_id, prompt_ids
    kind = item["kind"]
    if kind == "answer":
        return [{"input_ids": item["input_ids"][:max_tokens],
                 "learn_from": item["learn_from"], "kind": kind}]
    if kind == "reference":
        prompt = prompt_ids(tok, template, [item["prompt"]])
        ids = prompt + tok.encode(item["answer"], bos=False) + [end_of_turn_id(tok, template)]
        return [{"input_ids": ids[:max_tokens], "learn_from": len(prompt), "kind": kind}]
    ids = tok.encode(item["text"], bos=True)
    return [{"input_ids": ids[s:s + max_tokens], "learn_from": 0, "kind": kind}
            for s in range(0, max(len(ids) - 1, 1), max_tokens - 1)]


def teacher_stage(work: str, fp: str, items: list[dict], tok, template: str, states,
                  max_tokens: int, shard_size: int, log) -> str:
    """Token rows of every item with the target's states at their input positions."""

    def work_fn(batch, k):
        rows = [r for item in batch for r in token_rows(item, tok, template, max_tokens)
                if len(r["input_ids"]) >= 2 and r["learn_from"] < len(r["input_ids"])]
        return rows, {"states": states([r["input_ids"] for r in rows])}

    out = os.path.join(work, "teacher")
    shards.run_stage(out, "teacher", fp, items, shard_size, work_fn,
                     tokens=lambda r: len(r["input_ids"]) - max(r["learn_from"], 1), log=log,
                     settings=teacher_settings(max_tokens, template))
    return out


def training_set(work: str, fp: str, teacher_dir: str, log) -> tuple[str, str]:
    """(rows.jsonl, teacher-states dir) joined from the teacher shards: data.paths and
    data.teacher of the training run. Rewritten only when the shards changed."""
    from s2d_jax.data.teacher import join_states
    from s2d_jax.io.atomic import write_atomic
    out = os.path.join(work, "train")
    os.makedirs(out, exist_ok=True)
    rows_path = os.path.join(out, "rows.jsonl")
    data = "".join(json.dumps(r, sort_keys=True) + "\n"
                   for r in shards.read_rows(teacher_dir)).encode()
    if not os.path.isfile(rows_path) or open(rows_path, "rb").read() != data:
        write_atomic(rows_path, data)
    states = join_states(shards.array_paths(teacher_dir, "states"), rows_path,
                         os.path.join(out, "teacher"), fp, log=log)
    return rows_path, states
