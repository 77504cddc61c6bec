"""Time model of (polybasic) speculative decoding: Lemma 3.1 and the insertion rule.

Source: Wang et al., "Polybasic Speculative Decoding Through a Theoretical Perspective"
(ICML 2025, arXiv 2510.26527).

Index convention (this file): M_1 is the TARGET and M_n the fastest drafter; M_n drafts,
M_{n-1}, ..., M_1 verify in turn. Other places number the same chain differently:
  decode/round.py levels:  level 0 = draft, ..., level n-1 = target, so M_i = level n-i;
  serving.summarize lists (level_acceptance_rate, level_forwards): entry j (0-based) is
      verifier level j+1 = M_{n-1-j}; the LAST entry is the target M_1;
  issue 7's text: M_1 the draft, M_n the target (the reverse of this file).
Every function here takes its lists target first: costs [T_1 (target), ..., T_n (drafter)].

Symbols (the paper's):
  N    number of generated tokens
  T_i  cost of one forward call of M_i
  L_i  expected number of tokens produced per verification call of M_i (mean accepted
       length, counting M_i's own correction/bonus token: Spec-Bench's MAT for i = 1)
  F_i  number of forward calls of M_i; total time T = sum_i F_i T_i
  beta forward calls of the last drafter M_n per verification call of M_{n-1} (gamma
       draft steps per round in the usual two-model setting)

Lemma 3.1 (as stated in the paper's summaries we could retrieve):
    T = sum_{i=1}^{n-1} (N / L_i) T_i  +  beta (N / L_{n-1}) T_n,
since M_i (i < n) is called F_i = N / L_i times and M_n beta times per call of M_{n-1}.
Measured runs give L_i back exactly as L_i = N / F_i (`lemma_inputs`): for the target
that is MAT; for an intermediate it is below its per-call accepted length + 1, because the
tokens the target later rejects were produced by (and cost) the intermediate too.

Theorem 3.2 (insertion of a candidate M_c between M_k and M_{k+1}): we could not retrieve
the exact statement text, so `insertion_gain` evaluates Lemma 3.1 on both chains and
returns both sides: inserting helps iff T_after / N < T_before / N. For inserting between
the target and its only drafter (n = 2 -> 3; the new chain is M_1' = target,
M_2' = candidate, M_3' = drafter) this reads
    T_1' / L_1' + T_2' / L_2' + beta' T_3' / L_2'   <   T_1 / L_1 + beta T_2 / L_1,
where L_1' is the target's accepted length when verifying the candidate, L_2' the
candidate's when verifying the drafter, and beta' the drafter's calls per candidate call.
T_1' may differ from T_1: the target then verifies a longer block (gamma + mu_c + 1
positions instead of gamma + 1), so `insertion_gain` takes the new chain's costs too.

`loop_speedup` is Lemma 3.1 with n = 2 written for our engine, on round costs measured
inside the decode loop (loop_costs.py): the target's verification cost depends on the
tokens scored (gamma + 1, or 1 in autoregressive decoding), the sorted drafter's per-token
cost on the exit it stops at (S2D escalation), and each generation pays a prefill.
`loop_prediction` applies it to probe results; the benchmark and calibration both use it.
"""

from __future__ import annotations

from typing import Sequence

from s2d_jax.errors import S2DError


def _positive(name: str, values) -> list[float]:
    out = [float(v) for v in values]
    if any(not v > 0 for v in out):
        raise S2DError(f"{name} must be positive, got {out}")
    return out


def time_terms(costs: Sequence[float], accept_lengths: Sequence[float],
               beta: float) -> list[float]:
    """The n terms of Lemma 3.1 divided by N, one per model:
    [T_1 / L_1, ..., T_{n-1} / L_{n-1}, beta T_n / L_{n-1}] (seconds per token each)."""
    T = _positive("costs", costs)
    L = _positive("accept lengths", accept_lengths)
    if len(T) < 2 or len(L) != len(T) - 1:
        raise S2DError(f"a chain of {len(T)} models needs {len(T) - 1} accept lengths and at "
                       f"least 2 models, got {len(L)} accept lengths")
    if not beta >= 0:
        raise S2DError(f"beta (drafter calls per verification) must be >= 0, got {beta}")
    return [t / l for t, l in zip(T[:-1], L)] + [beta * T[-1] / L[-1]]


def chain_time_per_token(costs: Sequence[float], accept_lengths: Sequence[float],
                         beta: float) -> float:
    """Lemma 3.1 divided by N: T / N = sum_{i<n} T_i / L_i + beta T_n / L_{n-1}.

    costs: [T_1 (target), ..., T_n (last drafter)]; accept_lengths: [L_1, ..., L_{n-1}].
    """
    return sum(time_terms(costs, accept_lengths, beta))


def insertion_gain(costs: Sequence[float], accept_lengths: Sequence[float], beta: float,
                   position: int, candidate_cost: float, new_accept_lengths: Sequence[float],
                   new_beta: float | None = None,
                   new_costs: Sequence[float] | None = None) -> dict:
    """Does inserting a candidate model after chain level `position` (1-based: between
    M_position and M_{position+1}) lower the expected time per token?

    new_accept_lengths: the n accept lengths [L_1', ..., L_n'] of the new chain (the
    candidate's own L sits at index `position`). new_costs: the n existing models' costs
    in the new chain (default `costs`; a verifier of a longer block costs more). Returns
    {"before", "after", "helps", "gain"} with before/after the two sides (seconds per
    token) and gain = before / after.
    """
    n = len(costs)
    if not 1 <= position < n:
        raise S2DError(f"position must be in [1, {n - 1}] for a chain of {n} models, "
                       f"got {position}")
    if new_costs is not None and len(new_costs) != n:
        raise S2DError(f"new costs must list the {n} models of the old chain, got "
                       f"{len(new_costs)} values")
    before = chain_time_per_token(costs, accept_lengths, beta)
    kept = list(costs if new_costs is None else new_costs)
    after_costs = kept[:position] + [candidate_cost] + kept[position:]
    after = chain_time_per_token(after_costs, new_accept_lengths,
                                 beta if new_beta is None else new_beta)
    return {"before": before, "after": after, "helps": after < before,
            "gain": before / after}


def lemma_inputs(tokens: float, calls: Sequence[float], draft_steps: float
                 ) -> tuple[list[float], float]:
    """Measured counts -> Lemma 3.1's (L_1..L_{n-1}, beta) such that the lemma reproduces
    the measured forward time exactly: L_i = N / F_i and beta = (drafter steps) / F_{n-1}.

    tokens: N, the tokens the rounds produced; calls: [F_1 (target), ..., F_{n-1}]."""
    F = _positive("forward calls", calls)
    if not tokens > 0 or draft_steps < 0:
        raise S2DError(f"need a positive token count and non-negative drafter steps, got "
                       f"N={tokens}, steps={draft_steps}")
    return [tokens / f for f in F], draft_steps / F[-1]


def draft_step_cost(exit_costs: Sequence[float], exit_usage: Sequence[float]) -> float:
    """Mean cost of one sorted-draft step: sum_j u_j c_j with u the (normalised) share of
    drafted tokens kept at exit j and c_j the cost of a step that stops at exit j."""
    c = _positive("exit costs", exit_costs)
    u = [float(x) for x in exit_usage]
    if len(u) != len(c) or any(x < 0 for x in u) or sum(u) <= 0:
        raise S2DError(f"exit usage must be {len(c)} non-negative counts with a positive "
                       f"sum, got {u}")
    return sum(ci * ui for ci, ui in zip(c, u)) / sum(u)


def round_costs_at_steps(full_round_s: Sequence[float], one_step_round_s: Sequence[float],
                         steps_per_round: float, gamma: int) -> list[float]:
    """Round cost per forced exit with a dynamic draft length: rounds timed with all gamma
    draft steps (R) and with one (R1) are linear in the steps run (each step is the same
    call, skipped as a whole when no row needs it), so beta steps cost
    R1 + (beta - 1) / (gamma - 1) * (R - R1)."""
    if gamma <= 1:
        return list(full_round_s)
    frac = min(max((steps_per_round - 1.0) / (gamma - 1), 0.0), 1.0)
    return [r1 + frac * (r - r1) for r, r1 in zip(full_round_s, one_step_round_s)]


def loop_speedup(ar_round_s: float, ar_prefill_s: float, round_costs: Sequence[float],
                 exit_usage: Sequence[float], prefill_s: float, *, prompts: int, tokens: int,
                 rounds: int, prefill_total_s: float | None = None,
                 ar_prefill_total_s: float | None = None) -> dict:
    """Lemma 3.1 with n = 2 on costs measured inside the decode loop (loop_costs.py), with
    the prefill each generation pays added on both sides:

      T_AR  = prompts * P_AR + N * R_AR            (AR: one target call per token)
      T_S2D = prompts * P + F_1 * sum_j u_j R_j    (F_1 = N / L_1 target calls = rounds)

    prefill_total_s / ar_prefill_total_s: the prefills as the run timed them (their sum over
    its prompts) in place of prompts * P: a prefill's cost grows with the prompt's length
    (Spec-Bench's summarization and RAG prompts run to ~1000 tokens, its MT-bench ones to
    ~30), so one probe prompt's prefill stands for none of them, and where prefill is a
    large share of a short generation the prediction followed the probe prompt instead of
    the rounds.

    R_j = beta c_j + T_1(gamma + 1) is one round with every drafted token kept at exit j,
    so sum_j u_j R_j is Lemma 3.1's beta T_n + T_1 per target call for the measured exit
    usage u (normalised). Returns the predicted speedup T_AR / T_S2D and both times."""
    R = _positive("round costs", round_costs)
    c = draft_step_cost(R, exit_usage) if len(R) > 1 else R[0]
    p_ar = prompts * ar_prefill_s if ar_prefill_total_s is None else ar_prefill_total_s
    p = prompts * prefill_s if prefill_total_s is None else prefill_total_s
    t_ar = p_ar + tokens * ar_round_s
    t = p + rounds * c
    return {"predicted_speedup": t_ar / t, "predicted_ar_s": t_ar, "predicted_s": t,
            "round_s": c}


def loop_prediction(ar: dict, costs: dict, exit_usage: Sequence[float],
                    steps_per_round: float, gamma: int, *, prompts: int, tokens: int,
                    rounds: int, prefill_s: float | None = None,
                    ar_prefill_s: float | None = None) -> dict:
    """`loop_speedup` on loop_costs.LoopProbe results: `ar` of the target's AR decoder,
    `costs` of the method's ({"prefill_s", "round_s": [per forced exit]}, and
    "one_step_round_s" for a dynamic draft length: its rounds run `steps_per_round` of
    gamma draft steps). exit_usage: drafted tokens per exit (all zero: no draft step ran,
    every round costs the same)."""
    rounds_s = costs["round_s"]
    if "one_step_round_s" in costs:
        rounds_s = round_costs_at_steps(rounds_s, costs["one_step_round_s"], steps_per_round,
                                        gamma)
    usage = exit_usage if any(exit_usage) else [1.0] * len(rounds_s)
    return loop_speedup(ar["round_s"][0], ar["prefill_s"], rounds_s, usage,
                        costs["prefill_s"], prompts=prompts, tokens=tokens, rounds=rounds,
                        prefill_total_s=prefill_s, ar_prefill_total_s=ar_prefill_s)
