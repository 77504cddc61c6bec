"""The data-scaling study's report: the table, the fitted trends and the plot.

    python -m infer.scaling_report --points runs/scaling/points.jsonl --out runs/scaling/report

--points: JSON lines, one trained draft's held-out agreement at one exit each:
    {"shape": "4 layers", "kind": "on_policy" | "teacher_forced", "tokens": 200000,
     "exit": 4, "agreement": 0.251, "se": 0.008}
(`se`: the agreement's standard error, as `infer.agreement` writes it: agreement_se).
Writes OUT/table.md (every point; per series of >= 3 points its fit agreement = a + b
log10 tokens and the tokens it needs for --levels), OUT/fits.json and OUT/scaling.png
(s2d_jax/bench/scaling.py). The files are rewritten on every run (derived from --points).
"""

from __future__ import annotations

import os

from infer.args import ArgumentParser, check_output_path, parse_floats, path_arg
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import DIR, Output, check_outputs


def parse_args(argv):
    ap = ArgumentParser(prog="python -m infer.scaling_report", description=__doc__)
    ap.add_argument("--points", required=True, type=path_arg, help="the study's points (JSON lines)")
    ap.add_argument("--out", required=True, type=path_arg, help="report dir (table.md, fits.json, scaling.png)")
    ap.add_argument("--levels", default="0.35,0.45",
                    help="agreement levels to predict the needed tokens for")
    args = ap.parse_args(argv)
    args.levels = parse_floats(args.levels, "--levels", nonempty=True)
    if not all(0 < v < 1 for v in args.levels):
        raise S2DError(f"--levels must lie in (0, 1), got {args.levels}")
    check_outputs([Output("--out", args.out, DIR)], {"--points": args.points})
    check_output_path(args.out, is_dir=True)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise S2DError(f"--out {args.out} is a file; pass a directory for the report")
    return args


@cli_main
def main(argv=None):
    from s2d_jax.bench.scaling import read_points, write_report

    args = parse_args(argv)
    lines, wrote = write_report(read_points(args.points), args.out, tuple(args.levels))
    print("\n".join(lines))
    print(wrote)
    return 0

if __name__ == "__main__":
    main()
