"""Time model of (polybasic) speculative decoding: Lemma 3.1 and the insertion rule.

Source: Wang et al., "Polybasic Speculative Decoding Through a Theoretical Perspective"
(ICML 2025, arXiv 2510.26527). A chain M_1, ..., M_n: M_1 is the target, M_n the fastest
drafter. M_n drafts, M_{n-1}, ..., M_1 verify in turn. Symbols (the paper's):
  N    number of generated tokens
  T_i  cost of one forward call of M_i
  L_i  expected number of tokens produced per verification call of M_i (mean accepted
       length, counting M_i's own correction/bonus token: Spec-Bench's MAT for i = 1)
  F_i  number of forward calls of M_i; total time T = sum_i F_i T_i
  beta forward calls of the last drafter M_n per verification call of M_{n-1} (gamma
       draft steps per round in the usual two-model setting)

Lemma 3.1 (as stated in the paper's summaries we could retrieve):
    T = sum_{i=1}^{n-1} (N / L_i) T_i  +  beta (N / L_{n-1}) T_n,
since M_i (i < n) is called once per L_i tokens and M_n beta times per call of M_{n-1}.

Theorem 3.2 (insertion of a candidate M_c between M_k and M_{k+1}): we could not retrieve
the exact statement text, so `insertion_gain` evaluates Lemma 3.1 on both chains and
returns both sides: inserting helps iff T_after / N < T_before / N. For inserting between
the target and its only drafter (n = 2 -> 3) this reads
    T_1 / L_1' + T_c / L_c + beta' T_2 / L_c   <   T_1 / L_1 + beta T_2 / L_1,
where L_1' is the target's mean accepted length when verifying M_c, L_c the candidate's
mean accepted length when verifying M_2, and beta' the drafter's calls per M_c call.

`two_level` is Lemma 3.1 with n = 2 written for our engine: T_1 depends on the number of
tokens scored (gamma + 1 when verifying, 1 in plain autoregressive decoding) and the
sorted drafter's per-token cost depends on the exit it stops at (S2D escalation).
"""

from __future__ import annotations

from typing import Sequence

from s2d_jax.errors import S2DError


def _positive(name: str, values) -> list[float]:
    out = [float(v) for v in values]
    if any(not v > 0 for v in out):
        raise S2DError(f"{name} must be positive, got {out}")
    return out


def chain_time_per_token(costs: Sequence[float], accept_lengths: Sequence[float],
                         beta: float) -> float:
    """Lemma 3.1 divided by N: T / N = sum_{i<n} T_i / L_i + beta T_n / L_{n-1}.

    costs: [T_1 (target), ..., T_n (last drafter)]; accept_lengths: [L_1, ..., L_{n-1}].
    """
    T = _positive("costs", costs)
    L = _positive("accept lengths", accept_lengths)
    if len(T) < 2 or len(L) != len(T) - 1:
        raise S2DError(f"a chain of {len(T)} models needs {len(T) - 1} accept lengths and at "
                       f"least 2 models, got {len(L)} accept lengths")
    if beta < 0:
        raise S2DError(f"beta (drafter calls per verification) must be >= 0, got {beta}")
    return sum(t / l for t, l in zip(T[:-1], L)) + beta * T[-1] / L[-1]


def insertion_gain(costs: Sequence[float], accept_lengths: Sequence[float], beta: float,
                   position: int, candidate_cost: float, new_accept_lengths: Sequence[float],
                   new_beta: float | None = None) -> dict:
    """Does inserting a candidate model after chain level `position` (1-based: between
    M_position and M_{position+1}) lower the expected time per token?

    new_accept_lengths: the n accept lengths [L_1', ..., L_n'] of the new chain (the
    candidate's own L sits at index `position`). Returns {"before", "after", "helps",
    "gain"} with before/after the two sides (seconds per token) and gain = before / after.
    """
    n = len(costs)
    if not 1 <= position < n:
        raise S2DError(f"position must be in [1, {n - 1}] for a chain of {n} models, "
                       f"got {position}")
    before = chain_time_per_token(costs, accept_lengths, beta)
    new_costs = list(costs[:position]) + [candidate_cost] + list(costs[position:])
    after = chain_time_per_token(new_costs, new_accept_lengths,
                                 beta if new_beta is None else new_beta)
    return {"before": before, "after": after, "helps": after < before,
            "gain": before / after}


def draft_step_cost(exit_costs: Sequence[float], exit_usage: Sequence[float]) -> float:
    """Mean cost of one sorted-draft step: sum_j u_j c_j with u the (normalised) share of
    drafted tokens kept at exit j and c_j the cost of a step that stops at exit j."""
    c = _positive("exit costs", exit_costs)
    u = [float(x) for x in exit_usage]
    if len(u) != len(c) or any(x < 0 for x in u) or sum(u) <= 0:
        raise S2DError(f"exit usage must be {len(c)} non-negative counts with a positive "
                       f"sum, got {u}")
    return sum(ci * ui for ci, ui in zip(c, u)) / sum(u)


def two_level(target_cost_1: float, target_cost_verify: float, exit_costs: Sequence[float],
              exit_usage: Sequence[float], mean_accepted: float,
              draft_steps_per_round: float) -> dict:
    """Lemma 3.1 with n = 2 for one target and one (sorted) drafter.

    T_round = beta * sum_j u_j c_j + T_1(gamma + 1)    (beta = draft steps per round)
    tokens per round = L_1 = MAT;  time per token = T_round / MAT
    predicted speedup = T_1(1) * MAT / T_round   (autoregressive: T_1(1) per token)
    """
    T1, Tv = _positive("target costs", [target_cost_1, target_cost_verify])
    if mean_accepted < 1:
        raise S2DError(f"mean accepted tokens per round must be >= 1, got {mean_accepted}")
    c = draft_step_cost(exit_costs, exit_usage)
    round_s = draft_steps_per_round * c + Tv
    return {"draft_step_s": c, "round_s": round_s, "tokens_per_round": mean_accepted,
            "time_per_token_s": round_s / mean_accepted,
            "predicted_speedup": T1 * mean_accepted / round_s}
