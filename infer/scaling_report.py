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

import json
import os

from infer.args import ArgumentParser, check_output_path, parse_floats, path_arg
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.atomic import write_atomic
from s2d_jax.io.outputs import DIR, Output, check_outputs
from s2d_jax.readers import parse_json, read_text

FIELDS = ("shape", "kind", "tokens", "exit", "agreement", "se")


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


def read_points(path: str):
    from s2d_jax.bench.scaling import Point, check_point

    points = []
    for n, line in enumerate(read_text(path, "points file").splitlines(), 1):
        if not line.strip():
            continue
        row = parse_json(line, path, "points file", n)
        if not isinstance(row, dict) or set(FIELDS) - set(row):
            raise S2DError(f"points file {path}:{n} needs the fields {list(FIELDS)}; "
                           "see python -m infer.scaling_report --help")
        if isinstance(row["tokens"], bool) or isinstance(row["exit"], bool) \
                or not isinstance(row["exit"], int):
            raise S2DError(f"points file {path}:{n}: tokens and exit must be integers")
        points.append(check_point(Point(**{k: row[k] for k in FIELDS}), f"points file {path}:{n}"))
    if not points:
        raise S2DError(f"points file {path} has no points; run the study first")
    return points


@cli_main
def main(argv=None):
    from s2d_jax.bench import scaling
    from s2d_jax.bench.report import PLOT_EXTRA

    args = parse_args(argv)
    points = read_points(args.points)
    fits = {}
    for (shape, kind, ex), pts in scaling.series(points).items():
        if len(pts) >= 3:
            f = scaling.fit_log_linear(pts)
            fits[f"{shape} | {kind} | exit {ex}"] = {
                "a": f.a, "b": f.b, "cov": f.cov.tolist(), "chi2_dof": f.chi2_dof,
                "token_range": list(f.token_range),
                "tokens_for": {str(v): list(f.tokens_for(v)) for v in args.levels}}
    lines = scaling.table_lines(points, tuple(args.levels))
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "table.md"), "\n".join(lines) + "\n")
    write_atomic(os.path.join(args.out, "fits.json"), json.dumps(fits, indent=1) + "\n")
    print("\n".join(lines))
    if scaling.plot(points, os.path.join(args.out, "scaling.png")):
        print(f"wrote {args.out}/table.md, fits.json, scaling.png")
    else:
        print(f"wrote {args.out}/table.md, fits.json; scaling.png skipped: matplotlib is not "
              f"installed ({PLOT_EXTRA})")
    return 0

if __name__ == "__main__":
    main()
