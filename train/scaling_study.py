"""The data-scaling study: held-out agreement per exit of drafts trained on more and more
unique supervised tokens from a data engine's cache, on-policy answers against
teacher-forced text, for each draft shape; one points.jsonl row per (point, exit) and the
report (table, fits, plot). Leave it running for hours or days: every point resumes after
Ctrl-C or kill -9, a finished point is skipped, and a point whose data the engine has not
written yet is skipped with a message, so rerunning the same command picks it up (or, with --wait-minutes N, the running one
looks again every N minutes until every point is done).

    nohup python -m train.scaling_study --engine ~/.cache/s2d-jax/engine/smollm2 \\
        > ~/.cache/s2d-jax/scaling/smollm2.log 2>&1 &

Points: --shapes x --kinds x --budgets. Shape N is the target's first N layers with an
exit every --exit-step layers (4: exits 2, 4; 8: 2, 4, 6, 8). on_policy: the engine's
first answer shards (answer tokens counted); teacher_forced: GSM8K-train reference
solutions and --documents, tokenized as the engine's teacher stage does. Each point trains
with --config (one recipe for all; the steps are --epochs passes over its tokens within
[--min-steps, --max-steps]) and is measured on --heldout as python -m infer.agreement does.
Outputs under --out (s2d_jax/bench/study.py); the engine's dir is only read.
"""

from __future__ import annotations

import math
import os
import re
import time

from s2d_jax.cli.args import (ArgumentParser, add_input, check_at_least, comma_paths,
                        finite_number, parse_floats, parse_ints)
from s2d_jax.cli.flags import add
from s2d_jax.env import cache_root
from s2d_jax.errors import S2DError, cli_main
from s2d_jax.io.outputs import DIR

CMD = "scaling-study"  # its s2d subcommand: the name its shared flags are defined for
# 10x for both kinds up to the ~0.91M tokens of teacher-forced text the sources hold at
# seq_len 256 (GSM8K-train references 0.58M, Shakespeare 0.33M), on-policy on to 2M (the
# engine's ~7.8k prompts answered twice hold ~2.3M answer tokens)
BUDGETS = "90k,200k,400k,900k,2M"
# what the study sets in --config per point
STUDY_KEYS = ("model.path", "data.tokenizer", "data.paths", "data.format", "data.teacher",
              "data.num_epochs", "draft.exits", "draft.head_vocab", "optimizer.total_steps",
              "checkpoint.dir", "metrics_path", "export_dir", "export_overwrite")
_BUDGET = re.compile(r"^(\d+(?:\.\d+)?)([kKmM]?)$")


def parse_budgets(text: str) -> list[int]:
    """'200k,500k,1M,2M' -> token counts, each a positive integer."""
    out = []
    for part in text.split(","):
        m = _BUDGET.match(part.strip())
        n = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6}[m[2].lower()] if m else 0
        if not (n >= 1 and n == int(n)):
            raise S2DError(f"--budgets: {part!r} is not a positive token count (e.g. 200k,1M)")
        out.append(int(n))
    return sorted(set(out))


def parse_args(argv):
    from s2d_jax.data.study_data import KINDS
    ap = ArgumentParser(prog="python -m train.scaling_study", description=__doc__)
    add_input(ap, "--engine", required=True, help="a data engine's --work dir")
    add(ap, "--target", CMD)
    ap.add_argument("--budgets", default=BUDGETS, help="unique supervised tokens per point")
    ap.add_argument("--shapes", default="4,8", help="draft depths (the target's first N layers)")
    ap.add_argument("--exit-step", type=int, default=2, help="an exit every this many layers")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"supervision kinds, of {KINDS}")
    add(ap, "--out", CMD, kind=DIR)
    for name in ("--heldout", "--heldout-prompts", "--config"):
        add(ap, name, CMD)
    add(ap, "--documents", CMD, paths=comma_paths)
    add(ap, "--head-vocab", CMD)
    ap.add_argument("--epochs", type=finite_number, default=3.0, help="passes over a point's tokens")
    ap.add_argument("--min-steps", type=int, default=100, help="fewest training steps")
    ap.add_argument("--max-steps", type=int, default=4000, help="most training steps")
    add(ap, "--levels", CMD)
    ap.add_argument("--wait-minutes", type=finite_number, default=0,
                    help="while points wait for the engine's data, retry every this many "
                    "minutes (0: stop once the points with data are done)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of --config (every point)")
    return check_args(ap.parse_args(argv), KINDS)


def check_args(args, kinds):
    args.budgets = parse_budgets(args.budgets)
    args.shapes = sorted(set(parse_ints(args.shapes, "--shapes", minimum=1)))
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.levels = parse_floats(args.levels, "--levels", nonempty=True)
    args.documents = comma_paths(args.documents)
    bad = [k for k in args.kinds if k not in kinds] or ([""] if not args.kinds else [])
    if bad:
        raise S2DError(f"--kinds: {bad[0]!r} is not one of {list(kinds)}")
    check_at_least(args, {"exit_step": 1, "heldout_prompts": 1,
                          "head_vocab": 0, "min_steps": 1, "max_steps": args.min_steps})
    if not (0 <= args.wait_minutes and math.isfinite(args.wait_minutes)):
        raise S2DError(f"--wait-minutes must be >= 0, got {args.wait_minutes}")
    if not (args.epochs > 0 and math.isfinite(args.epochs)):
        raise S2DError(f"--epochs must be > 0, got {args.epochs}")
    if not all(0 < v < 1 for v in args.levels):
        raise S2DError(f"--levels must lie in (0, 1), got {args.levels}")
    fixed = [o for o in args.overrides if o.split("=")[0].strip() in STUDY_KEYS]
    if fixed:
        raise S2DError(f"{fixed[0]}: the study sets {', '.join(STUDY_KEYS)} per point; drop it")
    check_inputs(args)
    return args


def check_inputs(args) -> None:
    """Every input exists and fits: the engine dir, its target, the shapes, the recipe."""
    from s2d_jax.config import read_hf_config
    from s2d_jax.data.study_data import check_engine_dir
    from s2d_jax.io.outputs import Output, check_outputs
    from s2d_jax.train.config import load_train_config
    if not os.path.isdir(args.target):
        raise S2DError(f"target {args.target} does not exist; fetch it with "
                       f"python -m infer.fetch_smollm2 or pass --target DIR")
    check_engine_dir(args.engine)
    for path in (args.heldout, args.config, *args.documents):
        if not os.path.isfile(path):
            raise S2DError(f"{path} does not exist; check the path")
    layers = read_hf_config(os.path.join(args.target, "config.json")).num_layers
    if args.shapes[-1] > layers:
        raise S2DError(f"--shapes: {args.shapes[-1]} layers, the target has {layers}")
    # a bad override fails here, before anything is written
    tc = load_train_config(args.config, [f"model.path={args.target}",
                                         f"data.tokenizer={args.target}", *args.overrides])
    args.row_tokens = tc.data.seq_len + 1  # what the trainer keeps of a row
    check_fingerprint(args.engine, args.target)
    name = os.path.basename(os.path.normpath(args.engine))
    args.out = args.out or os.path.join(cache_root(), "scaling", name)
    check_outputs([Output("--out", args.out, DIR, owner=args.s2d_prog)],
                  {"--engine": args.engine, "--target": args.target, "--heldout": args.heldout,
                   "--config": args.config, "--documents": list(args.documents)})
    # the points of an earlier run are read again after each point trains: a cut or
    # hand-edited file is refused now, not after the first point's hours of training
    from s2d_jax.bench.scaling import read_points
    from s2d_jax.bench.study import read_jsonl
    points = os.path.join(args.out, "points.jsonl")
    if read_jsonl(points, "points file"):
        read_points(points)  # and each row as the report reads it


def check_fingerprint(engine: str, target: str) -> None:
    """The engine's answers are this target's (its manifest names the target's hash)."""
    from s2d_jax.data.engine import target_fingerprint
    from s2d_jax.readers import read_json
    plan = read_json(os.path.join(engine, "answers", "manifest.json"), "stage manifest")
    have = plan.get("plan", {}).get("target") if isinstance(plan, dict) else None
    if have != target_fingerprint(target):
        raise S2DError(f"{engine}'s answers come from another target than {target}; pass the "
                       f"engine's --target")


@cli_main
def main(argv=None):
    from s2d_jax.io.atomic import files_dir
    args = parse_args(argv)
    with files_dir(args.out, args.s2d_prog):  # a failed first run leaves no empty --out
        return _run(args)


def _run(args) -> int:
    from s2d_jax.bench.study import Study, StudyPoint, exits_for, run_study
    from s2d_jax.data.overlap import EVAL_FILES

    def log(msg):  # timed: a days-long log says how long each stage took
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}", flush=True)

    study = Study(engine=args.engine, target=args.target, out=args.out, config=args.config,
                  overrides=tuple(args.overrides), heldout=args.heldout,
                  heldout_prompts=args.heldout_prompts, documents=args.documents,
                  row_tokens=args.row_tokens, head_vocab=args.head_vocab, epochs=args.epochs,
                  min_steps=args.min_steps, max_steps=args.max_steps,
                  levels=tuple(args.levels))
    points = [StudyPoint(s, exits_for(s, args.exit_step), k, b)
              for s in args.shapes for k in args.kinds for b in args.budgets]
    eval_files = tuple(dict.fromkeys((*EVAL_FILES, args.heldout)))
    waiting = run_study(study, points, eval_files, log)
    while waiting and args.wait_minutes:  # the engine is still writing: look again later
        log(f"[study] waiting {args.wait_minutes:g} min for the engine's data")
        time.sleep(args.wait_minutes * 60)
        waiting = run_study(study, points, eval_files, log)
    log(f"[study] {len(points) - len(waiting)} of {len(points)} points finished"
        + (f"; waiting for data: {', '.join(waiting)} (rerun later)" if waiting else "")
        + f"; points {os.path.join(args.out, 'points.jsonl')}")
    return 0


if __name__ == "__main__":
    main()
