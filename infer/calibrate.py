"""Calibrate S2D per-exit thresholds and gamma for a target; write TARGET_DIR/s2d_serving.json.

    python -m infer.calibrate --target l=models/demo/target-l --draft models/demo/draft \\
        --questions data/demo_calibration.jsonl --max-prompts 16

Greedy trajectories of the target + one draft pass give per-exit acceptance; a grid of
thresholds x gammas is ranked by the predicted speedup (Lemma 3.1 with measured costs);
every single exit at every gamma (vanilla SD), the best --check few multi-exit settings,
the best multi-exit one per gamma and the paper's 0.5/.../0 are measured for real
(interleaved with AR, median of --repeats passes per prompt); the --finalists fastest
(and the fastest single exit) are measured again and the fastest there is written, with
its speedup and the gain over 0.5/.../0 (a multi-exit setting only if it beats the
fastest single exit by --min-gain). The default prompts (data/demo_calibration.jsonl) are a dev
set of held-out speeches, disjoint from the benchmark's data/demo_questions.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys

from s2d_jax.errors import S2DError, cli_main

COST_SAMPLES = 5  # timed samples of every per-call cost probe (medians)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m infer.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, metavar="[NAME=]DIR")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--questions", default="data/demo_calibration.jsonl",
                    help="calibration prompts (default: the demo family's dev set)")
    ap.add_argument("--max-prompts", type=int, default=16)
    ap.add_argument("--categories", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gammas", default="2,3,4,5,6")
    ap.add_argument("--check", type=int, default=3, help="best predicted multi-exit settings to measure")
    ap.add_argument("--finalists", type=int, default=4,
                    help="fastest settings measured a second time; the choice is made there")
    ap.add_argument("--min-gain", type=float, default=0.03,
                    help="a multi-exit setting must beat the fastest single exit by this "
                    "fraction (about the run-to-run noise here) to be chosen")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed passes over the prompts and candidates (per prompt the "
                    "median): candidates often differ by a few percent, about the noise of "
                    "one run here, and the median drops a pass caught in a slow spell")
    ap.add_argument("--stops", default="0.2,0.3,0.4,0.5",
                    help="draft stop thresholds tried on the chosen setting (dynamic draft "
                    "length: stop drafting after a token less confident than this); '' = off")
    ap.add_argument("--chat-template", default="none", choices=("none", "vicuna"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--dry-run", action="store_true", help="print, do not write the config")
    return ap.parse_args(argv)


def _measure(decoders, prompts, max_new_tokens, max_len, eos, repeats):
    from s2d_jax import bench
    runs = bench.run_target(decoders, prompts, temperatures=[0.0],
                            max_new_tokens=max_new_tokens, max_len=max_len, eos_id=eos,
                            repeats=repeats)["runs"]
    per = runs[0.0]
    ar_tps = bench._aggregate(per["ar"])["tokens_per_second"]
    out = {}
    for label, rows in per.items():
        agg = bench._aggregate(rows)
        exact = all(r["token_ids"] == a["token_ids"] for r, a in zip(rows, per["ar"]))
        out[label] = {"speedup": agg["tokens_per_second"] / ar_tps, "exact": exact,
                      "mat": agg["mean_accepted_tokens"]}
    return out, per["ar"]


def _pick_stop(best, stops, decs, stats, costs, ar_per_token, prompts, args, max_len, eos,
               models, log):
    """The chosen setting at each draft stop threshold, measured against itself without
    one; a stop that wins is measured again with the setting without it and kept only if
    it wins there too (the best of several noisy runs is biased up)."""
    from s2d_jax import bench, calibrate
    cfg, params, d_cfg, d_params, width = models
    ex, th, g = tuple(best["exits"]), tuple(best["thresholds"]), best["gamma"]
    base = {**best, "stop_threshold": 0.0}
    specs = {f"stop{x}": bench.MethodSpec(f"stop{x}", "s2d", ex, th, g, x) for x in stops}
    decs = {"ar": decs["ar"], "base": decs[best["label"]],
            **bench.build_decoders(list(specs.values()), cfg, params, d_cfg, d_params,
                                   prompt_width=width)}
    log(f"[calibrate] draft stop thresholds {stops} on exits {list(ex)} gamma {g}")
    measured, _ = _measure(decs, prompts, args.max_new_tokens, max_len, eos, args.repeats)
    rows = [{**base, "measured_speedup": measured["base"]["speedup"]}]
    for label, spec in specs.items():
        if not measured[label]["exact"]:
            raise S2DError(f"S2D output differs from AR with draft stop {spec.stop} (a "
                           f"lossless-decoding bug); not writing a serving config")
        p = calibrate.predict_config(stats, costs, ar_per_token, th, g, ex, spec.stop)
        rows.append({**base, "label": label, "stop_threshold": spec.stop,
                     "measured_speedup": measured[label]["speedup"],
                     "measured_mat": measured[label]["mat"],
                     "predicted_speedup": p["predicted_speedup"] if p else None})
    for r in rows:
        log(f"  draft stop {r['stop_threshold']}: {r['measured_speedup']:.2f}x "
            f"(MAT {r.get('measured_mat', best.get('measured_mat', float('nan'))):.2f})")
    pick = calibrate.pick_stop(rows)
    if pick["stop_threshold"] == 0.0:
        return best
    again, _ = _measure({"ar": decs["ar"], "base": decs["base"], "pick": decs[pick["label"]]},
                        prompts, args.max_new_tokens, max_len, eos, args.repeats)
    log(f"  again: draft stop {pick['stop_threshold']} {again['pick']['speedup']:.2f}x, "
        f"none {again['base']['speedup']:.2f}x")
    if again["pick"]["speedup"] <= again["base"]["speedup"]:
        return best
    return {**pick, "first_run_speedup": pick["measured_speedup"],
            "measured_speedup": again["pick"]["speedup"]}


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from infer.generate import _ints, parse_targets
    (name, path), = parse_targets([args.target]).items()
    for what, p in (("target", path), ("draft", args.draft)):
        if not os.path.isdir(p):
            raise S2DError(f"{what} dir {p} does not exist")
    gammas = sorted(set(_ints(args.gammas)))
    if not gammas or min(gammas) < 1:
        raise S2DError(f"--gammas must be positive integers, got {args.gammas}")
    if args.max_new_tokens < 2 or min(args.check, args.repeats, args.finalists) < 1:
        raise S2DError("--max-new-tokens must be >= 2, --check, --repeats and --finalists "
                       ">= 1")
    if args.min_gain < 0:
        raise S2DError(f"--min-gain must be >= 0, got {args.min_gain}")
    try:
        stops = sorted({float(x) for x in args.stops.split(",") if x.strip()})
    except ValueError:
        stops = [-1.0]
    if any(not 0.0 < x < 1.0 for x in stops):
        raise S2DError(f"--stops must be comma-separated numbers in (0, 1), e.g. 0.2,0.3, "
                       f"or '' for none; got {args.stops!r}")

    from s2d_jax import bench, calibrate
    from s2d_jax.checkpoint import load_model
    from s2d_jax.prompts import encode_questions, read_questions
    from s2d_jax.tokenizer import load_tokenizer

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    cats = [c.strip() for c in args.categories.split(",")] if args.categories else None
    questions = read_questions(args.questions, cats, args.max_prompts)
    tok = load_tokenizer(path)
    prompts = encode_questions(tok, questions, args.chat_template)
    cfg, params, _ = load_model(path, dtype=args.dtype)
    d_cfg, d_params, extra = load_model(args.draft, dtype=args.dtype)
    exits = tuple(extra.get("s2d_exits") or [d_cfg.num_layers])
    if len(exits) < 2:
        raise S2DError(f"draft {args.draft} has a single exit; thresholds need a sorted "
                       f"draft with s2d_exits in its config.json")
    if d_cfg.vocab_size != cfg.vocab_size:
        raise S2DError(f"draft vocab_size {d_cfg.vocab_size} differs from the target's "
                       f"{cfg.vocab_size}; use a draft trained for this target")
    eos = tok.eos_id if tok.eos_id is not None else -1
    width = bench.round_up(max(len(p) for p in prompts), 16)
    max_len = min(bench.round_up(width + args.max_new_tokens + max(gammas) + 1, 64),
                  cfg.max_position_embeddings, d_cfg.max_position_embeddings)
    if width + args.max_new_tokens + max(gammas) + 1 > max_len:
        raise S2DError(f"prompts of {width} tokens + {args.max_new_tokens} new tokens do not "
                       f"fit the context of {max_len}; lower --max-new-tokens")

    log(f"[{name}] greedy AR trajectories on {len(prompts)} prompts")
    ar_spec = bench.MethodSpec("ar", "ar", gamma=0)
    ar_dec = bench.build_decoders([ar_spec], cfg, params, d_cfg, d_params, prompt_width=width)
    ar_runs = bench.run_target(ar_dec, prompts, temperatures=[0.0],
                               max_new_tokens=args.max_new_tokens, max_len=max_len,
                               eos_id=eos)["runs"][0.0]["ar"]
    stats = calibrate.exit_stats(d_cfg, d_params, exits, prompts,
                                 [r["token_ids"] for r in ar_runs], max_len)
    log(f"[{name}] measuring per-call costs inside jitted loops")
    # Per call, timed the way the decode loop runs them (call_costs.py): the target's AR
    # step and verification of gamma + 1 tokens for each gamma, and a draft step forced to
    # each exit of every exit subset (a deeper exit pays the escalation through the
    # shallower ones). Both sides of the predicted speedup are in-loop costs.
    from s2d_jax.call_costs import draft_step_probes, verify_probe
    at = dict(start=width, max_len=max_len)
    verify = {g: verify_probe(params, cfg, window=1, block=g, **at) for g in [0] + gammas}
    steps = {calibrate.exits_key(sub): draft_step_probes(d_params, d_cfg, sub, **at)
             for sub in calibrate.exit_subsets(exits)}
    probes = list(verify.values()) + [p for ps in steps.values() for p in ps]
    for _ in range(COST_SAMPLES):
        for p in probes:
            p.sample()
    costs = {"exit_costs": {k: [p.result() for p in ps] for k, ps in steps.items()},
             "target_verify": {str(g): verify[g].result() for g in gammas}}
    ar_per_token = verify[0].result()
    ranked = calibrate.rank_configs(stats, costs, ar_per_token, gammas)
    if not ranked:
        raise S2DError("no drafted tokens in the calibration run; use longer --max-new-tokens")
    paper_g = 4 if 4 in gammas else gammas[len(gammas) // 2]
    candidates = {"paper": bench.MethodSpec("paper", "s2d", exits,
                                            tuple(bench.paper_thresholds(len(exits))), paper_g)}
    # Measured for real: every single exit at every gamma (vanilla SD, the fallback the
    # calibrated setting must never lose to: measuring them all costs a few minutes, while
    # ranking them by predicted speed once left the fastest one out), the best few
    # predicted multi-exit settings and the best multi-exit one of each gamma.
    multi = [r for r in ranked if len(r["exits"]) > 1]
    picks = ([{"exits": [e], "thresholds": [0.0], "gamma": g} for e in exits for g in gammas]
             + multi[:args.check]
             + [next(r for r in multi if r["gamma"] == g) for g in gammas
                if any(r["gamma"] == g for r in multi)])
    for i, r in enumerate(picks):
        key = (tuple(r["exits"]), tuple(r["thresholds"]), r["gamma"])
        if key not in {(c.exits, c.thresholds, c.gamma) for c in candidates.values()}:
            candidates[f"cand{i}"] = bench.MethodSpec(f"cand{i}", "s2d", *key)
    log(f"[{name}] measuring {len(candidates)} settings: every single exit at every gamma, "
        f"the best {args.check} predicted multi-exit ones, the best multi-exit one per "
        f"gamma and 0.5/.../0")
    decs = bench.build_decoders([ar_spec] + list(candidates.values()), cfg, params, d_cfg,
                                d_params, prompt_width=width)
    measured, _ = _measure(decs, prompts, args.max_new_tokens, max_len, eos, args.repeats)
    rows = []
    for label, spec in candidates.items():
        m = measured[label]
        if not m["exact"]:
            raise S2DError(f"S2D output differs from AR for {label} (a lossless-decoding "
                           f"bug); not writing a serving config")
        p = calibrate.predict_config(stats, costs, ar_per_token, spec.thresholds, spec.gamma,
                                     spec.exits)
        rows.append({"label": label, "exits": list(spec.exits),
                     "thresholds": list(spec.thresholds), "gamma": spec.gamma,
                     "measured_speedup": m["speedup"], "measured_mat": m["mat"],
                     "predicted_speedup": p["predicted_speedup"] if p else None})
    for r in rows:
        log(f"  {r['label']}: exits {r['exits']} thresholds {r['thresholds']} gamma "
            f"{r['gamma']}: measured "
            f"{r['measured_speedup']:.2f}x (MAT {r['measured_mat']:.2f}), predicted "
            f"{r['predicted_speedup'] or float('nan'):.2f}x")
    final = calibrate.finalists(rows, args.finalists)
    log(f"[{name}] measuring the {len(final)} fastest again (and the fastest single exit)")
    again, _ = _measure({"ar": decs["ar"], **{r["label"]: decs[r["label"]] for r in final}},
                        prompts, args.max_new_tokens, max_len, eos, args.repeats)
    for r in final:
        r["first_run_speedup"], r["measured_speedup"] = (r["measured_speedup"],
                                                         again[r["label"]]["speedup"])
        log(f"  {r['label']}: exits {r['exits']} thresholds {r['thresholds']} gamma "
            f"{r['gamma']}: {r['first_run_speedup']:.2f}x, again {r['measured_speedup']:.2f}x")
    best = calibrate.pick_setting(final, args.min_gain)
    if stops:
        best = _pick_stop(best, stops, decs, stats, costs, ar_per_token, prompts, args,
                          max_len, eos, (cfg, params, d_cfg, d_params, width), log)
    paper = next(r for r in rows if r["label"] == "paper")
    record = calibrate.serving_record(path, args.draft, best, paper, args.questions,
                                      len(prompts), args.max_new_tokens)
    gain = best["measured_speedup"] / paper["measured_speedup"]
    print(f"{name}: exits {best['exits']} thresholds {best['thresholds']} gamma "
          f"{best['gamma']} draft stop {best.get('stop_threshold', 0.0)}: "
          f"{best['measured_speedup']:.2f}x vs AR, {gain:.2f}x the speedup of 0.5/.../0 "
          f"({paper['measured_speedup']:.2f}x)")
    if not args.dry_run:
        print(f"wrote {calibrate.write_serving_config(path, record)}")
    return 0


if __name__ == "__main__":
    main()
