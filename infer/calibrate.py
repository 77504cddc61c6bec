"""Calibrate S2D per-exit thresholds and gamma for a target; write TARGET_DIR/s2d_serving.json.

    python -m infer.calibrate --target l=models/demo/target-l --draft models/demo/draft \\
        --questions data/demo_calibration.jsonl --max-prompts 16

Greedy trajectories of the target + one draft pass give per-exit acceptance; a grid of
thresholds x gammas is ranked by the benchmark's predicted speedup (round costs timed
inside the engine's decode loop, s2d_jax/bench/loop_costs.py, re-timed between the prompts
of the runs that measure a setting, whose prediction then uses them);
every single exit at every gamma (vanilla SD), the best --check few multi-exit settings,
the best multi-exit one per gamma and the paper's 0.5/.../0 are measured for real
(interleaved with AR, median of --repeats passes per prompt); the --finalists fastest
(and the fastest single exit) are measured again, and the setting closest to the default
(one exit, gamma 4) within --min-gain of the fastest there is written, with its speedup and the gain over 0.5/.../0. Draft stops (--stops) are then
tried on it, kept only if they beat it by --min-gain twice. The default prompts
(data/demo_calibration.jsonl) are a dev set of held-out speeches, disjoint from the
benchmark's data/demo_questions.jsonl.
"""

from __future__ import annotations

import os
import sys

from infer.args import ArgumentParser, finite_number, path_arg
from s2d_jax.errors import S2DError, cli_main

COST_SAMPLES = 5  # timed samples of every round-cost probe (medians)


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.calibrate", description=__doc__)
    ap.add_argument("--target", required=True, metavar="[NAME=]DIR",
                    help="the target to calibrate")
    ap.add_argument("--draft", required=True, type=path_arg, help="its sorted draft")
    ap.add_argument("--questions", default="data/demo_calibration.jsonl", type=path_arg,
                    help="calibration prompts (default: the demo family's dev set)")
    ap.add_argument("--max-prompts", type=int, default=16, help="prompts to use at most")
    ap.add_argument("--categories", default=None,
                    help="comma-separated categories or tasks to keep (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="new tokens per answer at most")
    ap.add_argument("--gammas", default="2,3,4,5,6", help="draft lengths to try")
    ap.add_argument("--check", type=int, default=3, help="best predicted multi-exit settings to measure")
    ap.add_argument("--finalists", type=int, default=4,
                    help="fastest settings measured a second time; the choice is made there")
    ap.add_argument("--min-gain", type=finite_number, default=0.03,
                    help="settings within this fraction of the fastest (about the run-to-run "
                    "noise here) count as equal and the one closest to the default (one exit, gamma 4) is chosen; a draft stop must "
                    "beat the setting without one by it")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed passes over the prompts and candidates (per prompt the "
                    "median): candidates often differ by a few percent, about the noise of "
                    "one run here, and the median drops a pass caught in a slow spell")
    ap.add_argument("--cost-samples", type=int, default=COST_SAMPLES,
                    help=f"timed samples of every setting's round-cost probe before ranking "
                    f"(default {COST_SAMPLES}; each runs 48 rounds per exit)")
    ap.add_argument("--probe-rounds", type=int, default=48,
                    help="rounds per timing of a round-cost probe (default 48; on a target "
                    "whose step takes ~0.1 s, 12 keep a timing near a second)")
    ap.add_argument("--cost-every", type=int, default=1,
                    help="re-time the measured settings' round-cost probes after every K-th "
                    "prompt (default 1; each sample runs --probe-rounds rounds per exit)")
    ap.add_argument("--stops", default="0.2,0.3,0.4,0.5",
                    help="draft stop thresholds tried on the chosen setting (dynamic draft "
                    "length: stop drafting after a token less confident than this); '' = off")
    ap.add_argument("--chat-template", default="auto", choices=("auto", "none", "vicuna"),
                    help="auto: the tokenizer's own template, else none (default auto)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute and weight dtype")
    ap.add_argument("--dry-run", action="store_true", help="print, do not write the config")
    ap.add_argument("--report", default=None, metavar="JSON", type=path_arg,
                    help="also write every measured setting (predicted vs measured), the best "
                    "predicted setting per exit subset and gamma, per-exit acceptance and the "
                    "round costs to this file")
    return ap.parse_args(argv)


def _validate(args) -> tuple[list[int], list[float]]:
    """The gammas and draft stops of the command line, or a one-line error."""
    from infer.args import parse_ints as _ints
    gammas = sorted(set(_ints(args.gammas)))
    if not gammas or min(gammas) < 1:
        raise S2DError(f"--gammas must be positive integers, got {args.gammas}")
    if args.max_new_tokens < 2 or min(args.check, args.repeats, args.finalists,
                                       args.cost_samples, args.cost_every) < 1:
        raise S2DError("--max-new-tokens must be >= 2, --check, --repeats, --finalists, "
                       "--cost-samples and --cost-every >= 1")
    if args.probe_rounds < 2:
        raise S2DError(f"--probe-rounds must be >= 2, got {args.probe_rounds}")
    if args.min_gain < 0:
        raise S2DError(f"--min-gain must be >= 0, got {args.min_gain}")
    try:
        stops = sorted({float(x) for x in args.stops.split(",") if x.strip()})
    except ValueError:
        stops = [-1.0]
    if any(not 0.0 < x < 1.0 for x in stops):
        raise S2DError(f"--stops must be comma-separated numbers in (0, 1), e.g. 0.2,0.3, "
                       f"or '' for none; got {args.stops!r}")
    return gammas, stops


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class Calibration:
    """One target + draft on the calibration prompts: builds decoders, measures them
    against AR in one interleaved run, and holds the acceptance statistics and costs the
    predictions use (set by `measure_stats_and_costs`)."""

    def __init__(self, args, name, path, gammas):
        from s2d_jax.bench import runner as bench
        from s2d_jax.decode.defaults import buffer_len, draft_exits, prompt_width
        from s2d_jax.io.checkpoint import load_model
        from s2d_jax.data.prompts import (encode_questions, end_of_turn_id, read_questions,
                                          resolve_template)
        from s2d_jax.io.tokenizer import load_tokenizer

        self.args, self.name, self.path, self.gammas = args, name, path, gammas
        # The paper's gamma, also the default one keeps unless another measurably pays.
        self.paper_gamma = 4 if 4 in gammas else gammas[len(gammas) // 2]
        cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
        questions = read_questions(args.questions, cats, args.max_prompts)
        tok = load_tokenizer(path)
        template, note = resolve_template(tok, args.chat_template, fallback="none")
        if note:
            log(note)
        self.prompts = encode_questions(tok, questions, template)
        self.cfg, self.params, _ = load_model(path, dtype=args.dtype)
        from s2d_jax.io.checkpoint import load_draft
        self.d_cfg, self.d_params, extra = load_draft(args.draft, self.params,
                                                      dtype=args.dtype)
        self.exits = draft_exits(extra, self.d_cfg)
        if len(self.exits) < 2:
            raise S2DError(f"draft {args.draft} has a single exit; thresholds need a sorted "
                           f"draft with s2d_exits in its config.json")
        if self.d_cfg.vocab_size != self.cfg.vocab_size:
            raise S2DError(f"draft vocab_size {self.d_cfg.vocab_size} differs from the "
                           f"target's {self.cfg.vocab_size}; use a draft trained for this "
                           f"target")
        self.eos = end_of_turn_id(tok, template)
        self.width = prompt_width(max(len(p) for p in self.prompts))
        need = self.width + args.max_new_tokens + max(gammas) + 1
        self.max_len = buffer_len(self.width, args.max_new_tokens, max(gammas) + 1,
                                  min(self.cfg.max_position_embeddings,
                                      self.d_cfg.max_position_embeddings))
        if need > self.max_len:
            raise S2DError(f"prompts of {self.width} tokens + {args.max_new_tokens} new "
                           f"tokens do not fit the context of {self.max_len}; lower "
                           f"--max-new-tokens")
        self.ar_spec = bench.MethodSpec("ar", "ar", gamma=0)

    def build(self, specs) -> dict:
        from s2d_jax.bench import runner as bench
        return bench.build_decoders(list(specs), self.cfg, self.params, self.d_cfg,
                                    self.d_params, prompt_width=self.width)

    def run(self, decoders, repeats=None, between=None) -> dict:
        from s2d_jax.bench import runner as bench
        return bench.run_target(decoders, self.prompts, temperatures=[0.0],
                                max_new_tokens=self.args.max_new_tokens,
                                max_len=self.max_len, eos_id=self.eos,
                                repeats=repeats or self.args.repeats,
                                between=between)["runs"][0.0]

    def measure(self, decoders, probe_settings=()) -> dict:
        """label -> speedup vs AR (decoders["ar"], same run), exactness, MAT and the
        run's prefill seconds.

        probe_settings: (exits, gamma) of the settings measured; their round-cost probes
        and AR's are timed afresh after every --cost-every-th prompt (so costs and runs see
        the same machine, as in the benchmark) and replace those settings' costs."""
        from s2d_jax.bench import calibrate
        from s2d_jax.bench import runner as bench
        keys = list(dict.fromkeys(calibrate.setting_key(e, g) for e, g in probe_settings))
        self.ensure_probes(keys)
        probes = [self.probes[k] for k in ["ar"] + keys] if keys else []
        for p in probes:
            p.reset()
        done = []

        def between():
            done.append(1)
            if probes and (len(done) % self.args.cost_every == 0 or not probes[0].prefill_s):
                for p in probes:
                    p.sample()

        per = self.run(decoders, between=between)
        if keys:
            self.costs["ar"] = self.probes["ar"].result()
            self.costs["settings"].update({k: self.probes[k].result() for k in keys})
        ar_tps = bench._aggregate(per["ar"])["tokens_per_second"]
        out = {}
        for label, rows in per.items():
            agg = bench._aggregate(rows)
            exact = all(r["token_ids"] == a["token_ids"] for r, a in zip(rows, per["ar"]))
            out[label] = {"speedup": agg["tokens_per_second"] / ar_tps, "exact": exact,
                          "mat": agg["mean_accepted_tokens"],
                          "prefill_s": agg["prefill_seconds"]}
        return out

    def measure_stats_and_costs(self) -> None:
        from s2d_jax.bench import calibrate
        from s2d_jax.bench import runner as bench
        log(f"[{self.name}] greedy AR trajectories on {len(self.prompts)} prompts")
        ar = self.build([self.ar_spec])
        ar_runs = self.run(ar, repeats=1)["ar"]
        self.stats = calibrate.exit_stats(self.d_cfg, self.d_params, self.exits, self.prompts,
                                          [r["token_ids"] for r in ar_runs], self.max_len)
        # The benchmark's costs (loop_costs.py): the compiled prefill and round loop of AR,
        # of every single exit and of the whole set at every gamma, rounds forced to each
        # exit, timed inside the decode loop at the generation's buffer length; the other
        # subsets' costs follow from these (calibrate.derive_subset_costs).
        self.probes = {"ar": self.probe(ar["ar"])}
        keys = [calibrate.setting_key(sub, g) for sub in calibrate.probed_subsets(self.exits)
                for g in self.gammas]
        log(f"[{self.name}] timing rounds inside the decode loop: AR and {len(keys)} exit "
            f"subset x gamma settings ({self.args.probe_rounds} rounds per timing)")
        self.ensure_probes(keys, sample=False)
        for _ in range(self.args.cost_samples):
            for p in self.probes.values():
                p.sample()
        probed = {key: p.result() for key, p in self.probes.items() if key != "ar"}
        self.costs = {"ar": self.probes["ar"].result(),
                      "settings": calibrate.derive_subset_costs(probed, self.exits,
                                                                self.gammas)}

    def ensure_probes(self, keys, sample: bool = True) -> None:
        """Compile a round-cost probe for every setting key without one (sampled
        --cost-samples times unless `sample` is False), so a setting measured for real is
        predicted from its own costs, not derived ones."""
        from s2d_jax.bench import calibrate
        from s2d_jax.bench import runner as bench
        missing = [k for k in dict.fromkeys(keys) if k not in self.probes]
        if not missing:
            return
        specs = []
        for key in missing:
            sub, g = calibrate.parse_setting_key(key)
            specs.append(bench.MethodSpec(key, "s2d", sub, (0.0,) * len(sub), g))
        for key, dec in self.build(specs).items():
            self.probes[key] = self.probe(dec)
            if sample:
                for _ in range(self.args.cost_samples):
                    self.probes[key].sample()
                self.costs["settings"][key] = self.probes[key].result()

    def keep_probes(self, settings) -> None:
        """Free the compiled probes of settings no longer measured: each holds JIT code
        pages, and 60 probes plus the measured decoders exhausted LLVM's section memory
        ("Unable to allocate section memory") in one process. Their costs stay."""
        import gc

        import jax
        from s2d_jax.bench import calibrate
        keep = {"ar"} | {calibrate.setting_key(e, g) for e, g in settings}
        self.probes = {k: p for k, p in self.probes.items() if k in keep}
        jax.clear_caches()
        gc.collect()

    def probe(self, decoder):
        from s2d_jax.bench.loop_costs import LoopProbe
        return LoopProbe(decoder, self.prompts[0], max_len=self.max_len,
                         rounds=self.args.probe_rounds)

    def add_one_step_costs(self, decoder, exits, gamma) -> None:
        """Round costs of a decoder with a draft stop (its probe also times one-step
        rounds), for predictions of that setting with a stop."""
        from s2d_jax.bench import calibrate
        key = calibrate.setting_key(exits, gamma)
        self.probes[key] = self.probe(decoder)
        for _ in range(self.args.cost_samples):
            self.probes[key].sample()
        self.costs["settings"][key] = self.probes[key].result()

    def predicted(self, thresholds, gamma, exits, stop=0.0, measured=None) -> dict:
        """{"predicted_speedup", "predicted_mat"} of a setting (None each without drafts);
        `measured`: (the setting's, AR's) prefill seconds in the run it is compared with."""
        from s2d_jax.bench import calibrate
        pre, ar_pre = measured or (None, None)
        p = calibrate.predict_config(self.stats, self.costs, thresholds, gamma, exits, stop,
                                     prefill_s=pre, ar_prefill_s=ar_pre)
        return {"predicted_speedup": p["predicted_speedup"] if p else None,
                "predicted_mat": p["mean_accepted_tokens"] if p else None}


def _candidates(cal: Calibration) -> dict:
    """label -> MethodSpec of every setting measured for real: 0.5/.../0, every single exit
    at every gamma (vanilla SD, the fallback the calibrated setting must never lose to:
    measuring them all costs a few minutes, while ranking them by predicted speed once left
    the fastest one out), the best --check predicted multi-exit settings and the best
    multi-exit one of each gamma."""
    from s2d_jax.bench import runner as bench
    from s2d_jax.bench import calibrate
    gammas, exits = cal.gammas, cal.exits
    ranked = calibrate.rank_configs(cal.stats, cal.costs)
    if not ranked:
        raise S2DError("no drafted tokens in the calibration run; use longer --max-new-tokens")
    candidates = {"paper": bench.MethodSpec("paper", "s2d", exits,
                                            tuple(bench.paper_thresholds(len(exits))),
                                            cal.paper_gamma)}
    multi = [r for r in ranked if len(r["exits"]) > 1]
    picks = ([{"exits": [e], "thresholds": [0.0], "gamma": g} for e in exits for g in gammas]
             + multi[:cal.args.check]
             + [next(r for r in multi if r["gamma"] == g) for g in gammas
                if any(r["gamma"] == g for r in multi)])
    for i, r in enumerate(picks):
        key = (tuple(r["exits"]), tuple(r["thresholds"]), r["gamma"])
        if key not in {(c.exits, c.thresholds, c.gamma) for c in candidates.values()}:
            candidates[f"cand{i}"] = bench.MethodSpec(f"cand{i}", "s2d", *key)
    return candidates


def _require_exact(measured: dict, label: str, what: str) -> None:
    if not measured[label]["exact"]:
        raise S2DError(f"S2D output differs from AR for {what} (a lossless-decoding bug); "
                       f"not writing a serving config")


def _pick_setting(cal: Calibration, candidates: dict) -> tuple[dict, dict, dict, list]:
    """(best, 0.5/.../0 row, decoders, every measured row): every candidate measured, the
    --finalists fastest measured again, the choice made on the second run
    (calibrate.pick_setting)."""
    from s2d_jax.bench import calibrate
    cal.keep_probes([(c.exits, c.gamma) for c in candidates.values()])
    decs = cal.build([cal.ar_spec] + list(candidates.values()))
    measured = cal.measure(decs, [(c.exits, c.gamma) for c in candidates.values()])
    rows = []
    for label, spec in candidates.items():
        m = measured[label]
        _require_exact(measured, label, label)
        rows.append({"label": label, "exits": list(spec.exits),
                     "thresholds": list(spec.thresholds), "gamma": spec.gamma,
                     "measured_speedup": m["speedup"], "measured_mat": m["mat"],
                     **cal.predicted(spec.thresholds, spec.gamma, spec.exits,
                                     measured=(m["prefill_s"], measured["ar"]["prefill_s"]))})
    for r in rows:
        log(f"  {r['label']}: exits {r['exits']} thresholds {r['thresholds']} gamma "
            f"{r['gamma']}: measured {r['measured_speedup']:.2f}x (MAT "
            f"{r['measured_mat']:.2f}), predicted {r['predicted_speedup'] or float('nan'):.2f}x "
            f"(MAT {r['predicted_mat'] or float('nan'):.2f})")
    final = calibrate.finalists(rows, cal.args.finalists)
    log(f"[{cal.name}] measuring the {len(final)} fastest again (and the fastest single exit)")
    again = cal.measure({"ar": decs["ar"], **{r["label"]: decs[r["label"]] for r in final}})
    for r in final:
        r["first_run_speedup"], r["measured_speedup"] = (r["measured_speedup"],
                                                         again[r["label"]]["speedup"])
        log(f"  {r['label']}: exits {r['exits']} thresholds {r['thresholds']} gamma "
            f"{r['gamma']}: {r['first_run_speedup']:.2f}x, again {r['measured_speedup']:.2f}x")
    best = calibrate.pick_setting(final, cal.args.min_gain, default_gamma=cal.paper_gamma)
    return best, next(r for r in rows if r["label"] == "paper"), decs, rows


def _pick_stop(cal: Calibration, best: dict, stops: list[float], decs: dict) -> dict:
    """The chosen setting at each draft stop threshold, measured against itself without
    one; a stop that wins by --min-gain is measured again with the setting without it and
    kept only if it wins by --min-gain there too (the best of several noisy runs is biased
    up)."""
    from s2d_jax.bench import runner as bench
    from s2d_jax.bench import calibrate
    ex, th, g = tuple(best["exits"]), tuple(best["thresholds"]), best["gamma"]
    base = {**best, "stop_threshold": 0.0}
    specs = {f"stop{x}": bench.MethodSpec(f"stop{x}", "s2d", ex, th, g, x) for x in stops}
    decs = {"ar": decs["ar"], "base": decs[best["label"]], **cal.build(specs.values())}
    log(f"[calibrate] draft stop thresholds {stops} on exits {list(ex)} gamma {g}")
    cal.add_one_step_costs(decs[f"stop{stops[0]}"], ex, g)
    measured = cal.measure(decs, [(ex, g)])
    rows = [{**base, "measured_speedup": measured["base"]["speedup"]}]
    for label, spec in specs.items():
        _require_exact(measured, label, f"draft stop {spec.stop}")
        rows.append({**base, "label": label, "stop_threshold": spec.stop,
                     "measured_speedup": measured[label]["speedup"],
                     "measured_mat": measured[label]["mat"],
                     **cal.predicted(th, g, ex, spec.stop,
                                     measured=(measured[label]["prefill_s"],
                                               measured["ar"]["prefill_s"]))})
    for r in rows:
        log(f"  draft stop {r['stop_threshold']}: {r['measured_speedup']:.2f}x "
            f"(MAT {r.get('measured_mat', best.get('measured_mat', float('nan'))):.2f})")
    min_gain = cal.args.min_gain
    pick = calibrate.pick_stop(rows, min_gain)
    if pick["stop_threshold"] == 0.0:
        return best
    again = cal.measure({"ar": decs["ar"], "base": decs["base"], "pick": decs[pick["label"]]})
    log(f"  again: draft stop {pick['stop_threshold']} {again['pick']['speedup']:.2f}x, "
        f"none {again['base']['speedup']:.2f}x")
    confirm = [{"stop_threshold": 0.0, "measured_speedup": again["base"]["speedup"]},
               {"stop_threshold": pick["stop_threshold"],
                "measured_speedup": again["pick"]["speedup"]}]
    if calibrate.pick_stop(confirm, min_gain)["stop_threshold"] == 0.0:
        return best
    return {**pick, "first_run_speedup": pick["measured_speedup"],
            "measured_speedup": again["pick"]["speedup"]}


def _write_report(path: str, cal: Calibration, rows: list) -> None:
    """The evidence behind the choice, for reading without rerunning (--report)."""
    import json

    from s2d_jax.bench import calibrate
    from s2d_jax.io.atomic import write_atomic
    write_atomic(path, json.dumps(calibrate.calibration_report(
        cal.stats, cal.costs, rows, target=cal.name, prompts=len(cal.prompts)),
        indent=1, default=float))
    log(f"wrote {path}")


def _check_outputs(args, target: str) -> None:
    """--report, and the serving config this writes into the target dir (its one output
    inside an input, by design), may overwrite no other input."""
    from s2d_jax.decode.serving_config import serving_config_path
    from s2d_jax.io.outputs import Output, check_outputs
    serving = None if args.dry_run else serving_config_path(target)
    check_outputs([Output("--report", args.report), Output("the serving config", serving)],
                  {"--draft": args.draft, "--questions": args.questions})
    check_outputs([Output("--report", args.report)], {"--target": target})


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from infer.args import parse_targets
    (name, path), = parse_targets([args.target]).items()
    for what, p in (("target", path), ("draft", args.draft)):
        if not os.path.exists(p):  # a model dir or a .gguf file
            raise S2DError(f"{what} dir {p} does not exist")
    gammas, stops = _validate(args)
    _check_outputs(args, path)

    from s2d_jax.decode import serving_config
    cal = Calibration(args, name, path, gammas)
    cal.measure_stats_and_costs()
    candidates = _candidates(cal)
    log(f"[{name}] measuring {len(candidates)} settings: every single exit at every gamma, "
        f"the best {args.check} predicted multi-exit ones, the best multi-exit one per "
        f"gamma and 0.5/.../0")
    best, paper, decs, rows = _pick_setting(cal, candidates)
    if args.report:
        _write_report(args.report, cal, rows)
    if stops:
        best = _pick_stop(cal, best, stops, decs)
    record = serving_config.serving_record(path, args.draft, best, paper, args.questions,
                                           len(cal.prompts), args.max_new_tokens)
    gain = best["measured_speedup"] / paper["measured_speedup"]
    print(f"{name}: exits {best['exits']} thresholds {best['thresholds']} gamma "
          f"{best['gamma']} draft stop {best.get('stop_threshold', 0.0)}: "
          f"{best['measured_speedup']:.2f}x vs AR, {gain:.2f}x the speedup of 0.5/.../0 "
          f"({paper['measured_speedup']:.2f}x)")
    if not args.dry_run:
        print(f"wrote {serving_config.write_serving_config(path, record)}")
    return 0


if __name__ == "__main__":
    main()
