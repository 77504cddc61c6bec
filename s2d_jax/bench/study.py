"""The data-scaling study (issue 34 item 5): for every (shape, kind, budget) point, a draft
trained with one fixed recipe on exactly `budget` unique supervised tokens of that kind
(data/study_data.py), its held-out greedy agreement per exit (bench/agreement.py, as
python -m infer.agreement), one points.jsonl row per exit and the report (scaling.py).

Under OUT:
    data/KIND-BUDGET/   rows.jsonl (the slice; shared by every shape) + teacher/ (the
                        target's states of those rows, with draft.kd_weight > 0)
    points/NAME/        ckpt/ (training resumes from it), metrics.jsonl, draft_hf/,
                        result.json (written last: the point is finished)
    head_vocab.json     the draft head's sub-vocabulary, one for the whole study
    heldout_answers.json  the target's greedy held-out answers, generated once
    points.jsonl        {shape, kind, tokens, exit, agreement, se, point, prompt_hits,
                        prompt_tokens}: one row per exit (per-prompt hits: paired fits)
    report/             table.md, fits.json, scaling.png

Rows are cut to the recipe's data.seq_len + 1 tokens before counting (the trainer keeps no
more of a row), so a point's tokens are the ones it trains on.

Steps per point: `epochs` passes over the slice's packed tokens (prompt tokens included,
as the packed batches hold them), clamped to [min_steps, max_steps], so every point sees
its data about equally often while the smallest still trains and the largest ends.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import write_atomic


@dataclasses.dataclass(frozen=True)
class StudyPoint:
    shape: int              # draft depth: the target's first `shape` layers
    exits: tuple[int, ...]
    kind: str               # study_data.KINDS
    budget: int             # unique supervised tokens

    @property
    def name(self) -> str:
        return f"{self.shape}L-{self.kind}-{self.budget}"


@dataclasses.dataclass
class Study:
    engine: str             # the data engine's work dir (read only)
    target: str
    out: str
    config: str             # the training recipe, the same for every point
    overrides: tuple = ()
    heldout: str = "data/smollm2_calibration.jsonl"
    heldout_prompts: int = 40
    documents: tuple = ()
    row_tokens: int = 257   # the recipe's data.seq_len + 1: the trainer cuts longer rows
    head_vocab: int = 4096
    epochs: float = 3.0
    min_steps: int = 100
    max_steps: int = 4000
    levels: tuple = (0.35, 0.45)


def steps_for(row_tokens: int, batch_size: int, seq_len: int, epochs: float,
              min_steps: int, max_steps: int) -> int:
    """Training steps for a slice of `row_tokens` tokens (packed rows)."""
    return min(max_steps, max(min_steps, math.ceil(epochs * row_tokens / (batch_size * seq_len))))


def exits_for(shape: int, step: int) -> tuple[int, ...]:
    """Every `step`-th layer up to `shape`, and `shape` itself (the draft's depth)."""
    return tuple(sorted({*range(step, shape + 1, step), shape}))


def _write_jsonl(path: str, rows) -> None:
    write_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def read_jsonl(path: str, what: str = "rows file") -> list[dict]:
    """The JSON-object rows of `path` ([] when it does not exist yet); a cut or hand-edited
    line is one S2DError naming the file and line, not a JSONDecodeError traceback."""
    from s2d_jax.readers import parse_json, read_text
    if not os.path.isfile(path):
        return []
    rows = []
    for n, line in enumerate(read_text(path, what).splitlines(), 1):
        if line.strip():
            row = parse_json(line, path, what, n)
            if not isinstance(row, dict):
                raise S2DError(f"{what} {path}:{n} is not a JSON object; fix or delete the "
                               f"line")
            rows.append(row)
    return rows


class Sources:
    """The study's row sources, read from the engine (the text rows built once per run)."""

    def __init__(self, study: Study, eval_files):
        self.study, self.eval_files, self._text = study, eval_files, None

    def rows(self, kind: str):
        from s2d_jax.data import study_data
        limit = self.study.row_tokens  # only what the trainer sees counts
        if kind == "on_policy":
            return ({**r, "input_ids": r["input_ids"][:limit]}
                    for r in study_data.answer_rows(self.study.engine))
        if self._text is None:
            from s2d_jax.data.prompts import resolve_template
            from s2d_jax.io.tokenizer import load_tokenizer
            tok = load_tokenizer(self.study.target)
            template, _ = resolve_template(tok, "auto")
            self._text = study_data.text_rows(self.study.engine, tok, template,
                                              self.study.documents, self.eval_files,
                                              limit)
        return iter(self._text)


def point_data(study: Study, sources: Sources, kind: str, budget: int, log) -> str | None:
    """OUT/data/KIND-BUDGET/rows.jsonl (written once), or None (with a message) while the
    engine holds fewer than `budget` tokens of that kind."""
    from s2d_jax.data.study_data import take_budget
    path = os.path.join(study.out, "data", f"{kind}-{budget}", "rows.jsonl")
    if os.path.isfile(path):
        return path
    rows, seen = take_budget(sources.rows(kind), budget)
    if not rows:
        log(f"[study] {kind} {budget} tokens: skipped, " + (
            f"the engine holds {seen} {kind} tokens so far; rerun once it has more"
            if kind == "on_policy" else f"the text sources hold {seen} tokens (fixed: "
            f"add --documents for more)"))
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _write_jsonl(path, rows)
    return path


def head_vocab(study: Study, sources: Sources, budget: int, vocab_size: int) -> str | None:
    """OUT/head_vocab.json, written once: the most frequent tokens of the engine's first
    `budget` answer tokens (all of them when it has fewer), for every point alike."""
    from s2d_jax.data.distill import frequent_tokens
    from s2d_jax.data.study_data import take_budget
    if not study.head_vocab:
        return None
    path = os.path.join(study.out, "head_vocab.json")
    if not os.path.isfile(path):
        rows, _ = take_budget(sources.rows("on_policy"), budget)
        rows = rows or list(sources.rows("on_policy"))
        if not rows:
            raise S2DError(f"{study.engine} holds no answers yet (the head vocabulary comes "
                           f"from them); rerun once its answers stage has written a shard")
        source = path + ".rows.jsonl"
        _write_jsonl(source, rows)
        write_atomic(path, json.dumps(frequent_tokens(source, study.head_vocab, vocab_size)))
        os.remove(source)
    return path


def recipe(study: Study, point: StudyPoint, rows: str, teacher: str | None, head: str | None,
           steps: int):
    """The training config of one point: the study's recipe, its data, exits, outputs."""
    from s2d_jax.train.config import load_train_config
    run = os.path.abspath(os.path.join(study.out, "points", point.name))
    over = [f"model.path={study.target}", f"data.tokenizer={study.target}",
            f"data.paths=[{rows}]", "data.format=tokens", "data.num_epochs=0",
            f"draft.exits=[{','.join(map(str, point.exits))}]",
            f"optimizer.total_steps={steps}", f"checkpoint.dir={os.path.join(run, 'ckpt')}",
            f"metrics_path={os.path.join(run, 'metrics.jsonl')}",
            f"export_dir={os.path.join(run, 'draft_hf')}", "export_overwrite=true",
            *([f"data.teacher={teacher}"] if teacher else []),
            *([f"draft.head_vocab={head}"] if head else []), *study.overrides]
    return load_train_config(study.config, over)


def smaller_slice(study: Study, rows: str) -> tuple[str, str] | None:
    """(rows, teacher states) of the largest smaller slice of the same kind whose states
    are written: its rows lead this slice's (study_data.take_budget), so their states
    are copied instead of computed again."""
    data = os.path.dirname(os.path.dirname(rows))
    kind, budget = os.path.basename(os.path.dirname(rows)).rsplit("-", 1)
    best = None
    for name in os.listdir(data):
        k, _, b = name.rpartition("-")
        teacher = os.path.join(data, name, "teacher")
        if (k == kind and b.isdigit() and int(b) < int(budget)
                and os.path.isfile(os.path.join(teacher, "teacher_states.json"))
                and (best is None or int(b) > best[0])):
            best = (int(b), os.path.join(data, name, "rows.jsonl"), teacher)
    return best and best[1:]


def train_point(study: Study, point: StudyPoint, rows: str, head: str | None, log) -> str:
    """Train (or resume) one point's draft; -> its exported HF dir."""
    from s2d_jax.data.teacher import write_teacher_states
    from s2d_jax.train import loop
    base = recipe(study, point, rows, None, head, 1)
    teacher = None
    if base.draft.kd_weight > 0:  # the target's distribution: its states at every row position
        teacher = write_teacher_states(study.target, rows, os.path.join(
            os.path.dirname(rows), "teacher"), reuse=smaller_slice(study, rows), log=log)
    row_tokens = sum(len(r["input_ids"]) for r in read_jsonl(rows))
    steps = steps_for(row_tokens, base.data.batch_size, base.data.seq_len, study.epochs,
                      study.min_steps, study.max_steps)
    tc = recipe(study, point, rows, teacher, head, steps)
    log(f"[study] {point.name}: {steps} steps over {row_tokens} row tokens")
    result = loop.train(tc, progress=False)
    log(f"[study] {point.name}: trained from step {result['start_step']} to {steps}")
    return tc.export_dir


def record(study: Study, point: StudyPoint, exits: list[dict]) -> None:
    """result.json, then the point's rows in points.jsonl exactly once (a rerun after a
    kill between the two adds them; rows already there are not added again)."""
    rows = [{"shape": f"{point.shape} layers", "kind": point.kind, "tokens": point.budget,
             "exit": r["exit"], "agreement": r["agreement"], "se": r["agreement_se"],
             "point": point.name, "prompt_hits": r.get("prompt_hits", []),
             "prompt_tokens": r.get("prompt_tokens", [])} for r in exits]
    if not rows[0]["prompt_hits"]:  # measured before per-prompt hits were kept
        rows = [{k: v for k, v in r.items() if not k.startswith("prompt_")} for r in rows]
    result = os.path.join(study.out, "points", point.name, "result.json")
    if not os.path.isfile(result):
        write_atomic(result, json.dumps({"point": point.name, "heldout": study.heldout,
                                         "exits": exits}, indent=1))
    path = os.path.join(study.out, "points.jsonl")
    have = read_jsonl(path, "points file")
    if [r for r in have if r.get("point") == point.name] != rows:  # new, or re-measured
        _write_jsonl(path, [r for r in have if r.get("point") != point.name] + rows)


def measure(study: Study, draft_hf: str) -> list[dict]:
    from s2d_jax.bench.agreement import measure_agreement
    got = measure_agreement(study.target, [draft_hf], study.heldout, study.heldout_prompts,
                            answers_cache=os.path.join(study.out, "heldout_answers.json"))
    return got["drafts"][draft_hf]


def run_point(study: Study, sources: Sources, point: StudyPoint, head: str | None,
              log) -> bool:
    """One point to the end (or skipped while its data is missing); -> whether finished."""
    from s2d_jax.readers import read_json
    result = os.path.join(study.out, "points", point.name, "result.json")
    if os.path.isfile(result):
        exits = read_json(result, "study result")["exits"]
        draft_hf = os.path.join(study.out, "points", point.name, "draft_hf")
        if "prompt_hits" not in exits[0] and os.path.isdir(draft_hf):
            # measured before per-prompt hits were kept: score the trained draft again
            exits = measure(study, draft_hf)
            write_atomic(result, json.dumps({"point": point.name, "heldout": study.heldout,
                                             "exits": exits}, indent=1))
            log(f"[study] {point.name}: measured again for its per-prompt hits")
        record(study, point, exits)
        log(f"[study] {point.name}: finished ({result}); skipping")
        return True
    rows = point_data(study, sources, point.kind, point.budget, log)
    if rows is None:
        return False
    exits = measure(study, train_point(study, point, rows, head, log))
    record(study, point, exits)
    log(f"[study] {point.name}: " + ", ".join(
        f"exit {r['exit']} {r['agreement']:.3f} ({r['agreement_se']:.3f})" for r in exits))
    return True


def run_study(study: Study, points: list[StudyPoint], eval_files, log) -> list[str]:
    """Every point in order, then the report; -> the points still waiting for data (the
    engine's answers grow while it runs; the text sources do not)."""
    from s2d_jax.bench.scaling import read_points, write_report
    from s2d_jax.config import read_hf_config
    sources = Sources(study, eval_files)
    vocab = read_hf_config(os.path.join(study.target, "config.json")).vocab_size
    head = head_vocab(study, sources, min(p.budget for p in points), vocab)
    waiting = [p.name for p in points if not run_point(study, sources, p, head, log)
               and p.kind == "on_policy"]
    path = os.path.join(study.out, "points.jsonl")
    if os.path.isfile(path):
        _, wrote = write_report(read_points(path), os.path.join(study.out, "report"),
                                study.levels)
        log(f"[study] {wrote}")
    return waiting
