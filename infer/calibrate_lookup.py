"""Calibrate the lookup rung for a target: the n range, lookup length and gamma of `lookup`,
and of the `ladder` also the draft exit it climbs to; adds the "lookup" and "ladder"
sections to TARGET_DIR/s2d_serving.json (written by python -m infer.calibrate first).

    python -m infer.calibrate_lookup --target ~/.cache/s2d-jax/SmolLM2-135M-Instruct \\
        --draft models/smollm2-draft --questions data/spec_bench_question.jsonl --max-prompts 12

Every setting (n range x gamma, and for the ladder x lookup length x exit) is replayed on
the target's greedy answers and predicted by Lemma 3.1 from round costs timed inside the
decode loop; the --top best predicted of each method are measured against AR (interleaved,
median of --repeats passes) and the fastest exact one is written
(s2d_jax/calibration/lookup_calibration.py). The methods lookup-cal / ladder-cal of infer.bench
and --method lookup / ladder of infer.generate then use it.

Last, every method (AR, lookup, SD at each exit, S2D, the ladder) runs at its calibrated
setting on the same prompts, side by side, and the fastest exact one (or a method it
contains that it does not beat per prompt) is written as the target's default ("default"), which --method auto (the default of generate, chat, serve and
the API) decodes with (s2d_jax/calibration/method_ranking.py). --rank-only does only that,
with the stored settings.
"""

from __future__ import annotations

import json

from s2d_jax.cli.args import ArgumentParser, target_paths
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

CMD = "calibrate-lookup"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.calibrate_lookup", description=__doc__)
    add(ap, "--target", CMD, required=True, paths=target_paths)
    add(ap, "--draft", CMD, required=True)
    for name in ("--questions", "--max-prompts", "--max-new-tokens", "--gammas"):
        add(ap, name, CMD)
    ap.add_argument("--top", type=int, default=3,
                    help="best predicted settings of each method measured against AR")
    ap.add_argument("--rank-only", action="store_true",
                    help="keep the stored lookup and ladder settings; only rank the methods "
                    "at their stored settings and write the winner as the target's default")
    for name in ("--repeats", "--cost-samples", "--chat-template", "--dtype", "--dry-run"):
        add(ap, name, CMD)
    return ap.parse_args(argv)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from s2d_jax.cli.args import parse_ints, parse_targets
    (name, path), = parse_targets([args.target]).items()
    from s2d_jax.cli.args import check_models_exist
    check_models_exist([("--target", path), ("--draft", args.draft)])
    gammas = sorted(set(parse_ints(args.gammas, "--gammas", minimum=1)))
    if min(args.max_prompts, args.top, args.repeats, args.cost_samples) < 1 \
            or args.max_new_tokens < 2:
        raise S2DError("--max-prompts, --top, --repeats and --cost-samples must be >= 1, "
                       "--max-new-tokens >= 2")
    from s2d_jax.decode.serving_config import (check_writable, load_serving_config,
                                               serving_config_path, write_serving_config)
    served = load_serving_config(path)
    if served is None:
        raise S2DError(f"{serving_config_path(path)} does not exist; run python -m "
                       f"infer.calibrate first (the lookup's sections sit beside S2D's setting)")
    if not args.dry_run:  # before the minutes of measuring, not after them
        check_writable(path)

    from s2d_jax.calibration.calibration import CalibrateOptions, Calibration
    from s2d_jax.calibration.lookup_calibration import calibrate_lookup
    opts = CalibrateOptions(draft=args.draft, questions=args.questions,
                            max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens,
                            gammas=tuple(gammas), repeats=args.repeats,
                            cost_samples=args.cost_samples, chat_template=args.chat_template,
                            dtype=args.dtype)
    cal = Calibration(opts, name, path)
    from s2d_jax.readers import read_text
    record = json.loads(read_text(serving_config_path(path), "serving config"))
    if not args.rank_only:
        _add_lookup_sections(name, record, calibrate_lookup(cal, top=args.top))
    from s2d_jax.calibration.method_ranking import describe, rank_methods
    from s2d_jax.decode.auto_method import SECTION
    record[SECTION] = rank_methods(cal, record)  # the settings just written, or stored
    print(f"{name}: {describe(record[SECTION])}")
    if not args.dry_run:
        print(f"wrote {write_serving_config(path, record)}")
    return 0


def _add_lookup_sections(name: str, record: dict, found: dict) -> None:
    """The lookup calibration's measured rows printed, its sections put in the record."""
    for row in found["rows"]:
        print(f"{name}: {row['setting']}: predicted {row['predicted_speedup']:.2f}x, measured "
              f"{row['measured_speedup']:.2f}x vs AR, MAT {row['measured_mat']:.2f}"
              f"{'' if row['exact'] else ' (NOT exact: dropped)'}")
    from s2d_jax.decode.methods import methods_where
    for method in methods_where(lookup=True):
        if method in found:
            record[method] = found[method]
            print(f"{name}: {method}: {json.dumps(found[method])}")


if __name__ == "__main__":
    main()
