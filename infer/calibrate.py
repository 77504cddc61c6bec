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
tried on it, kept only if they beat it by --min-gain twice. Last, AR, lookup, SD at each
exit, S2D and the ladder run side by side and the fastest exact one (or a method it
contains that it does not beat per prompt) is written as the target's default, which --method auto decodes with (python -m infer.calibrate_lookup
calibrates the lookup rungs and ranks again). The default prompts
(data/demo_calibration.jsonl) are a dev set of held-out speeches, disjoint from the
benchmark's data/demo_questions.jsonl.
"""

from __future__ import annotations

import dataclasses

from s2d_jax.cli.args import ArgumentParser, add_output, finite_number, target_paths
from s2d_jax.cli.flags import add
from s2d_jax.calibration.calibration import CalibrateOptions
from s2d_jax.errors import S2DError, cli_main

CMD = "calibrate"  # its s2d subcommand: the name its shared flags are defined for
# its own flags' defaults are the library's (the shared ones: s2d_jax/cli/flags.py, which
# tests/test_shared_flags.py holds to the library's too)
DEFAULT = {f.name: f.default for f in dataclasses.fields(CalibrateOptions)}


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.calibrate", description=__doc__)
    add(ap, "--target", CMD, required=True, paths=target_paths)
    add(ap, "--draft", CMD, required=True)
    for name in ("--questions", "--max-prompts", "--categories", "--max-new-tokens",
                 "--gammas"):
        add(ap, name, CMD)
    ap.add_argument("--check", type=int, default=DEFAULT["check"],
                    help="best predicted multi-exit settings to measure")
    ap.add_argument("--finalists", type=int, default=DEFAULT["finalists"],
                    help="fastest settings measured a second time; the choice is made there")
    ap.add_argument("--min-gain", type=finite_number, default=DEFAULT["min_gain"],
                    help="settings within this fraction of the fastest (about the run-to-run "
                    "noise here) count as equal and the one closest to the default (one exit, gamma 4) is chosen; a draft stop must "
                    "beat the setting without one by it")
    add(ap, "--repeats", CMD)
    add(ap, "--cost-samples", CMD)
    ap.add_argument("--probe-rounds", type=int, default=DEFAULT["probe_rounds"],
                    help="rounds per timing of a round-cost probe (default 48; on a target "
                    "whose step takes ~0.1 s, 12 keep a timing near a second)")
    add(ap, "--cost-every", CMD)
    ap.add_argument("--stops", default=",".join(map(str, DEFAULT["stops"])),
                    help="draft stop thresholds tried on the chosen setting (dynamic draft "
                    "length: stop drafting after a token less confident than this); '' = off")
    for name in ("--chat-template", "--dtype", "--dry-run"):
        add(ap, name, CMD)
    add_output(ap, "--report", default=None, metavar="JSON",
                    help="also write every measured setting (predicted vs measured), the best "
                    "predicted setting per exit subset and gamma, per-exit acceptance and the "
                    "round costs to this file")
    return ap.parse_args(argv)


def _validate(args) -> tuple[list[int], list[float]]:
    """The gammas and draft stops of the command line, or a one-line error."""
    from s2d_jax.cli.args import parse_ints as _ints
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


def options(args, gammas, stops) -> CalibrateOptions:
    """The checked flags as the library's options (same names)."""
    import dataclasses
    same = {f.name: getattr(args, f.name) for f in dataclasses.fields(CalibrateOptions)
            if f.name not in ("gammas", "stops")}
    return CalibrateOptions(**same, gammas=tuple(gammas), stops=tuple(stops))


def _check_outputs(args, target: str) -> None:
    """--report, and the serving config this writes into the target dir (its one output
    inside an input, by design), may overwrite no other input."""
    from s2d_jax.decode.serving_config import check_writable
    from s2d_jax.io.outputs import Output, check_outputs
    serving = None if args.dry_run else check_writable(target)
    check_outputs([Output("--report", args.report), Output("the serving config", serving)],
                  {"--draft": args.draft, "--questions": args.questions})
    check_outputs([Output("--report", args.report)], {"--target": target})


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from s2d_jax.cli.args import parse_targets
    (name, path), = parse_targets([args.target]).items()
    from s2d_jax.cli.args import check_models_exist
    check_models_exist([("--target", path), ("--draft", args.draft)])
    gammas, stops = _validate(args)
    _check_outputs(args, path)

    from s2d_jax.calibration.calibration_search import calibrate_target
    from s2d_jax.decode.serving_config import write_serving_config
    result = calibrate_target(options(args, gammas, stops), name, path, report=args.report)
    best, paper = result.best, result.paper
    print(f"{name}: exits {best['exits']} thresholds {best['thresholds']} gamma "
          f"{best['gamma']} draft stop {best.get('stop_threshold', 0.0)}: "
          f"{best['measured_speedup']:.2f}x vs AR, {result.gain_over_paper:.2f}x the speedup "
          f"of 0.5/.../0 ({paper['measured_speedup']:.2f}x)")
    from s2d_jax.calibration.method_ranking import describe, rank_methods
    from s2d_jax.decode.auto_method import SECTION
    # the methods ranked at their settings (lookup, ladder: the defaults until
    # infer.calibrate_lookup calibrates them and ranks again): --method auto's choice
    record = {**result.record, SECTION: rank_methods(result.calibration, result.record)}
    print(f"{name}: {describe(record[SECTION])}")
    if not args.dry_run:
        print(f"wrote {write_serving_config(path, record)}")
    return 0


if __name__ == "__main__":
    main()
