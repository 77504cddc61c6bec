"""Lower and compile a SoFT training step ahead of time on abstract shapes; print memory.

    python -m train.aot --fake-devices 8 --config configs/train/vicuna7b_soft.yaml \\
        --target-config configs/models/vicuna-7b-v1.5.yaml [key=value ...]

No weights are read or allocated: the target's config (a model YAML or an HF dir /
config.json) only gives the shapes, and the draft is its first `draft.exits[-1]` layers.
Prints per-device memory from `compiled.memory_analysis()` and the compile time. With
--throughput DEVICE (h100, h200, a100, tpu-v5e, tpu-v5p) also the step's matmul flops per
trained token and the tokens a minute DEVICE trains at --mfu (model-flops utilisation,
assumed: measure it there), and with --cache-tokens N how long one pass over N tokens
takes (s2d_jax/train/throughput.py):

    python -m train.aot --config configs/train/engine_h100.yaml \
        --target-config ~/.cache/s2d-jax/SmolLM2-135M-Instruct --throughput h100 --cache-tokens 2.3e6
"""

from __future__ import annotations

from s2d_jax.cli.args import ArgumentParser, fake_cpu_devices, finite_number
from s2d_jax.cli.flags import add
from s2d_jax.errors import S2DError, cli_main

CMD = "train-aot"  # its s2d subcommand: the name its shared flags are defined for
from s2d_jax.train.throughput import ACCELERATORS


def _parse(argv):
    p = ArgumentParser(prog="python -m train.aot", description=__doc__)
    add(p, "--config", CMD, required=True)
    add(p, "--target-config", CMD, dest="target")  # shapes, not a model: not --target
    add(p, "--fake-devices", CMD)
    add(p, "--topology", CMD)
    p.add_argument("--throughput", choices=sorted(ACCELERATORS), default=None,
                   help="estimate the tokens a minute this accelerator trains")
    p.add_argument("--mfu", type=finite_number, default=0.35,
                   help="model-flops utilisation assumed for --throughput, in (0, 1]")
    p.add_argument("--cache-tokens", type=finite_number, default=0,
                   help="with --throughput: the minutes one pass over this many tokens takes")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    if not 0 < args.mfu <= 1:
        raise S2DError(f"--mfu must lie in (0, 1], got {args.mfu}")
    if not (args.cache_tokens >= 0 and args.cache_tokens == int(args.cache_tokens)):
        raise S2DError(f"--cache-tokens must be a whole number >= 0, got {args.cache_tokens}")
    return args


@cli_main
def main(argv=None):
    args = _parse(argv)
    devices = None
    if args.topology:  # compile-only TPU devices, before anything touches jax.devices()
        if args.fake_devices:
            raise S2DError("--topology compiles for its own devices; drop --fake-devices")
        from s2d_jax.parallel import topology
        devices = topology.devices(args.topology)
        print(topology.describe(args.topology, devices))
    fake_cpu_devices(args.fake_devices)  # before anything touches jax.devices()
    from s2d_jax.train.aot import train_step_report
    for line in train_step_report(args.config, args.target, args.overrides, args.throughput,
                                  args.mfu, int(args.cache_tokens), devices):
        print(line)


if __name__ == "__main__":
    main()
