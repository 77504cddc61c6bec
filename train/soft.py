"""Sorted fine-tuning (SoFT) of a multi-exit draft, or plain LM training with one exit.

    python -m train.soft --config configs/train/cpu_soft.yaml [key=value ...]

Examples of overrides: `optimizer.lr=0.0001 draft.exits=[2,4] mesh.data=2
checkpoint.dir=runs/x export_dir=runs/x/hf`. The run resumes from the latest checkpoint in
`checkpoint.dir` when there is one.
"""

from __future__ import annotations

import argparse
import os

from infer.args import ArgumentParser, check_output_path
from s2d_jax.errors import S2DError, cli_main


def check_outputs(tc) -> None:
    """Fail before any compiling when an output cannot be written (a metrics file that is a
    directory, a checkpoint dir under a file or read-only: orbax's OSError otherwise)."""
    if tc.metrics_path:
        check_output_path(tc.metrics_path, "metrics_path")
    path = tc.checkpoint.dir
    if path:
        check_output_path(path, "checkpoint.dir", is_dir=True)
        if os.path.exists(path) and not (os.path.isdir(path) and
                                         os.access(path, os.W_OK | os.X_OK)):
            raise S2DError(f"checkpoint.dir {path} is not a writable directory; choose "
                           f"another path")


@cli_main
def main(argv=None):
    p = ArgumentParser(prog="python -m train.soft", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="training YAML (configs/train/*.yaml)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)

    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import train

    tc = load_train_config(args.config, args.overrides)
    check_outputs(tc)
    try:
        out = train(tc, progress=not args.no_progress)
    except OSError as e:  # disk full, a path the checks above cannot foresee (/proc)
        raise S2DError(f"cannot write {e.filename or 'an output'}: {e.strerror or e}; choose "
                       f"writable checkpoint.dir / metrics_path / export_dir paths") from None
    hist = out["history"]
    if hist:
        last = hist[-1]
        per_exit = " ".join(f"exit{e}={v:.4f}" for e, v in last["exit_loss"].items())
        print(f"step {last['step']}: loss {last['loss']:.4f} ({per_exit})")
    if tc.export_dir:
        print(f"exported draft to {tc.export_dir}")


if __name__ == "__main__":
    main()
