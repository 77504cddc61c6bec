"""Per-exit S2D thresholds (and gamma) for one target, chosen by the time model.

1. Greedy AR trajectories of the target on held-in prompts.
2. One pass of the sorted draft over each trajectory: per position and exit, the exit's
   greedy token, whether it equals the target's token, and its confidence (max prob).
3. For every (thresholds, gamma) on a grid, replay the rounds along the trajectories: a
   drafted token stops at the first exit whose confidence reaches its threshold; a round
   accepts the drafted prefix that matches the target, plus the target's own token. This
   gives the greedy MAT exactly up to the CALM approximation of skipped layers'
   keys/values (the pass in 2 computes true keys/values everywhere; `simulate` says what
   the exit usage misses).
4. The benchmark's prediction (theory.loop_prediction) ranks the grid, with round costs
   timed inside the engine's decode loop (loop_costs.LoopProbe: one probe per exit subset
   and gamma, forced to each exit; the target's AR step likewise). Measured for real
   (infer/calibrate.py): every single exit at every gamma (vanilla SD, so the calibrated
   setting falls back to the fastest single exit when escalating does not pay), the best
   few predicted multi-exit settings and the paper's 0.5/.../0. The fastest few are
   measured again (`finalists`: the best of many noisy runs is biased up), and the
   setting closest to the default (one exit, gamma 4) within a noise margin of the
   fastest on that second run (`pick_setting`) is written to DIR/s2d_serving.json
   (decode/serving_config.py).
"""

from __future__ import annotations

import itertools

import numpy as np

from s2d_jax.bench import theory
from s2d_jax.bench.escalation import oracle_exits, simulate
from s2d_jax.bench.exit_stats import ExitStats, exit_stats  # noqa: F401 (part of this API)
from s2d_jax.decode.methods import DEFAULT_GAMMA
from s2d_jax.errors import S2DError


def exit_subsets(exits) -> list[tuple[int, ...]]:
    """Every non-empty subset of the exits, in order (a single exit = vanilla SD)."""
    exits = tuple(exits)
    return [tuple(e for e, keep in zip(exits, mask) if keep)
            for mask in itertools.product((0, 1), repeat=len(exits)) if any(mask)]


def exits_key(exits) -> str:
    return ",".join(str(int(e)) for e in exits)


def threshold_grid(num_exits: int, values=None) -> list[tuple[float, ...]]:
    # 0 at a non-last exit would always stop there and 1 never: both equal a smaller exit
    # subset, which rank_configs searches directly (and more cheaply), so they are left out
    values = values or [round(0.1 * i, 1) for i in range(1, 10)]
    return [tuple(c) + (0.0,) for c in itertools.product(values, repeat=num_exits - 1)]


def setting_key(exits, gamma: int) -> str:
    """Key of one (exit subset, gamma) in costs["settings"]: "1,3@4"."""
    return f"{exits_key(exits)}@{int(gamma)}"


def parse_setting_key(key: str) -> tuple[tuple[int, ...], int]:
    exits, _, gamma = key.partition("@")
    return tuple(int(e) for e in exits.split(",")), int(gamma)


def probed_subsets(exits) -> list[tuple[int, ...]]:
    """The exit subsets calibration times directly: every single exit (vanilla SD, always
    measured for real) and the whole set; `derive_subset_costs` fills in the others."""
    exits = tuple(exits)
    return [(e,) for e in exits] + ([exits] if len(exits) > 1 else [])


def derive_subset_costs(settings: dict, exits, gammas) -> dict:
    """Round costs of every exit subset at every gamma from the probes of the single exits
    and of the whole set (`probed_subsets`), so calibration compiles and times 1 + m probes
    per gamma instead of 2^m - 1 (on SmolLM2 with 4 exits x 3 gammas, 45 probes took most
    of an hour before ranking began).

    A round forced to exit e runs the draft's layers up to e whichever exits are checked on
    the way; each checked exit below e adds its head, confidence and branch. That check
    costs (whole set at the deepest exit - the deepest exit alone) / (m - 1) per round, so
    a subset stopping at e costs the whole set at e minus the checks of the exits it
    skips, and never less than exit e alone. Derived entries carry "derived": True; the
    settings calibration measures for real are probed themselves."""
    exits, out = tuple(exits), dict(settings)
    for g in gammas:
        full = settings[setting_key(exits, g)]
        single = {e: settings[setting_key((e,), g)]["round_s"][0] for e in exits}
        check = max(0.0, (full["round_s"][-1] - single[exits[-1]]) / max(len(exits) - 1, 1))
        for sub in exit_subsets(exits):
            key = setting_key(sub, g)
            if key in out:
                continue
            round_s = [max(full["round_s"][exits.index(e)]
                           - check * sum(1 for x in exits if x < e and x not in sub), single[e])
                       for e in sub]
            # the draft's prefill runs its layers up to the subset's deepest exit
            out[key] = {**settings[setting_key((sub[-1],), g)], "round_s": round_s,
                        "derived": True}
    return out


def predict_config(stats: ExitStats, costs: dict, thresholds, gamma: int, exits=None,
                   stop: float = 0.0, prefill_s: float | None = None,
                   ar_prefill_s: float | None = None, chosen: list | None = None) -> dict | None:
    """Simulated MAT / exit usage and the predicted speedup of one (exits, thresholds, gamma,
    draft stop), by the benchmark's own formula (theory.loop_prediction).

    costs: in-loop round costs (loop_costs.LoopProbe results, as the benchmark measures
    them): "ar" the target's AR probe, "settings" {setting_key: probe of an S2D decoder
    with those exits and gamma} ("one_step_round_s" needed when stop > 0). prefill_s,
    ar_prefill_s: the run's prefills (summed over its prompts) where a run measured them,
    in place of the probe prompt's (theory.loop_speedup). chosen: each token's exit index
    in place of the thresholds' choice (simulate)."""
    exits = tuple(stats.exits if exits is None else exits)
    sim = simulate(stats.select(exits), thresholds, gamma, stop, chosen)
    if sum(sim["exit_usage"]) == 0:
        return None
    key = setting_key(exits, gamma)
    if key not in costs["settings"]:
        raise S2DError(f"no round costs measured for exits {list(exits)} at gamma {gamma}; "
                       f"probe that setting first")
    loop = costs["settings"][key]
    if stop > 0 and "one_step_round_s" not in loop:
        raise S2DError(f"a draft stop needs the one-step round costs of exits {list(exits)} "
                       f"at gamma {gamma}; probe a decoder with a stop threshold")
    if stop == 0:
        loop = {k: v for k, v in loop.items() if k != "one_step_round_s"}
    prompts = len(stats.correct)
    pred = theory.loop_prediction(costs["ar"], loop, sim["exit_usage"],
                                  sim["draft_steps_per_round"], gamma, prompts=prompts,
                                  tokens=sim["tokens"] + prompts, rounds=sim["rounds"],
                                  prefill_s=prefill_s, ar_prefill_s=ar_prefill_s)
    return {"exits": list(exits), "thresholds": [float(t) for t in thresholds],
            "gamma": int(gamma), "stop_threshold": float(stop), **sim,
            "predicted_speedup": pred["predicted_speedup"]}


def rank_configs(stats: ExitStats, costs: dict, values=None) -> list[dict]:
    """Every (exit subset, gamma) with measured round costs x the threshold grid, with its
    prediction, best first."""
    out = []
    for key in costs["settings"]:
        exits, g = parse_setting_key(key)
        for th in threshold_grid(len(exits), values):
            r = predict_config(stats, costs, th, g, exits)
            if r is not None:
                out.append(r)
    out.sort(key=lambda r: -r["predicted_speedup"])
    return out


def oracle_ceiling(stats: ExitStats, costs: dict) -> dict | None:
    """What escalating between the exits could buy at most at the measured round costs: an
    oracle that drafts each token at the shallowest exit that is right (the first where none
    is) with every exit's decoder (its checks and round costs), predicted by the benchmark's
    formula at each gamma whose whole-set costs were probed, over the fastest predicted
    single exit at any gamma. No threshold rule beats this oracle at the same gamma; None
    with one exit or without a whole-set and a single-exit probe."""
    exits = tuple(stats.exits)
    if len(exits) < 2:
        return None
    probed = [parse_setting_key(k) for k in costs["settings"]]
    singles = [predict_config(stats, costs, [0.0], g, ex) for ex, g in probed
               if len(ex) == 1 and ex[0] in exits]
    chosen = oracle_exits(stats)
    oracle = [predict_config(stats, costs, [0.0] * len(exits), g, exits, chosen=chosen)
              for ex, g in sorted(probed, key=lambda p: p[1]) if ex == exits]
    singles, oracle = [r for r in singles if r], [r for r in oracle if r]
    if not singles or not oracle:
        return None
    best = max(singles, key=lambda r: r["predicted_speedup"])
    top = max(oracle, key=lambda r: r["predicted_speedup"])
    keep = ("gamma", "predicted_speedup", "mean_accepted_tokens", "exit_usage")
    return {"best_single": {k: best[k] for k in ("exits",) + keep},
            "oracle": [{k: r[k] for k in keep} for r in oracle],
            "ceiling_over_best_single": top["predicted_speedup"] / best["predicted_speedup"]}


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


def pick_setting(rows: list[dict], min_gain: float, default_gamma: int = DEFAULT_GAMMA,
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


def accuracy_by_confidence(exits, correct: np.ndarray, conf: np.ndarray,
                           levels=(0.3, 0.5, 0.7, 0.9)) -> dict:
    """Per exit and confidence level: the share of tokens at least that confident and the
    exit's greedy accuracy on them. Escalation can pay only where a shallow exit's confident
    tokens are accurate AND the deeper exit is clearly more accurate on the rest."""
    out = {}
    for j, e in enumerate(exits):
        rows = {}
        for t in levels:
            sure = conf[:, j] >= t
            rows[f"{t:g}"] = {"share": float(sure.mean()),
                              "accuracy": float(correct[sure, j].mean()) if sure.any() else None}
        out[str(e)] = rows
    return out


def calibration_report(stats: ExitStats, costs: dict, measured: list[dict], *, target: str,
                       prompts: int) -> dict:
    """Every measured setting (predicted vs measured), the best predicted thresholds of every
    (exit subset, gamma), each exit's greedy acceptance along the trajectories and the
    round costs: why calibration chose what it chose."""
    best = {}
    for r in rank_configs(stats, costs):  # best first: keep the first of each setting
        best.setdefault(setting_key(r["exits"], r["gamma"]), r)
    correct, conf = np.concatenate(stats.correct), np.concatenate(stats.conf)
    return {"target": target, "exits": list(stats.exits), "prompts": prompts,
            "exit_accuracy": dict(zip(map(str, stats.exits), correct.mean(0).tolist())),
            "exit_accuracy_by_confidence": accuracy_by_confidence(stats.exits, correct, conf),
            "measured": measured,
            "best_predicted_per_setting": [
                {k: r[k] for k in ("exits", "thresholds", "gamma", "predicted_speedup",
                                   "mean_accepted_tokens", "exit_usage")}
                for r in best.values()],
            "oracle_ceiling": oracle_ceiling(stats, costs),
            "costs": costs}
