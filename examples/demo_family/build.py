"""Build the demo model family (tokenizer, targets demo-s/m/l, sorted draft) on CPU.

    python -m examples.demo_family.build --out models/demo [--smoke] [--overwrite]
                                [--stage tokenizer|targets|mixture|draft|eval|all]
                                [--sizes s,m,l]

Trains on data/tinyshakespeare.txt (first 90% of its paragraphs; the last 10% are held
out and give data/demo_questions.jsonl, the benchmark's prompts, and the disjoint
data/demo_calibration.jsonl, the dev prompts of python -m infer.calibrate). Scratch files
go to --run-dir. --smoke runs the
same pipeline on a small slice with shrunk models and 3 steps per model (seconds), and
writes its prompts inside --run-dir instead of data/.
"""

from __future__ import annotations

import argparse

from s2d_jax.cli.args import ArgumentParser, add_input, add_output
from s2d_jax.io.outputs import CACHE, FILE
from s2d_jax.errors import cli_main


@cli_main
def main(argv=None):
    from examples.demo_family.pipeline import STAGES, FamilyPaths, SmokeSettings, build_family

    p = ArgumentParser(prog="python -m examples.demo_family.build", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    # a dir of model dirs, each replaced whole (--overwrite) by the stage that writes it
    add_output(p, "--out", kind=CACHE, required=True,
               help="output dir of the HF model dirs (models/demo)")
    p.add_argument("--stage", choices=STAGES, default="all")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--sizes", default="s,m,l",
                   help="targets the targets stage trains (e.g. s,m after changing their "
                        "configs; the other stages use all three)")
    p.add_argument("--smoke", action="store_true", help="tiny, fast run of the whole pipeline")
    add_output(p, "--run-dir", kind=CACHE, default=None,
                   help="scratch dir (default runs/demo_family, or <out>/run with --smoke)")
    add_input(p, "--corpus", default="data/tinyshakespeare.txt")
    add_output(p, "--questions", kind=FILE, default=None,
                   help="prompt file to write (default data/demo_questions.jsonl, or "
                        "<run-dir>/demo_questions.jsonl with --smoke)")
    add_input(p, "--configs", default="configs", help="dir holding models/ and train/")
    args = p.parse_args(argv)

    import os
    run_dir = args.run_dir if args.run_dir is not None else (
        os.path.join(args.out, "run") if args.smoke else os.path.join("runs", "demo_family"))
    questions = args.questions if args.questions is not None else (
        os.path.join(run_dir, "demo_questions.jsonl") if args.smoke
        else os.path.join("data", "demo_questions.jsonl"))
    calibration = os.path.join(os.path.dirname(questions), "demo_calibration.jsonl")
    from s2d_jax.io.outputs import DIR, Output, check_outputs
    check_outputs([Output("--out", args.out, DIR), Output("--run-dir", run_dir, DIR),
                   Output("--questions", questions), Output("the calibration prompts",
                                                            calibration)],
                  {"--corpus": args.corpus, "--configs": args.configs})
    paths = FamilyPaths(out=args.out, run_dir=run_dir, corpus=args.corpus, questions=questions,
                        calibration=calibration,
                        model_configs=os.path.join(args.configs, "models"),
                        train_configs=os.path.join(args.configs, "train"))
    build_family(paths, args.stage, args.overwrite, SmokeSettings() if args.smoke else None,
                 sizes=tuple(s.strip() for s in args.sizes.split(",") if s.strip()))


if __name__ == "__main__":
    main()
