"""Greedy rounds replayed from teacher-forced correctness along the target's own answers:
the calibration's MAT of a setting (calibration/calibrate.py), and what escalating between a
sorted draft's exits can buy at most (agreement.py): one exit's rounds at each draft length
against those of an oracle that is right wherever some exit is.
"""

from __future__ import annotations

import numpy as np

from s2d_jax.bench.exit_stats import ExitStats, clustered_ratio, token_mean

# The draft lengths whose greedy MAT the report replays (calibration's range).
GAMMAS = (1, 2, 3, 4)


def simulate(stats: ExitStats, thresholds, gamma: int, stop: float = 0.0,
             chosen: list | None = None) -> dict:
    """Replay greedy rounds -> {"mean_accepted_tokens", "exit_usage", "draft_steps_per_round",
    "rounds", "tokens"} (tokens: those the rounds add; each prompt's first token comes from
    the prefill).

    A round adds at most what is left of the trajectory (the engine cuts at max_new_tokens
    and EOS). stop > 0: the dynamic draft length (chain.draft_block): after a drafted token
    whose kept exit's confidence is below `stop`, the round drafts nothing more.

    Exact for the engine's greedy MAT with exact draft keys/values (kv_fill="full"): a
    round's accepted prefix only depends on drafted tokens whose inputs are the target's.
    Exit usage is exact for gamma 1; with a longer block the engine drafts the tokens after
    a rejection (and the last round's tokens past the trajectory) from its own guesses,
    which the replay scores on the target's tokens.

    chosen: per prompt, the exit index each token's drafting stops at, in place of the
    thresholds' choice (an oracle's: `oracle_exits`)."""
    th = np.asarray(thresholds, np.float32)
    usage = np.zeros(len(stats.exits), np.int64)
    rounds = tokens = 0
    for i, (correct, conf) in enumerate(zip(stats.correct, stats.conf)):
        n = correct.shape[0]
        if n == 0:
            continue
        exit_idx = threshold_exits(conf, th) if chosen is None else np.asarray(chosen[i])
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
            added = min(a + 1, n - k)
            rounds += 1
            tokens += added
            k += added
    return {"mean_accepted_tokens": tokens / max(rounds, 1), "exit_usage": usage.tolist(),
            "draft_steps_per_round": float(usage.sum()) / max(rounds, 1),
            "rounds": rounds, "tokens": tokens}


def threshold_exits(conf: np.ndarray, th: np.ndarray) -> np.ndarray:
    """[n] the exit each token stops at: the first whose confidence reaches its threshold
    (1.0: never), else the last."""
    stop_at = (conf >= th[None]) & (th[None] < 1.0)
    stop_at[:, -1] = True
    return np.argmax(stop_at, axis=1)


def oracle_exits(stats: ExitStats) -> list[np.ndarray]:
    """Per prompt, an oracle's exit for each token: the shallowest exit whose greedy token
    is the target's, or the first (the cheapest) where none is."""
    return [np.argmax(c, axis=1) for c in stats.correct]  # argmax of all-False: 0


def chain_rounds(correct: list, gamma: int) -> np.ndarray:
    """Per prompt: the rounds greedy SD at `gamma` takes along the target's answer when a
    drafted token is right exactly where correct[k] [n] says (simulate's replay)."""
    return np.array([simulate(ExitStats((0,), [c[:, None]], [np.ones((len(c), 1))]), [0.0],
                              gamma)["rounds"] for c in correct], np.int64)


def greedy_mats(stats: ExitStats, j: int, gammas=GAMMAS) -> list[float]:
    """Exit j's greedy SD MAT (tokens per round after the prefill's) at each gamma, replayed
    along the answers."""
    n = sum(len(c) for c in stats.correct)
    return [n / max(int(chain_rounds([c[:, j] for c in stats.correct], g).sum()), 1)
            for g in gammas]


def escalation_bound(stats: ExitStats, gammas=GAMMAS) -> dict:
    """The most any escalation rule can buy: the share of tokens on which some exit's greedy
    token is the target's (an oracle that escalates exactly when a deeper exit is right, at
    no cost), its paired gain over the first exit (s.e. by prompt) and, per gamma, the
    oracle's greedy MAT and the speedup over the first exit alone at that gamma that it
    caps: the first exit's rounds over the oracle's (replayed; s.e. by prompt), before the
    deeper exits' cost. A setting's speedup over the best single exit at any of these
    gammas is at most the largest cap."""
    any_hit = [c.any(axis=1) for c in stats.correct]
    gain, se = token_mean([a.astype(np.float64) - c[:, 0] for a, c in
                            zip(any_hit, stats.correct)])
    n = sum(len(a) for a in any_hit)
    chain = []
    for g in gammas:
        first = chain_rounds([c[:, 0] for c in stats.correct], g)
        oracle = chain_rounds(any_hit, g)
        cap, cap_se = clustered_ratio(first, oracle)
        chain.append({"gamma": int(g), "first_exit_mat": n / max(int(first.sum()), 1),
                      "oracle_mat": n / max(int(oracle.sum()), 1), "speedup_cap": cap,
                      "speedup_cap_se": cap_se})
    return {"oracle_agreement": float(sum(a.sum() for a in any_hit) / n),
            "oracle_gain_over_first": gain, "oracle_gain_se": se, "oracle_chain": chain}
