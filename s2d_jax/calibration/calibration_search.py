"""The calibration's search (python -m infer.calibrate, train.smollm2_draft): rank the
settings by the time model, measure the candidates against AR, measure the fastest again,
pick one (calibrate.pick_setting), then try draft stops on it. `calibrate_target` runs it
all and returns the serving config to write (decode/serving_config.py)."""

from __future__ import annotations

import dataclasses

from s2d_jax.calibration.calibration import CalibrateOptions, Calibration, stderr_log
from s2d_jax.errors import S2DError


@dataclasses.dataclass
class CalibrationResult:
    best: dict  # the chosen setting: exits, thresholds, gamma, stop_threshold, speedups
    paper: dict  # the paper's 0.5/.../0 as measured
    rows: list  # every measured setting
    record: dict  # the serving config (serving_config.serving_record)
    calibration: Calibration

    @property
    def gain_over_paper(self) -> float:
        return self.best["measured_speedup"] / self.paper["measured_speedup"]


def calibrate_target(opts: CalibrateOptions, name: str, path: str, log=stderr_log,
                     report: str | None = None) -> CalibrationResult:
    """Calibrate target `path` (named `name`) with its draft opts.draft; with `report`,
    the evidence is written there too. Writes no serving config: the caller does."""
    from s2d_jax.decode import serving_config
    cal = Calibration(opts, name, path, log)
    cal.measure_stats_and_costs()
    log_ceiling(cal)
    found = candidates(cal)
    log(f"[{name}] measuring {len(found)} settings: every single exit at every gamma, "
        f"the best {opts.check} predicted multi-exit ones, the best multi-exit one per "
        f"gamma and 0.5/.../0")
    best, paper, decs, rows = pick_setting(cal, found)
    if report:
        write_report(report, cal, rows)
    if opts.stops:
        best = pick_stop(cal, best, sorted(opts.stops), decs)
    record = serving_config.serving_record(path, opts.draft, best, paper, opts.questions,
                                           len(cal.prompts), opts.max_new_tokens)
    return CalibrationResult(best, paper, rows, record, cal)


def log_ceiling(cal: Calibration) -> None:
    """Escalation's ceiling at the measured costs (calibrate.oracle_ceiling): where it is
    below 1, no threshold can make the exits beat the fastest one alone."""
    from s2d_jax.calibration import calibrate
    out = calibrate.oracle_ceiling(cal.stats, cal.costs)
    if out is not None:
        b = out["best_single"]
        per_gamma = ", ".join(f"gamma {r['gamma']} {r['predicted_speedup']:.2f}x (MAT "
                              f"{r['mean_accepted_tokens']:.2f})" for r in out["oracle"])
        cal.log(f"[{cal.name}] an oracle drafting each token at the shallowest right exit, at "
                f"these round costs: predicted {out['ceiling_over_best_single']:.3f}x the "
                f"fastest single exit (exit {b['exits'][0]}, gamma {b['gamma']}, predicted "
                f"{b['predicted_speedup']:.2f}x AR, MAT {b['mean_accepted_tokens']:.2f}); "
                f"the oracle vs AR at {per_gamma}")


def candidates(cal: Calibration) -> dict:
    """label -> MethodSpec of every setting measured for real: 0.5/.../0, every single exit
    at every gamma (vanilla SD, the fallback the calibrated setting must never lose to:
    measuring them all costs a few minutes, while ranking them by predicted speed once left
    the fastest one out), the best `check` predicted multi-exit settings and the best
    multi-exit one of each gamma."""
    from s2d_jax.calibration import calibrate
    from s2d_jax.bench import runner as bench
    gammas, exits = cal.gammas, cal.exits
    ranked = calibrate.rank_configs(cal.stats, cal.costs)
    if not ranked:
        raise S2DError("no drafted tokens in the calibration run; use longer --max-new-tokens")
    p = cal.paper
    found = {"paper": bench.MethodSpec("paper", "s2d", p.exits, p.thresholds, p.gamma)}
    multi = [r for r in ranked if len(r["exits"]) > 1]
    picks = ([{"exits": [e], "thresholds": [0.0], "gamma": g} for e in exits for g in gammas]
             + multi[:cal.opts.check]
             + [next(r for r in multi if r["gamma"] == g) for g in gammas
                if any(r["gamma"] == g for r in multi)])
    for i, r in enumerate(picks):
        key = (tuple(r["exits"]), tuple(r["thresholds"]), r["gamma"])
        if key not in {(c.exits, c.thresholds, c.gamma) for c in found.values()}:
            found[f"cand{i}"] = bench.MethodSpec(f"cand{i}", "s2d", *key)
    return found


def require_exact(measured: dict, label: str, what: str) -> None:
    if not measured[label]["exact"]:
        raise S2DError(f"S2D output differs from AR for {what} (a lossless-decoding bug); "
                       f"not writing a serving config")


def _describe(r: dict) -> str:
    return f"  {r['label']}: exits {r['exits']} thresholds {r['thresholds']} gamma {r['gamma']}"


def pick_setting(cal: Calibration, found: dict) -> tuple[dict, dict, dict, list]:
    """(best, 0.5/.../0 row, decoders, every measured row): every candidate measured, the
    `finalists` fastest measured again, the choice made on the second run
    (calibrate.pick_setting)."""
    from s2d_jax.calibration import calibrate
    cal.keep_probes([(c.exits, c.gamma) for c in found.values()])
    decs = cal.build([cal.ar_spec] + list(found.values()))
    measured = cal.measure(decs, [(c.exits, c.gamma) for c in found.values()])
    rows = []
    for label, spec in found.items():
        m = measured[label]
        require_exact(measured, label, label)
        rows.append({"label": label, "exits": list(spec.exits),
                     "thresholds": list(spec.thresholds), "gamma": spec.gamma,
                     "measured_speedup": m["speedup"], "measured_mat": m["mat"],
                     **cal.predicted(spec.thresholds, spec.gamma, spec.exits,
                                     measured=(m["prefill_s"], measured["ar"]["prefill_s"]))})
    for r in rows:
        cal.log(f"{_describe(r)}: measured {r['measured_speedup']:.2f}x (MAT "
                f"{r['measured_mat']:.2f}), predicted "
                f"{r['predicted_speedup'] or float('nan'):.2f}x "
                f"(MAT {r['predicted_mat'] or float('nan'):.2f})")
    final = calibrate.finalists(rows, cal.opts.finalists)
    cal.log(f"[{cal.name}] measuring the {len(final)} fastest again (and the fastest single "
            f"exit)")
    again = cal.measure({"ar": decs["ar"], **{r["label"]: decs[r["label"]] for r in final}})
    for r in final:
        r["first_run_speedup"], r["measured_speedup"] = (r["measured_speedup"],
                                                         again[r["label"]]["speedup"])
        cal.log(f"{_describe(r)}: {r['first_run_speedup']:.2f}x, again "
                f"{r['measured_speedup']:.2f}x")
    best = calibrate.pick_setting(final, cal.opts.min_gain, default_gamma=cal.paper_gamma)
    return best, next(r for r in rows if r["label"] == "paper"), decs, rows


def pick_stop(cal: Calibration, best: dict, stops: list[float], decs: dict) -> dict:
    """The chosen setting at each draft stop threshold, measured against itself without
    one; a stop that wins by min_gain is measured again with the setting without it and
    kept only if it wins by min_gain there too (the best of several noisy runs is biased
    up)."""
    from s2d_jax.calibration import calibrate
    from s2d_jax.bench import runner as bench
    ex, th, g = tuple(best["exits"]), tuple(best["thresholds"]), best["gamma"]
    base = {**best, "stop_threshold": 0.0}
    specs = {f"stop{x}": bench.MethodSpec(f"stop{x}", "s2d", ex, th, g, x) for x in stops}
    decs = {"ar": decs["ar"], "base": decs[best["label"]], **cal.build(specs.values())}
    cal.log(f"[calibrate] draft stop thresholds {stops} on exits {list(ex)} gamma {g}")
    cal.add_one_step_costs(decs[f"stop{stops[0]}"], ex, g)
    measured = cal.measure(decs, [(ex, g)])
    rows = [{**base, "measured_speedup": measured["base"]["speedup"]}]
    for label, spec in specs.items():
        require_exact(measured, label, f"draft stop {spec.stop}")
        rows.append({**base, "label": label, "stop_threshold": spec.stop,
                     "measured_speedup": measured[label]["speedup"],
                     "measured_mat": measured[label]["mat"],
                     **cal.predicted(th, g, ex, spec.stop,
                                     measured=(measured[label]["prefill_s"],
                                               measured["ar"]["prefill_s"]))})
    for r in rows:
        cal.log(f"  draft stop {r['stop_threshold']}: {r['measured_speedup']:.2f}x "
                f"(MAT {r.get('measured_mat', best.get('measured_mat', float('nan'))):.2f})")
    pick = calibrate.pick_stop(rows, cal.opts.min_gain)
    if pick["stop_threshold"] == 0.0:
        return best
    return _confirm_stop(cal, best, pick, decs)


def _confirm_stop(cal: Calibration, best: dict, pick: dict, decs: dict) -> dict:
    """The picked stop measured again beside the setting without one: kept only if it
    wins by min_gain there too."""
    from s2d_jax.calibration import calibrate
    again = cal.measure({"ar": decs["ar"], "base": decs["base"], "pick": decs[pick["label"]]})
    cal.log(f"  again: draft stop {pick['stop_threshold']} {again['pick']['speedup']:.2f}x, "
            f"none {again['base']['speedup']:.2f}x")
    confirm = [{"stop_threshold": 0.0, "measured_speedup": again["base"]["speedup"]},
               {"stop_threshold": pick["stop_threshold"],
                "measured_speedup": again["pick"]["speedup"]}]
    if calibrate.pick_stop(confirm, cal.opts.min_gain)["stop_threshold"] == 0.0:
        return best
    return {**pick, "first_run_speedup": pick["measured_speedup"],
            "measured_speedup": again["pick"]["speedup"]}


def write_report(path: str, cal: Calibration, rows: list) -> None:
    """The evidence behind the choice, for reading without rerunning (--report)."""
    import json

    from s2d_jax.calibration import calibrate
    from s2d_jax.io.atomic import write_atomic
    write_atomic(path, json.dumps(calibrate.calibration_report(
        cal.stats, cal.costs, rows, target=cal.name, prompts=len(cal.prompts)),
        indent=1, default=float))
    cal.log(f"wrote {path}")
