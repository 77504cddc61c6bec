"""What a sorted draft's exits guess along the target's own trajectories: per position and
exit, whether the exit's greedy token is the target's and its confidence. Calibration
(s2d_jax/calibration/) chooses thresholds from it; the agreement study (agreement.py) reports it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.decode.defaults import round_up


@dataclasses.dataclass
class ExitStats:
    """Per prompt: correct [n, m] bool (exit j's greedy token == target's) and conf [n, m]
    for the draft exits `exits` (layer counts)."""

    exits: tuple
    correct: list
    conf: list

    def select(self, exits) -> "ExitStats":
        """The same statistics for a subset of the exits (a draft that never checks the
        others: its tokens at the kept exits do not depend on the skipped heads)."""
        cols = [self.exits.index(e) for e in exits]
        return ExitStats(tuple(exits), [c[:, cols] for c in self.correct],
                         [c[:, cols] for c in self.conf])


@functools.partial(jax.jit, static_argnames=("cfg", "exits"))
def _exit_predictions(params, tokens, *, cfg, exits):
    from s2d_jax.model.sorted_draft import multi_exit_logits
    logits = multi_exit_logits(params, cfg, exits, tokens)
    ids = jnp.stack([jnp.argmax(lg, -1) for lg in logits], -1)  # [B, T, m]
    conf = jnp.stack([jnp.max(jax.nn.softmax(lg, -1), -1) for lg in logits], -1)
    return ids, conf


def exit_stats(draft_cfg, draft_params, exits, prompts: list[list[int]],
               continuations: list[list[int]], width: int) -> ExitStats:
    """Draft predictions along target trajectories (prompt + continuation, padded to width).

    Row k of a prompt's arrays is the draft's guess for continuation token k + 1 (token 0
    comes from the target's prefill and is never drafted)."""
    exits = tuple(int(e) for e in exits)
    cfg = dataclasses.replace(draft_cfg, num_layers=exits[-1])
    correct, conf = [], []
    for p, c in zip(prompts, continuations):
        seq = list(p) + list(c)
        # padded to a multiple of 64 (causal: padding changes no earlier position), at
        # most to width: a few compilations, not every prompt attending over the buffer
        arr = np.zeros((1, min(width, round_up(len(seq), 64))), np.int32)
        arr[0, :len(seq)] = seq
        ids, cf = jax.device_get(_exit_predictions(draft_params, jnp.asarray(arr), cfg=cfg,
                                                   exits=exits))
        lo, hi = len(p), len(seq) - 1  # predict seq[t + 1] from position t
        target = np.asarray(seq[lo + 1:hi + 1])[:, None]
        correct.append(ids[0, lo:hi] == target)
        conf.append(cf[0, lo:hi])
    return ExitStats(exits, correct, conf)


def clustered_ratio(num, den) -> tuple[float, float]:
    """sum(num) / sum(den) over prompts (per-prompt totals) and its standard error clustered
    by prompt, by the delta method: the tokens of one answer are not independent. A mean
    over tokens is the case den = tokens per prompt."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    ratio = num.sum() / den.sum()
    return float(ratio), float(np.sqrt(((num - ratio * den) ** 2).sum()) / den.sum())


def token_mean(per_prompt) -> tuple[float, float]:
    """The mean over all tokens of per-prompt arrays and its clustered s.e."""
    return clustered_ratio([x.sum() for x in per_prompt], [len(x) for x in per_prompt])
