"""The data-scaling study's report: the table, the fitted trends and the plot.

    python -m infer.scaling_report --points runs/scaling/points.jsonl --out runs/scaling/report

--points: JSON lines, one trained draft's held-out agreement at one exit each:
    {"shape": "4 layers", "kind": "on_policy" | "teacher_forced", "tokens": 200000,
     "exit": 4, "agreement": 0.251, "se": 0.008}
(`se`: the agreement's standard error, as `infer.agreement` writes it: agreement_se;
optional: "prompt_hits"/"prompt_tokens" per held-out prompt, and "recipe": a draft trained
other than by the study's recipe, e.g. "one pass over the corpus", its own series and
marker, so it never bends the study's trends).
Writes OUT/table.md (every point; per series of >= 3 points its fit agreement = a + b
log10 tokens and the tokens it needs for --levels), OUT/fits.json and OUT/scaling.png
(s2d_jax/bench/scaling.py). The files are rewritten on every run (derived from --points).
"""

from __future__ import annotations

import os

from s2d_jax.cli.args import ArgumentParser, add_input, parse_floats
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import DIR

CMD = "scaling-report"  # its s2d subcommand: the name its shared flags are defined for


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.scaling_report", description=__doc__)
    add_input(ap, "--points", required=True, help="the study's points (JSON lines)")
    add(ap, "--out", CMD, kind=DIR, required=True)
    add(ap, "--levels", CMD)
    args = ap.parse_args(argv)
    args.levels = parse_floats(args.levels, "--levels", nonempty=True)
    if not all(0 < v < 1 for v in args.levels):
        raise S2DError(f"--levels must lie in (0, 1), got {args.levels}")
    return args


@cli_main
def main(argv=None):
    from s2d_jax.bench.scaling import read_points, write_report

    from s2d_jax.io.atomic import files_dir
    args = parse_args(argv)
    points = read_points(args.points)
    with files_dir(args.out, args.s2d_prog):
        lines, wrote = write_report(points, args.out, tuple(args.levels))
    print("\n".join(lines))
    print(wrote)
    return 0

if __name__ == "__main__":
    main()
