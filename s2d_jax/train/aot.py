"""The SoFT training step compiled ahead of time on abstract shapes, as printable lines:
what `python -m train.aot` prints and `python -m infer.aot --train-config` appends."""

from __future__ import annotations

import os

from s2d_jax.errors import S2DError

GIB = 2**30


def train_step_report(config_path: str, target: str | None = None,
                      overrides: list[str] = ()) -> list[str]:
    """Load the training YAML (with key=value `overrides`), compile its step for the draft
    of `target` (a model YAML / HF dir / config.json; default model.path) on jax.devices()
    and return the report: devices, draft, batch, per-device memory, compile time."""
    import jax

    from s2d_jax.config import load_model_config
    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import _with_dtypes, compile_step_aot, draft_of_target

    tc = load_train_config(config_path, list(overrides))
    target = target or tc.model.path
    if not os.path.exists(target):
        raise S2DError(f"target config {target} does not exist; pass --target with a model YAML "
                       f"(configs/models/*.yaml) or an HF dir")
    full = load_model_config(target)
    if target.endswith((".yaml", ".yml")) and not tc.draft.exits:
        cfg, exits = _with_dtypes(full, tc), (full.num_layers,)
    else:
        cfg, exits = draft_of_target(full, tc)
    devices = jax.devices()
    lines = [f"devices: {len(devices)} x {devices[0].platform}; mesh data={tc.mesh.data} "
             f"fsdp={tc.mesh.fsdp} tensor={tc.mesh.tensor}",
             f"draft: {cfg.num_layers} layers of {target} ({cfg.num_params() / 1e9:.2f}B params), "
             f"exits {list(exits)}, compute {cfg.dtype}, params {cfg.param_dtype}",
             f"batch {tc.data.batch_size} x seq {tc.data.seq_len}, grad_accum "
             f"{tc.optimizer.grad_accum_steps}, remat {tc.remat}"]
    compiled, t_lower, t_compile = compile_step_aot(tc, cfg, exits, devices)
    return lines + memory_lines(compiled.memory_analysis()) + [
        f"lower {t_lower:.1f} s, compile {t_compile:.1f} s"]


def memory_lines(m) -> list[str]:
    """compiled.memory_analysis() -> per-device lines (GiB) and the peak estimate."""
    rows = [("argument", m.argument_size_in_bytes), ("output", m.output_size_in_bytes),
            ("alias (donated)", m.alias_size_in_bytes), ("temp", m.temp_size_in_bytes),
            ("generated code", m.generated_code_size_in_bytes)]
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    return (["per-device memory:"] + [f"  {name:<16} {b / GIB:9.3f} GiB" for name, b in rows]
            + [f"  {'total (peak est)':<16} {peak / GIB:9.3f} GiB"])
