"""The methods ranked for one target and draft (issue 69): every method of the table that
the calibration can set up -- AR, the lookup, SD at each draft exit, S2D and the ladder --
each at its calibrated setting in the target's s2d_serving.json (the table's defaults where
it has none), measured on the same prompts in one run (calibration.Calibration.run: every
prompt runs every method back to back, in an order rotated per prompt, median of --repeats
passes), ranked by tokens/s. Of the runs whose greedy output equals AR's, the fastest is
the target's default -- or a method it contains that it does not beat per prompt beyond
the noise (`pick`) -- the "default" section `--method auto` decodes with
(decode/auto_method.py).

Without this the ladder's calibration chose among ladder settings only, and on SmolLM2 the
calibrated ladder ran at 0.92x the lookup it contains. A method's own calibration picks its
setting; this picks among the methods, so the default never loses to a method it contains
on the calibration prompts.

SD runs at S2D's calibrated gamma (the draft length calibrated for this target and draft),
else the default one. Two runs that decode alike (S2D calibrated to one exit is SD at that
exit) run once, as the simpler method (table order). Self-drafting is left out: it drafts
with the target's own first layers, which no calibration here sets up.
"""

from __future__ import annotations

import datetime
import math

from s2d_jax.decode.methods import METHODS, proposer



def candidates(served: dict | None, draft_exits) -> list:
    """[MethodSpec] of every ranked method on this draft in the table's order (AR, the run
    speedups are over, first), runs that decode alike once."""
    from s2d_jax.bench.runner import MethodSpec
    from s2d_jax.decode.serving_config import resolve

    exits = tuple(int(e) for e in draft_exits)
    sd_gamma = (served or {}).get("gamma")  # S2D's calibrated draft length, if any
    out, seen = [], set()
    for method in METHODS:
        row = proposer(method)
        if row.self_draft or (row.needs_draft and not exits):
            continue
        if row.single_exit:
            runs = [(f"{method}@{e}", resolve(method, exits, served, exit=e, gamma=sd_gamma))
                    for e in exits]
        else:
            runs = [(method, resolve(method, exits, served))]
        for label, setting in runs:
            key = decodes_as(setting)
            if key not in seen:
                seen.add(key)
                out.append(MethodSpec.of(label, setting))
    return out


def decodes_as(s) -> tuple:
    """What a setting's decode depends on: S2D at one exit with threshold 0 drafts as SD at
    it; the lookup's fields matter only with a lookup rung."""
    look = s.proposer.lookup
    return (look, s.exits, s.thresholds, s.gamma, s.stop_threshold,
            s.ngram if look else None, s.lookup_len if look else None)


def setting_fields(spec) -> dict:
    """A run's setting as the "default" section stores it (auto_method.SETTING_FIELDS)."""
    s = spec.setting
    return {"exits": list(s.exits), "thresholds": None if s.thresholds is None
            else list(s.thresholds), "gamma": s.gamma, "stop_threshold": s.stop_threshold,
            "ngram": list(s.ngram), "lookup_len": s.lookup_len}


def paired(rows: list[dict], base: list[dict]) -> tuple[float, float]:
    """(mean, standard error) over prompts of one run's tokens/s over another's, prompt by
    prompt (both ran the same prompts side by side)."""
    ratios = [(len(r["token_ids"]) / r["seconds"]) / (len(b["token_ids"]) / b["seconds"])
              for r, b in zip(rows, base) if r["seconds"] > 0 and b["seconds"] > 0]
    n = len(ratios)
    mean = sum(ratios) / n if n else float("nan")
    var = sum((x - mean) ** 2 for x in ratios) / (n - 1) if n > 1 else float("nan")
    return mean, math.sqrt(var / n) if n > 1 else float("nan")


def rank(per: dict, specs) -> list[dict]:
    """One run's results {label: [per prompt]} -> a row per run, fastest first: its
    speedup over AR, exactness (greedy ids equal AR's) and tokens/s over the fastest exact
    run's, paired per prompt."""
    from s2d_jax.calibration.calibration import _speedups
    speed = _speedups(per)
    rows = [{"label": s.label, "method": s.method, "setting": setting_fields(s),
             "measured_speedup": speed[s.label]["speedup"], "exact": speed[s.label]["exact"],
             "measured_mat": speed[s.label]["mat"]} for s in specs]
    rows.sort(key=lambda r: (not r["exact"], -r["measured_speedup"]))
    best = rows[0]["label"]
    for r in rows:
        r["paired_over_best"], r["paired_se"] = paired(per[r["label"]], per[best])
    return rows


# what a method's rounds can do; a method whose set holds another's contains it (the ladder
# contains the lookup and S2D, S2D contains SD, every method contains AR)
FEATURES = ("proposes", "needs_draft", "exits", "lookup", "escalates")


def features(method: str) -> set:
    return {f for f in FEATURES if getattr(proposer(method), f)}


def pick(rows: list[dict]) -> dict:
    """The choice among exact ranked rows (rank's order, the fastest first): the fastest,
    unless a method it contains is as fast per prompt within the noise (its paired ratio to
    the fastest + 2 s.e. >= 1): then the simplest such (fewest features, then the fastest).
    A method that adds a rung must measurably pay for it: on SmolLM2 the ladder's 1.75x
    over the lookup's 1.49x in one run was the lookup at 1.05 +- 0.11 of it per prompt,
    and 0.92 +- 0.01 of it on 48 other questions."""
    best = rows[0]
    own = features(best["method"])
    tied = [r for r in rows if r is best or (features(r["method"]) <= own
            and r["paired_over_best"] + 2 * r["paired_se"] >= 1.0)]
    return min(tied, key=lambda r: (len(features(r["method"])), -r["measured_speedup"]))


def rank_methods(cal, served: dict | None) -> dict:
    """cal: a calibration.Calibration (target, draft, prompts loaded); served: the serving
    config the methods' settings come from. -> the "default" section: the winner and every
    exact run ranked (auto_method reads "ranking"), non-exact runs listed apart."""
    from s2d_jax.errors import S2DError

    specs = candidates(served, cal.exits)
    cal.log(f"[{cal.name}] ranking the methods on {len(cal.prompts)} prompts, side by side: "
            + ", ".join(s.label for s in specs))
    rows = rank(cal.run(cal.build(specs)), specs)
    for r in rows:
        cal.log(f"  {r['label']}: {r['measured_speedup']:.2f}x AR, "
                f"{r['paired_over_best']:.3f} +- {r['paired_se']:.3f} of the fastest "
                f"(paired){'' if r['exact'] else ' (NOT exact: dropped)'}")
    exact = [r for r in rows if r["exact"]]
    if not exact:
        raise S2DError("no method decoded exactly as AR in the ranking run (a "
                       "lossless-decoding bug); not writing a default")
    won = pick(exact)
    exact = [won] + [r for r in exact if r is not won]  # auto's order of preference
    return {"method": won["method"], "label": won["label"],
            "measured_speedup": won["measured_speedup"], "ranking": exact,
            "not_exact": [r["label"] for r in rows if not r["exact"]],
            "calibrated_on": {"prompts": len(cal.prompts), "questions": cal.opts.questions,
                              "max_new_tokens": cal.opts.max_new_tokens,
                              "repeats": cal.opts.repeats,
                              "utc": datetime.datetime.now(datetime.timezone.utc)
                              .strftime("%Y-%m-%dT%H:%M:%SZ")}}


def describe(section: dict) -> str:
    """One line for the user: the choice, and the fastest when that is another."""
    won, fastest = section["ranking"][0], max(section["ranking"],
                                             key=lambda r: r["measured_speedup"])
    line = f"auto decodes with {won['label']} ({won['measured_speedup']:.2f}x AR)"
    if fastest is not won:
        line += (f", which {fastest['label']} ({fastest['measured_speedup']:.2f}x) contains "
                 f"and does not beat per prompt ({won['paired_over_best']:.3f} +- "
                 f"{won['paired_se']:.3f} of it, paired)")
    return line

