"""Lower and compile a SoFT training step ahead of time on abstract shapes; print memory.

    python -m train.aot --fake-devices 8 --config configs/train/vicuna7b_soft.yaml \\
        --target configs/models/vicuna-7b-v1.5.yaml [key=value ...]

No weights are read or allocated: the target's config (a model YAML or an HF dir /
config.json) only gives the shapes, and the draft is its first `draft.exits[-1]` layers.
Prints per-device memory from `compiled.memory_analysis()` and the compile time.
"""

from __future__ import annotations

from infer.args import ArgumentParser, add_fake_devices_flag, fake_cpu_devices, path_arg
from s2d_jax.errors import cli_main


def _parse(argv):
    p = ArgumentParser(prog="python -m train.aot", description=__doc__)
    p.add_argument("--config", required=True, type=path_arg,
                   help="training YAML (configs/train/*.yaml)")
    p.add_argument("--target", default=None, type=path_arg,
                   help="model YAML / HF dir / config.json giving the shapes (default: model.path)")
    add_fake_devices_flag(p)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p.parse_args(argv)


@cli_main
def main(argv=None):
    args = _parse(argv)
    fake_cpu_devices(args.fake_devices)  # before anything touches jax.devices()
    from s2d_jax.train.aot import train_step_report
    for line in train_step_report(args.config, args.target, args.overrides):
        print(line)


if __name__ == "__main__":
    main()
