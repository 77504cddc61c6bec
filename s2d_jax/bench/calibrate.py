"""Per-exit S2D thresholds (and gamma) for one target, chosen by the time model.

1. Greedy AR trajectories of the target on held-in prompts (timed: the AR cost per token).
2. One pass of the sorted draft over each trajectory: per position and exit, the exit's
   greedy token, whether it equals the target's token, and its confidence (max prob).
3. For every (thresholds, gamma) on a grid, replay the rounds along the trajectories: a
   drafted token stops at the first exit whose confidence reaches its threshold; a round
   accepts the drafted prefix that matches the target, plus the target's own token. This
   gives MAT and exit usage exactly for greedy decoding up to the CALM approximation of
   skipped layers' keys/values (the pass in 2 computes true keys/values everywhere).
4. theory.two_level with measured costs ranks the grid (every subset of the draft's exits).
   Measured for real (infer/calibrate.py): every single exit at every gamma (vanilla SD,
   so the calibrated setting falls back to the fastest single exit when escalating does
   not pay), the best few predicted multi-exit settings and the paper's 0.5/.../0. The
   fastest few are measured again (`finalists`: the best of many noisy runs is biased
   up), and the fastest on that second run is written to DIR/s2d_serving.json
   (atomically): the setting closest to the default (one exit, gamma 4) within a noise
   margin of the fastest (`pick_setting`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from s2d_jax.bench import theory
from s2d_jax.errors import S2DError
from s2d_jax.readers import read_text

SERVING_CONFIG = "s2d_serving.json"


def serving_config_path(target_dir: str) -> str:
    if os.path.isfile(target_dir):  # a .gguf target: next to the file
        return f"{target_dir}.{SERVING_CONFIG}"
    return os.path.join(target_dir, SERVING_CONFIG)


def load_serving_config(target_dir: str) -> dict | None:
    """The calibrated S2D settings of a target dir, or None when it has none."""
    path = serving_config_path(target_dir)
    if not os.path.isfile(path):
        return None
    text = read_text(path, "serving config")
    try:
        cfg = json.loads(text)  # a JSONDecodeError is a ValueError
        th = [float(t) for t in cfg["thresholds"]]
        gamma = int(cfg["gamma"])
        stop = float(cfg.get("stop_threshold", 0.0))
    except (KeyError, TypeError, ValueError):
        raise S2DError(f"{path} is not a valid serving config (needs 'thresholds' and "
                       f"'gamma'); delete it or rerun python -m infer.calibrate")
    if (not th or any(not 0.0 <= t <= 1.0 for t in th) or gamma < 1
            or not 0.0 <= stop <= 1.0):
        raise S2DError(f"{path} has thresholds or stop_threshold outside [0, 1] or gamma < 1; "
                       f"rerun python -m infer.calibrate")
    return {**cfg, "thresholds": th, "gamma": gamma, "stop_threshold": stop}


def write_serving_config(target_dir: str, cfg: dict) -> str:
    from s2d_jax.io.atomic import write_atomic
    path = serving_config_path(target_dir)
    write_atomic(path, json.dumps(cfg, indent=2) + "\n")
    return path


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


def exit_subsets(exits) -> list[tuple[int, ...]]:
    """Every non-empty subset of the exits, in order (a single exit = vanilla SD)."""
    exits = tuple(exits)
    return [tuple(e for e, keep in zip(exits, mask) if keep)
            for mask in itertools.product((0, 1), repeat=len(exits)) if any(mask)]


def exits_key(exits) -> str:
    return ",".join(str(int(e)) for e in exits)


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
        arr = np.zeros((1, width), np.int32)
        arr[0, :len(seq)] = seq
        ids, cf = jax.device_get(_exit_predictions(draft_params, jnp.asarray(arr), cfg=cfg,
                                                   exits=exits))
        lo, hi = len(p), len(seq) - 1  # predict seq[t + 1] from position t
        target = np.asarray(seq[lo + 1:hi + 1])[:, None]
        correct.append(ids[0, lo:hi] == target)
        conf.append(cf[0, lo:hi])
    return ExitStats(exits, correct, conf)


def simulate(stats: ExitStats, thresholds, gamma: int, stop: float = 0.0) -> dict:
    """Replay greedy rounds -> {"mean_accepted_tokens", "exit_usage", "draft_steps_per_round"}.

    stop > 0: the dynamic draft length (chain.draft_block): after a drafted token whose
    kept exit's confidence is below `stop`, the round drafts nothing more."""
    th = np.asarray(thresholds, np.float32)
    m = th.shape[0]
    usage = np.zeros(m, np.int64)
    rounds = tokens = 0
    for correct, conf in zip(stats.correct, stats.conf):
        n = correct.shape[0]
        if n == 0:
            continue
        stop_at = (conf >= th[None]) & (th[None] < 1.0)
        stop_at[:, -1] = True
        exit_idx = np.argmax(stop_at, axis=1)
        ok = correct[np.arange(n), exit_idx]
        sure = conf[np.arange(n), exit_idx] >= stop
        k = 0
        while k < n:
            g = min(gamma, n - k)
            unsure = np.flatnonzero(~sure[k:k + g - 1])  # drafting ends after the first
            g = int(unsure[0]) + 1 if unsure.size else g
            window = ok[k:k + g]
            a = int(np.argmin(window)) if not window.all() else g
            np.add.at(usage, exit_idx[k:k + g], 1)
            rounds += 1
            tokens += a + 1
            k += a + 1
    return {"mean_accepted_tokens": tokens / max(rounds, 1), "exit_usage": usage.tolist(),
            "draft_steps_per_round": float(usage.sum()) / max(rounds, 1)}


def threshold_grid(num_exits: int, values=None) -> list[tuple[float, ...]]:
    # 0 at a non-last exit would always stop there and 1 never: both equal a smaller exit
    # subset, which rank_configs searches directly (and more cheaply), so they are left out
    values = values or [round(0.1 * i, 1) for i in range(1, 10)]
    return [tuple(c) + (0.0,) for c in itertools.product(values, repeat=num_exits - 1)]


def predict_config(stats: ExitStats, costs: dict, ar_per_token: float, thresholds,
                   gamma: int, exits=None, stop: float = 0.0) -> dict | None:
    """Simulated MAT / exit usage and the predicted speedup of one (exits, thresholds, gamma).

    costs (seconds per call, timed inside jitted loops, call_costs.py): target_verify
    {str(gamma): s}, exit_costs {exits_key: [s per draft step stopping at each exit]}.
    ar_per_token: T_target(1), the target's AR step timed the same way."""
    exits = tuple(stats.exits if exits is None else exits)
    sim = simulate(stats.select(exits), thresholds, gamma, stop)
    if sum(sim["exit_usage"]) == 0:
        return None
    verify = costs["target_verify"][str(gamma)]
    pred = theory.two_level(ar_per_token, verify, costs["exit_costs"][exits_key(exits)],
                            sim["exit_usage"], sim["mean_accepted_tokens"],
                            sim["draft_steps_per_round"])
    return {"exits": list(exits), "thresholds": [float(t) for t in thresholds],
            "gamma": int(gamma), "stop_threshold": float(stop), **sim,
            "predicted_speedup": pred["predicted_speedup"]}


def rank_configs(stats: ExitStats, costs: dict, ar_per_token: float, gammas,
                 values=None) -> list[dict]:
    """Every (exit subset with measured costs, thresholds, gamma) of the grid with its
    prediction, best first."""
    out = []
    for key in costs["exit_costs"]:
        exits = tuple(int(e) for e in key.split(","))
        for g in gammas:
            for th in threshold_grid(len(exits), values):
                r = predict_config(stats, costs, ar_per_token, th, g, exits)
                if r is not None:
                    out.append(r)
    out.sort(key=lambda r: -r["predicted_speedup"])
    return out


def finalists(rows: list[dict], k: int) -> list[dict]:
    """The k fastest measured settings plus the fastest single exit (vanilla SD) if it is
    not among them: the ones measured again, since the best of many noisy measurements is
    biased up (the winner's curse)."""
    ranked = sorted(rows, key=lambda r: -r["measured_speedup"])
    out = ranked[:k]
    single = next((r for r in ranked if len(r["exits"]) == 1), None)
    if single is not None and single not in out:
        out.append(single)
    return out


def pick_setting(rows: list[dict], min_gain: float, default_gamma: int = 4,
                 key: str = "measured_speedup") -> dict:
    """The setting closest to the default (one exit, `default_gamma`) among those within
    the factor 1 + min_gain (about the run-to-run noise) of the fastest by `key`: fewest
    exits first, then the gamma nearest the default (the smaller on a tie), then the
    fastest. A departure from the default is kept only where it measurably pays: settings
    closer than the noise are a coin flip on other prompts."""
    fastest = max(r[key] for r in rows)
    near = [r for r in rows if r[key] * (1.0 + min_gain) >= fastest]
    return min(near, key=lambda r: (len(r["exits"]), abs(r["gamma"] - default_gamma),
                                    r["gamma"], -r[key]))


def pick_stop(rows: list[dict], min_gain: float = 0.0, key: str = "measured_speedup") -> dict:
    """The fastest of one setting measured at several draft stop thresholds (0 = off):
    stopping the draft after an unsure token saves draft steps that the target would
    mostly reject, and costs the tokens it would have accepted. Like escalation in
    `pick_setting`, a stop must beat no stop by the factor 1 + min_gain to be kept."""
    best = max(rows, key=lambda r: (r[key], r.get("stop_threshold", 0.0) == 0.0))
    off = [r for r in rows if not r.get("stop_threshold", 0.0)]
    if off and best[key] < off[0][key] * (1.0 + min_gain):
        return off[0]
    return best


def serving_record(target_dir: str, draft_dir: str, best: dict, paper: dict | None,
                   questions: str, num_prompts: int, max_new_tokens: int) -> dict:
    """The serving config's content. Paths (informational) are relative to the target dir,
    where the config lives, so a moved or cloned tree keeps them right."""
    def rel(path):
        return os.path.relpath(os.path.abspath(path), os.path.abspath(target_dir))

    return {"draft": rel(draft_dir), "exits": [int(e) for e in best["exits"]],
            "thresholds": best["thresholds"], "gamma": best["gamma"],
            "stop_threshold": float(best.get("stop_threshold", 0.0)),
            "measured_speedup": best.get("measured_speedup"),
            "predicted_speedup": best["predicted_speedup"],
            "paper_thresholds_measured_speedup": None if paper is None
            else paper.get("measured_speedup"),
            "calibrated_on": {"questions": rel(questions), "prompts": num_prompts,
                              "max_new_tokens": max_new_tokens,
                              "utc": datetime.datetime.now(datetime.timezone.utc)
                              .strftime("%Y-%m-%dT%H:%M:%SZ")}}
