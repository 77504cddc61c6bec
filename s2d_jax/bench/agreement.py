"""How often each exit of one or more sorted drafts agrees with its target, teacher-forced.

The target answers the prompts greedily; every draft then reads the same answers and
predicts each next token at each of its exits. Per draft and exit: the share of answer
tokens whose greedy prediction is the target's (greedy SD at gamma 1 accepts 1 + that
many tokens per round, Lemma 3.1), the mean chance that speculative sampling at T = 1
accepts the exit's draft there (sum_v min(p, q), on the same greedy contexts), how often
the exit's confidence reaches 0.5, each deeper exit's agreement gain over the one before
it, paired on the same tokens with its standard error, the exit's greedy MAT at gamma 1-4
replayed along the answers, and escalation's ceiling (escalation.py).

Memory does not grow with the number of prompts: the target answers in batches of at most
`batch_slots` cache slots (long Spec-Bench prompts one batch of their own), and each prompt
is then scored on its own, with the target's and the exits' distributions computed only at
its answer positions (the vocabulary-wide rows are most of a teacher-forced pass's memory).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.bench.escalation import GAMMAS, escalation_bound, greedy_mats
from s2d_jax.bench.exit_stats import ExitStats, token_mean
from s2d_jax.decode.defaults import buffer_len, prompt_width, round_up
from s2d_jax.errors import S2DError

# Rows x cache slots of one generation batch: SmolLM2-135M's float32 cache takes 46 kB per
# slot (0.75 GB here) and the prefill's attention scores about as much again.
BATCH_SLOTS = 16384


@dataclasses.dataclass
class Draft:
    """One draft to score: its name (as reported), config, params and exits."""

    name: str
    cfg: object
    params: dict
    exits: tuple


def answer_batches(prompts, max_new_tokens: int, context: int, batch_slots: int) -> list[list[int]]:
    """Prompt indices grouped into generation batches: all at once where their buffers fit
    `batch_slots` (then the batch is the one a single call would run), else by length, so
    that a long prompt does not pad every short one to its width."""
    def slots(idx):
        width = prompt_width(max(len(prompts[i]) for i in idx))
        return len(idx) * buffer_len(width, max_new_tokens, 1, context)

    everything = list(range(len(prompts)))
    if slots(everything) <= batch_slots:
        return [everything]
    batches, current = [], []
    for i in sorted(everything, key=lambda i: len(prompts[i])):
        if current and slots(current + [i]) > batch_slots:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current]


def target_answers(cfg, params, prompts, max_new_tokens: int, eos_id: int,
                   batch_slots: int = BATCH_SLOTS) -> list[list[int]]:
    """The target's greedy answers (token ids) to the prompts, in the prompts' order."""
    from s2d_jax.decode.serving import Decoder
    decoder = Decoder(cfg, params, method="ar")
    context = cfg.max_position_embeddings
    answers = [None] * len(prompts)
    for idx in answer_batches(prompts, max_new_tokens, context, batch_slots):
        batch = [prompts[i] for i in idx]
        max_len = buffer_len(prompt_width(max(len(p) for p in batch)), max_new_tokens, 1,
                             context)
        out = decoder.generate(batch, max_new_tokens=max_new_tokens, eos_id=eos_id,
                               max_len=max_len)
        for i, a in zip(idx, out):
            answers[i] = list(a["token_ids"])
    return answers


def _padded(seq, rows: int):
    """seq padded to a multiple of 64 with room for `rows` positions after the prompt
    (causal: padding changes no earlier position): a few compilations, not one per
    length."""
    arr = np.zeros((1, round_up(len(seq) + rows, 64)), np.int32)
    arr[0, :len(seq)] = seq
    return jnp.asarray(arr)


def _answer_rows(h, start, rows: int):
    """Hidden states [rows, D] at positions start .. start + rows - 1 of h [1, T, D]."""
    return jax.lax.dynamic_slice_in_dim(h[0], start, rows)


@functools.partial(jax.jit, static_argnames=("cfg", "rows"))
def target_answer_probs(params, tokens, start, *, cfg, rows):
    """The target's next-token distributions [rows, V] at positions start .. start + rows
    - 1 only: the head and softmax never run over the prompt."""
    from s2d_jax.model import transformer as model
    from s2d_jax.model.sorted_draft import multi_exit_hidden
    (h,) = multi_exit_hidden(params, cfg, (cfg.num_layers,), tokens)
    return jax.nn.softmax(model.lm_logits(params, cfg, _answer_rows(h, start, rows)), -1)


@functools.partial(jax.jit, static_argnames=("cfg", "exits"))
def exit_answer_stats(params, tokens, start, p, *, cfg, exits):
    """Per answer position [rows] and exit [m], at the rows of p [rows, V] (the target's
    distributions there): the exit's greedy token, its confidence (max prob) and
    sum_v min(p_v, q_v), the chance that speculative sampling at T = 1 accepts a token the
    exit drafts there."""
    from s2d_jax.model import transformer as model
    from s2d_jax.model.sorted_draft import multi_exit_hidden
    ids, conf, overlap = [], [], []
    for h in multi_exit_hidden(params, cfg, exits, tokens):
        logits = model.lm_logits(params, cfg, _answer_rows(h, start, p.shape[0]))
        q = jax.nn.softmax(logits, -1)
        ids.append(jnp.argmax(logits, -1))
        conf.append(jnp.max(q, -1))
        overlap.append(jnp.sum(jnp.minimum(p, q), -1))
    return jnp.stack(ids, -1), jnp.stack(conf, -1), jnp.stack(overlap, -1)


def score_drafts(cfg, params, drafts: list[Draft], prompts, answers, rows: int
                 ) -> list[tuple[ExitStats, np.ndarray]]:
    """Per draft: its ExitStats along the answers (row k of a prompt: the guess for answer
    token k + 1; token 0 comes from the target's prefill) and the mean T = 1 acceptance
    chance per exit. One prompt at a time: the target's distributions at its answer
    positions [rows >= longest answer, V] are computed once, used by every draft and
    dropped."""
    if any(len(a) > rows for a in answers):
        raise S2DError(f"an answer is longer than the {rows} rows scored; pass rows >= the "
                       f"longest answer")
    correct = [[] for _ in drafts]
    conf = [[] for _ in drafts]
    accept = [[] for _ in drafts]
    for prompt, answer in zip(prompts, answers):
        tokens = _padded(list(prompt) + list(answer), rows)
        p = target_answer_probs(params, tokens, len(prompt), cfg=cfg, rows=rows)
        truth = np.asarray(answer[1:])[:, None]
        for k, d in enumerate(drafts):
            d_cfg = dataclasses.replace(d.cfg, num_layers=d.exits[-1])
            ids, cf, ov = jax.device_get(exit_answer_stats(
                d.params, tokens, len(prompt), p, cfg=d_cfg, exits=tuple(d.exits)))
            n = len(answer) - 1
            correct[k].append(ids[:n] == truth)
            conf[k].append(cf[:n])
            accept[k].append(ov[:n])
    return [(ExitStats(tuple(d.exits), correct[k], conf[k]), np.concatenate(accept[k]).mean(0))
            for k, d in enumerate(drafts)]


def paired_gain(stats: ExitStats, j: int, i: int | None = None) -> tuple[float, float]:
    """Exit j's greedy agreement minus exit i's (default j - 1) on the same tokens, and its
    standard error clustered by prompt (tokens of one answer are not independent)."""
    i = j - 1 if i is None else i
    return token_mean([c[:, j].astype(np.float64) - c[:, i] for c in stats.correct])


def agreement_se(stats: ExitStats, j: int) -> float:
    """Standard error of exit j's greedy agreement, clustered by prompt (as paired_gain)."""
    return token_mean([x[:, j].astype(np.float64) for x in stats.correct])[1]


def measurable_exits(rows: list[dict], z: float = 2.0) -> list[int]:
    """The exits from the first up to (not past) the first one whose paired agreement gain
    over the exit before it is not at least z standard errors above zero: each kept exit
    is accepted measurably more often than the cheaper one before it."""
    kept = [rows[0]["exit"]]
    for r in rows[1:]:
        if not r["gain_over_previous"] > z * r["gain_se"]:
            break
        kept.append(r["exit"])
    return kept


def exit_agreement(stats: ExitStats, accept_t1=None) -> list[dict]:
    """Per exit: greedy agreement and confidence over answer tokens (and the T = 1
    acceptance chance, when given), each deeper exit with its paired gain."""
    correct = np.concatenate(stats.correct)
    conf = np.concatenate(stats.conf)
    rows = [{"exit": int(e), "tokens": int(correct.shape[0]),
             "agreement": float(correct[:, j].mean()), "agreement_se": agreement_se(stats, j),
             "accept_t1": None if accept_t1 is None else float(accept_t1[j]),
             "confident": float((conf[:, j] >= 0.5).mean()),
             "agreement_when_confident": (float(correct[conf[:, j] >= 0.5, j].mean())
                                          if (conf[:, j] >= 0.5).any() else None),
             # per prompt: drafts scored on the same answers can be compared paired
             "prompt_hits": [int(c[:, j].sum()) for c in stats.correct],
             "prompt_tokens": [int(c.shape[0]) for c in stats.correct],
             "greedy_mat": dict(zip(map(str, GAMMAS), greedy_mats(stats, j)))}
            for j, e in enumerate(stats.exits)]
    for j in range(1, len(rows)):
        rows[j]["gain_over_previous"], rows[j]["gain_se"] = paired_gain(stats, j)
    if len(rows) > 2:  # what escalating from the cheapest exit to the deepest can buy
        rows[-1]["gain_over_first"], rows[-1]["gain_over_first_se"] = paired_gain(
            stats, len(rows) - 1, 0)
    if len(rows) > 1:
        rows[-1].update(escalation_bound(stats))
    return rows


def summary_lines(name: str, rows: list[dict]) -> list[str]:
    """The printed summary of one draft's exits."""
    lines = [f"{name}: " + ", ".join(
        f"exit {r['exit']} {r['agreement']:.3f} (T = 1: {r['accept_t1']:.3f}; "
        f"conf >= 0.5 on {r['confident']:.2f})" for r in rows)
        + f"  [{rows[0]['tokens']} answer tokens]"]
    if len(rows) > 1:
        lines.append("  deeper exit minus the one before, paired (s.e. by prompt): " + ", ".join(
            f"{r['exit']} - {q['exit']}: {r['gain_over_previous']:+.3f} "
            f"({r['gain_se']:.3f})" for q, r in zip(rows, rows[1:])))
    if "gain_over_first" in rows[-1]:
        lines.append(f"  deepest minus shallowest, paired: {rows[-1]['exit']} - "
                     f"{rows[0]['exit']}: {rows[-1]['gain_over_first']:+.3f} "
                     f"({rows[-1]['gain_over_first_se']:.3f})")
    gammas = " / ".join(rows[0]["greedy_mat"])
    lines.append(f"  greedy MAT at gamma {gammas} (replayed along the answers): " + ", ".join(
        f"exit {r['exit']} " + " / ".join(f"{v:.2f}" for v in r["greedy_mat"].values())
        for r in rows))
    if "oracle_agreement" in rows[-1]:
        r, first = rows[-1], rows[0]["exit"]
        chain = r["oracle_chain"]
        lines.append(f"  some exit right (escalation's ceiling): {r['oracle_agreement']:.3f}, "
                     f"{r['oracle_gain_over_first']:+.3f} ({r['oracle_gain_se']:.3f}) over "
                     f"exit {first}; its MAT " + " / ".join(f"{c['oracle_mat']:.2f}"
                                                             for c in chain)
                     + ", at most " + " / ".join(
                         f"{c['speedup_cap']:.3f}x ({c['speedup_cap_se']:.3f})" for c in chain)
                     + f" exit {first} alone at that gamma, before the deeper exits' cost")
    return lines


def first_turns(target: str, questions: str, max_prompts: int, chat_template: str = "auto"
                ) -> tuple[list[list[int]], int]:
    """(prompt ids of the first turns of `questions` in the target's template, the token
    that ends the target's turn)."""
    from s2d_jax.data.prompts import (encode_questions, end_of_turn_id, read_questions,
                                      resolve_template)
    from s2d_jax.io.tokenizer import load_tokenizer
    tok = load_tokenizer(target)
    template, _ = resolve_template(tok, chat_template)
    prompts = encode_questions(tok, read_questions(questions, None, max_prompts), template)
    return prompts, end_of_turn_id(tok, template)


def cached_target_answers(path: str, target: str, cfg, params, prompts, max_new_tokens: int,
                          eos_id: int, batch_slots: int = BATCH_SLOTS) -> list[list[int]]:
    """target_answers, kept in `path` (JSON) and read back while the target's files, the
    prompts and the length are the same: a study scoring many drafts on one held-out set
    generates the target's answers once."""
    import json
    import os

    from s2d_jax.data.engine import target_fingerprint
    from s2d_jax.io.atomic import write_atomic
    key = {"target": target_fingerprint(target), "max_new_tokens": max_new_tokens,
           "eos_id": eos_id, "prompts": [list(map(int, p)) for p in prompts]}
    if os.path.isfile(path):
        with open(path, encoding="utf-8-sig") as f:  # -sig: a BOM is no content
            have = json.load(f)
        if isinstance(have, dict) and {k: have.get(k) for k in key} == key:
            return have["answers"]
    answers = target_answers(cfg, params, prompts, max_new_tokens, eos_id, batch_slots)
    write_atomic(path, json.dumps({**key, "answers": [list(map(int, a)) for a in answers]}))
    return answers


def measure_agreement(target: str, draft_paths, questions: str, max_prompts: int,
                      max_new_tokens: int = 64, chat_template: str = "auto",
                      batch_slots: int = BATCH_SLOTS, answers_cache: str | None = None) -> dict:
    """{"questions", "prompts", "drafts": {path: per-exit rows}}: every draft scored on the
    target's greedy answers to the first turns of `questions` (kept in `answers_cache`
    when given: cached_target_answers)."""
    from s2d_jax.decode.defaults import draft_exits
    from s2d_jax.io.checkpoint import load_model
    from s2d_jax.io.checkpoint import load_draft

    prompts, eos_id = first_turns(target, questions, max_prompts, chat_template)
    cfg, params, _ = load_model(target, dtype="float32")
    drafts = []
    for path in dict.fromkeys(draft_paths):  # a draft named twice is scored once
        d_cfg, d_params, extra = load_draft(path, params, dtype="float32")
        if d_cfg.vocab_size != cfg.vocab_size:
            raise S2DError(f"draft {path} has vocab_size {d_cfg.vocab_size}, the target "
                           f"{cfg.vocab_size}; use a draft of this target")
        drafts.append(Draft(path, d_cfg, d_params, draft_exits(extra, d_cfg)))
    answers = (cached_target_answers(answers_cache, target, cfg, params, prompts,
                                     max_new_tokens, eos_id, batch_slots) if answers_cache
               else target_answers(cfg, params, prompts, max_new_tokens, eos_id, batch_slots))
    scored = score_drafts(cfg, params, drafts, prompts, answers, max_new_tokens)
    return {"questions": questions, "prompts": len(prompts),
            "drafts": {d.name: exit_agreement(stats, accept)
                       for d, (stats, accept) in zip(drafts, scored)}}
