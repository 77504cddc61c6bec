"""Held-out agreement while a draft trains: a training-loop hook (s2d_jax/train/hooks.py)
that every N steps scores the draft's exits on a fixed held-out prompt set, as
python -m infer.agreement does (greedy agreement and T = 1 acceptance per exit, paired
gains), and appends one JSON line per measurement, so the curve is visible while it trains.

The target's greedy answers are computed once, when the hook is built; each measurement
is then one teacher-forced pass per prompt (bench/agreement.py's score_drafts, memory
bounded by one prompt's answer rows).
"""

from __future__ import annotations

import json
import os

import jax

from s2d_jax.bench.agreement import (Draft, exit_agreement, first_turns, score_drafts,
                                     target_answers)


class HeldoutAgreement:
    """hook(step, state, record): measure at every `every`-th step and at `last_step`."""

    def __init__(self, target: str, questions: str, draft_cfg, exits, path: str, every: int,
                 last_step: int, max_prompts: int = 40, max_new_tokens: int = 64,
                 head_ids=None):
        from s2d_jax.io.checkpoint import load_model
        self.prompts, eos_id = first_turns(target, questions, max_prompts)
        self.cfg, self.params, _ = load_model(target, dtype="float32")
        self.answers = target_answers(self.cfg, self.params, self.prompts, max_new_tokens,
                                      eos_id)
        self.draft_cfg, self.exits, self.head_ids = draft_cfg, tuple(exits), head_ids
        self.rows, self.every, self.last_step = max_new_tokens, every, last_step
        self.questions, self.path = questions, path
        self.f = None
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.f = open(path, "a")

    def measure(self, params) -> list[dict]:
        """Per exit: agreement, T = 1 acceptance, paired gain (agreement.exit_agreement)."""
        if self.head_ids is not None:
            params = {**params, "head_ids": self.head_ids}
        draft = Draft("draft", self.draft_cfg, params, self.exits)
        [(stats, accept)] = score_drafts(self.cfg, self.params, [draft], self.prompts,
                                         self.answers, self.rows)
        return exit_agreement(stats, accept)

    def __call__(self, step, state, record) -> None:
        if self.f is None or not (step % self.every == 0 or step == self.last_step):
            return
        line = {"step": int(step), "questions": self.questions, "prompts": len(self.prompts),
                "exits": self.measure(state.params)}
        self.f.write(json.dumps(line) + "\n")
        self.f.flush()
        print(f"[heldout] step {step}: " + ", ".join(
            f"exit {r['exit']} {r['agreement']:.3f} (T = 1: {r['accept_t1']:.3f})"
            for r in line["exits"]), flush=True)

    def close(self) -> None:
        if self.f:
            self.f.close()
