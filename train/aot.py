"""Lower and compile a SoFT training step ahead of time on abstract shapes; print memory.

    python -m train.aot --fake-devices 8 --config configs/train/vicuna7b_soft.yaml \\
        --target configs/models/vicuna-7b-v1.5.yaml [key=value ...]

No weights are read or allocated: the target's config (a model YAML or an HF dir /
config.json) only gives the shapes, and the draft is its first `draft.exits[-1]` layers.
Prints per-device memory from `compiled.memory_analysis()` and the compile time.
"""

from __future__ import annotations

import os

from infer.args import ArgumentParser, add_fake_devices_flag, fake_cpu_devices, path_arg
from s2d_jax.errors import S2DError, cli_main

GIB = 2**30


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

    import jax

    from s2d_jax.config import load_model_config
    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import _with_dtypes, compile_step_aot, draft_of_target

    tc = load_train_config(args.config, args.overrides)
    target = args.target or tc.model.path
    if not os.path.exists(target):
        raise S2DError(f"target config {target} does not exist; pass --target with a model YAML "
                       f"(configs/models/*.yaml) or an HF dir")
    full = load_model_config(target)
    if target.endswith((".yaml", ".yml")) and not tc.draft.exits:
        cfg, exits = _with_dtypes(full, tc), (full.num_layers,)
    else:
        cfg, exits = draft_of_target(full, tc)
    devices = jax.devices()
    print(f"devices: {len(devices)} x {devices[0].platform}; mesh data={tc.mesh.data} "
          f"fsdp={tc.mesh.fsdp} tensor={tc.mesh.tensor}")
    print(f"draft: {cfg.num_layers} layers of {target} ({cfg.num_params() / 1e9:.2f}B params), "
          f"exits {list(exits)}, compute {cfg.dtype}, params {cfg.param_dtype}")
    print(f"batch {tc.data.batch_size} x seq {tc.data.seq_len}, grad_accum "
          f"{tc.optimizer.grad_accum_steps}, remat {tc.remat}")
    compiled, t_lower, t_compile = compile_step_aot(tc, cfg, exits, devices)
    m = compiled.memory_analysis()
    rows = [("argument", m.argument_size_in_bytes), ("output", m.output_size_in_bytes),
            ("alias (donated)", m.alias_size_in_bytes), ("temp", m.temp_size_in_bytes),
            ("generated code", m.generated_code_size_in_bytes)]
    print("per-device memory:")
    for name, b in rows:
        print(f"  {name:<16} {b / GIB:9.3f} GiB")
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    print(f"  {'total (peak est)':<16} {peak / GIB:9.3f} GiB")
    print(f"lower {t_lower:.1f} s, compile {t_compile:.1f} s")


if __name__ == "__main__":
    main()
