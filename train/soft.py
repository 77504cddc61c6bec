"""Sorted fine-tuning (SoFT) of a multi-exit draft, or plain LM training with one exit.

    python -m train.soft --config configs/train/cpu_soft.yaml [key=value ...]

Examples of overrides: `optimizer.lr=0.0001 draft.exits=[2,4] mesh.data=2
checkpoint.dir=runs/x export_dir=runs/x/hf`. The run resumes from the latest checkpoint in
`checkpoint.dir` when there is one.
"""

from __future__ import annotations

import os

from s2d_jax.cli.args import ArgumentParser
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main


def config_files(path: str) -> list[str]:
    """The config file and those it includes through `base:` (inputs of the run too)."""
    from s2d_jax.readers import read_yaml
    files = []
    while path and path not in files:  # a loop of bases ends at the first repeat
        files.append(path)
        data = read_yaml(path)
        base = data.get("base") if isinstance(data, dict) else None
        path = os.path.join(os.path.dirname(path), base) if isinstance(base, str) else None
    return files


def check_train_outputs(tc, config: str) -> None:
    """Checkpoints, metrics and the export may overwrite no input of the run ("" = off)."""
    from s2d_jax.io.outputs import DIR, FILE, HF_DIR, Output, check_outputs
    check_outputs(
        [Output("checkpoint.dir", tc.checkpoint.dir or None, DIR),
         Output("metrics_path", tc.metrics_path or None, FILE),
         Output("export_dir", tc.export_dir or None, HF_DIR, tc.export_overwrite,
                "export_overwrite=true")],
        {"--config": config_files(config), "model.path": tc.model.path,
         "data.paths": list(tc.data.paths), "data.tokenizer": tc.data.tokenizer,
         "data.teacher": tc.data.teacher, "draft.head_vocab": tc.draft.head_vocab})


@cli_main
def main(argv=None):
    p = ArgumentParser(prog="python -m train.soft", description=__doc__)
    add(p, "--config", "train", required=True)
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)

    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import train

    tc = load_train_config(args.config, args.overrides)
    check_train_outputs(tc, args.config)
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
