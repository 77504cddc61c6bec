"""Self-distillation data: a target's own answers to training prompts, as token ids.

Speculative decoding accepts a drafted token when it is the *target's* token, so a draft
trained on the target's outputs (sequence-level distillation: DistillSpec, Medusa-2) learns
what it will be asked to predict. Each prompt is answered greedily and at T = 1 (the two
modes the benchmark measures) by this project's engine, and a row keeps the exact ids the
target saw and produced (`input_ids`, loss from `learn_from`), so no decode/re-encode
round trip changes them. Rows are appended batch by batch: a rerun resumes after the last
complete batch.

Training prompts never come from Spec-Bench, MT-bench or GSM8K test: `training_prompts`
reads GSM8K *train*, self-instruct tasks and ShareGPT conversations.
"""

from __future__ import annotations

import json
import os

import numpy as np

from s2d_jax.errors import S2DError
from s2d_jax.readers import read_text


def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):  # a directory or /dev/null: read_text says what it is
        raise S2DError(f"prompt file {path} does not exist; check the path")
    rows = []
    for n, line in enumerate(read_text(path, "prompt file").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise S2DError(f"{path}:{n} is not valid JSON ({e.msg}); fix the line") from e
    return rows


def _text(row, key: str, where: str) -> str:
    """row[key] as stripped text, or one error naming the line and the key."""
    value = row.get(key) if isinstance(row, dict) else None
    if not isinstance(value, str):
        raise S2DError(f"{where} has no text {key!r} (every row of this file needs one, as "
                       f"its first row has); fix the row or remove it")
    return value.strip()


def _self_instruct(row: dict, where: str) -> str:
    """The instruction, with its first instance's input when it has one."""
    instances = row.get("instances") or [{}]
    first = instances[0] if isinstance(instances, list) and instances else {}
    inst = first.get("input", "") if isinstance(first, dict) else ""
    inst = inst.strip() if isinstance(inst, str) else ""
    return _text(row, "instruction", where) + (f"\n\n{inst}" if inst else "")


def prompts_from_file(path: str) -> list[str]:
    """Training prompts of one file, by its kind: GSM8K (`question`), self-instruct
    (`instruction` + first instance input), ShareGPT (every human turn that opens a
    conversation). The kind is read from the first row; a later row without its field is
    one error naming the line."""
    if path.endswith(".json"):
        from s2d_jax.data.sources import load_records
        out = []
        for n, row in enumerate(load_records(path)):
            turns = row.get("conversations") if isinstance(row, dict) else None
            first = turns[0] if isinstance(turns, list) and turns else None
            if isinstance(first, dict) and first.get("from") == "human":
                out.append(_text(first, "value", f"{path} conversation {n}"))
        return out
    rows = _jsonl(path)
    first = rows[0] if rows and isinstance(rows[0], dict) else {}
    if "question" in first:
        return [_text(r, "question", f"{path}:{n}") for n, r in enumerate(rows, 1)]
    if "instruction" in first:
        return [_self_instruct(r if isinstance(r, dict) else {}, f"{path}:{n}")
                for n, r in enumerate(rows, 1)]
    raise S2DError(f"{path} has neither 'question' (GSM8K) nor 'instruction' (self-instruct) "
                   f"rows nor ShareGPT conversations; give a file of one of those kinds")


def training_prompts(quota: dict[str, int], seed: int = 0, max_chars: int = 1500) -> list[str]:
    """{path: how many (0 = all)} -> distinct prompts (seeded draw per file, shuffled).

    Prompts longer than max_chars are dropped: the draft learns from answers, and a long
    prompt only pads the batch."""
    rng = np.random.default_rng(seed)
    out, seen = [], set()
    for path, n in quota.items():
        pool = [p for p in dict.fromkeys(prompts_from_file(path)) if p and len(p) <= max_chars
                and p not in seen]
        picks = rng.permutation(len(pool))[:n or len(pool)]
        chosen = [pool[i] for i in sorted(picks.tolist())]
        seen.update(chosen)
        out += chosen
    return [out[i] for i in rng.permutation(len(out))]


def _prompts_hash(prompts: list[str]) -> str:
    import hashlib
    return hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest()


def _check_plan(out_path: str, done: int, plan: dict) -> None:
    """Rows already in out_path came from this plan (out_path + ".plan.json", written when
    the first rows are): appending answers of another length, temperature or prompt set
    would mix them silently."""
    from s2d_jax.io.atomic import write_atomic
    from s2d_jax.readers import read_json
    path = out_path + ".plan.json"
    if done:
        old = read_json(path, "answers plan") if os.path.exists(path) else None
        if not isinstance(old, dict):
            raise S2DError(f"{out_path} has {done} rows but no readable {path} saying how they "
                           f"were made; delete it to start over")
        for key in plan:
            if old.get(key) != plan[key]:
                raise S2DError(f"{out_path} was written with {key} {old.get(key)}, this run asks "
                               f"for {plan[key]}; rerun with the settings it was written with, "
                               f"or delete it to start over")
    else:
        write_atomic(path, json.dumps(plan, indent=1) + "\n")


def _done_rows(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def answer_rows(decoder, tok, prompts: list[str], *, temperature: float, seed: int,
                max_new_tokens: int = 192, template: str = "auto") -> list[dict]:
    """One batch of the target's answers: rows {"input_ids" (prompt + answer, exactly as
    the target saw and produced them), "learn_from", "temperature", "prompt"}. `template`
    as prompts.resolve_template: auto without a chat template renders the prompts as none."""
    from s2d_jax.data.prompts import end_of_turn_id, prompt_ids, resolve_template

    template, _ = resolve_template(tok, template)
    ids = [prompt_ids(tok, template, [p]) for p in prompts]
    res = decoder.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                           seed=seed, eos_id=end_of_turn_id(tok, template))
    return [{"input_ids": i + r["token_ids"], "learn_from": len(i), "temperature": temperature,
             "prompt": p} for p, i, r in zip(prompts, ids, res)]


def generate_answers(decoder, tok, prompts: list[str], out_path: str, *,
                     max_new_tokens: int = 192, temperatures=(0.0, 1.0), batch_size: int = 32,
                     max_batches: int | None = None, seed: int = 0, log=print) -> dict:
    """Append one row per (temperature, prompt) to out_path (`answer_rows`); resumes after
    the rows already there. Prompts are batched by length (less padding); max_batches
    caps the batches (each answered at every temperature), taken in a seeded random order."""
    from s2d_jax.data.prompts import prompt_ids

    ids = [prompt_ids(tok, "auto", [p]) for p in prompts]
    order = np.argsort([len(i) for i in ids], kind="stable")
    batches = [[int(i) for i in order[k:k + batch_size]] for k in range(0, len(order), batch_size)]
    # batches of similar lengths, in a seeded random order, each at every temperature: a
    # run stopped early still covers both modes and all prompt lengths
    picks = np.random.default_rng(seed).permutation(len(batches))
    jobs = [(t, batches[b]) for b in picks[:max_batches] for t in temperatures]
    done = _done_rows(out_path)
    _check_plan(out_path, done, {"--max-new-tokens": max_new_tokens,
                                 "temperatures": [float(t) for t in temperatures],
                                 "batch size": batch_size, "batches": max_batches,
                                 "seed": seed, "prompts_sha256": _prompts_hash(prompts)})
    ends = np.cumsum([len(r) for _, r in jobs]).tolist()
    if done and done not in ends:
        raise S2DError(f"{out_path} has {done} rows, which does not end a batch of this run; "
                       f"delete it or rerun with the settings it was written with")
    skip = ends.index(done) + 1 if done else 0
    tokens = 0
    with open(out_path, "a", encoding="utf-8") as f:
        for j, (t, rows) in enumerate(jobs):
            if j < skip:
                continue
            out = answer_rows(decoder, tok, [prompts[i] for i in rows], temperature=t,
                              seed=seed + j, max_new_tokens=max_new_tokens)
            # one write per batch: an interrupted run leaves whole batches
            f.write("".join(json.dumps(r) + "\n" for r in out))
            f.flush()
            tokens += sum(len(r["input_ids"]) - r["learn_from"] for r in out)
            log(f"[distill] batch {j + 1}/{len(jobs)} (T = {t:g}): {tokens} answer tokens")
    return {"rows": sum(len(r) for _, r in jobs), "resumed_after": done,
            "new_answer_tokens": tokens}


def frequent_tokens(rows, size: int, vocab_size: int) -> list[int]:
    """A sub-vocabulary of `size` ids for a draft's head: the target's answer tokens in
    `rows` (a token-rows .jsonl path, or the rows) by decreasing frequency, then (to cover
    text the answers never showed) the lowest remaining ids, which a BPE vocabulary assigns
    to its earliest, most frequent merges. Sorted."""
    from s2d_jax.data.sources import load_token_rows

    if not 0 < size <= vocab_size:
        raise S2DError(f"sub-vocabulary size {size} must lie in [1, {vocab_size}]")
    counts = np.zeros(vocab_size, np.int64)
    for row in load_token_rows(rows, vocab_size) if isinstance(rows, str) else rows:
        np.add.at(counts, np.asarray(row["input_ids"][row["learn_from"]:], np.int64), 1)
    seen = np.flatnonzero(counts)
    by_freq = seen[np.argsort(-counts[seen], kind="stable")][:size].tolist()
    chosen = set(by_freq)
    fill = [i for i in range(vocab_size) if i not in chosen][:size - len(by_freq)]
    return sorted(by_freq + fill)
