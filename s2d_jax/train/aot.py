"""The SoFT training step compiled ahead of time on abstract shapes, as printable lines:
what `python -m train.aot` prints and `python -m infer.aot --train-config` appends."""

from __future__ import annotations

import os

from s2d_jax.errors import S2DError

GIB = 2**30


def train_step_report(config_path: str, target: str | None = None,
                      overrides: list[str] = (), throughput: str | None = None,
                      mfu: float = 0.35, cache_tokens: int = 0, devices=None) -> list[str]:
    """Load the training YAML (with key=value `overrides`), compile its step for the draft
    of `target` (a model YAML / HF dir / config.json; default model.path) on jax.devices()
    and return the report: devices, draft, batch, per-device memory, compile time; with
    `throughput` (an accelerator of throughput.ACCELERATORS) the estimate of its tokens a
    minute at utilisation `mfu`. `devices`: compile for these (a TPU topology's
    compile-only devices, parallel/topology.py) instead of jax.devices(); the TPU
    compiler's own step time, the tokens a second it implies, the model's flops and the
    MFU at that time are then added."""
    import jax

    from s2d_jax.config import load_model_config
    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import _with_dtypes, compile_step_aot, draft_of_target

    # --target-config gives the shapes: a config whose model.path a pipeline fills in
    # (engine_h100.yaml) compiles without one (a model.path override still wins)
    tc = load_train_config(config_path, ([f"model.path={target}"] if target else [])
                           + list(overrides))
    target = target or tc.model.path
    if not os.path.exists(target):
        raise S2DError(f"target config {target} does not exist; pass --target-config with a "
                       f"model YAML (configs/models/*.yaml) or an HF dir")
    full = load_model_config(target)
    if target.endswith((".yaml", ".yml")) and not tc.draft.exits:
        cfg, exits = _with_dtypes(full, tc), (full.num_layers,)
    else:
        cfg, exits = draft_of_target(full, tc)
    devices = devices or jax.devices()
    lines = [f"devices: {len(devices)} x {devices[0].platform}; mesh data={tc.mesh.data} "
             f"fsdp={tc.mesh.fsdp} tensor={tc.mesh.tensor}",
             f"draft: {cfg.num_layers} layers of {target} ({cfg.num_params() / 1e9:.2f}B params), "
             f"exits {list(exits)}, compute {cfg.dtype}, params {cfg.param_dtype}",
             f"batch {tc.data.batch_size} x seq {tc.data.seq_len}, grad_accum "
             f"{tc.optimizer.grad_accum_steps}, remat {tc.remat}"]
    compiled, t_lower, t_compile = compile_step_aot(tc, cfg, exits, devices)
    lines += memory_lines(compiled.memory_analysis()) + [
        f"lower {t_lower:.1f} s, compile {t_compile:.1f} s"]
    if devices[0].platform == "tpu":
        lines += compiler_step_lines(tc, cfg, exits, devices)
    if throughput:
        lines += estimate_lines(tc, cfg, exits, throughput, mfu, cache_tokens)
    return lines


# device_kind of a compile-only TPU -> its throughput.ACCELERATORS entry (the MFU's peak)
TPU_PEAKS = {"TPU v5": "tpu-v5p", "TPU v5p": "tpu-v5p", "TPU v5 lite": "tpu-v5e"}


def model_flops(tc, cfg, exits):
    """throughput.train_flops_per_token for this config: its head's rows
    (draft.head_vocab), its KD term (draft.kd_weight > 0) and its frozen tied head."""
    from s2d_jax.model.sorted_draft import read_head_vocab
    from s2d_jax.train.throughput import train_flops_per_token
    rows = len(read_head_vocab(tc.draft.head_vocab, cfg.vocab_size)) if tc.draft.head_vocab \
        else None
    frozen = cfg.tie_word_embeddings and "embed" in tc.optimizer.frozen
    return train_flops_per_token(cfg, exits, tc.data.seq_len, rows, tc.draft.kd_weight > 0,
                                 frozen)


def estimate_lines(tc, cfg, exits, device: str, mfu: float, cache_tokens: int) -> list[str]:
    """throughput.throughput_lines for this config (model_flops)."""
    from s2d_jax.train.throughput import throughput_lines
    return throughput_lines(model_flops(tc, cfg, exits), tc.data.batch_size * tc.data.seq_len,
                            device, mfu, cache_tokens)


def memory_lines(m) -> list[str]:
    """compiled.memory_analysis() -> per-device lines (GiB) and the peak estimate."""
    rows = [("argument", m.argument_size_in_bytes), ("output", m.output_size_in_bytes),
            ("alias (donated)", m.alias_size_in_bytes), ("temp", m.temp_size_in_bytes),
            ("generated code", m.generated_code_size_in_bytes)]
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes + m.generated_code_size_in_bytes)
    return (["per-device memory:"] + [f"  {name:<16} {b / GIB:9.3f} GiB" for name, b in rows]
            + [f"  {'total (peak est)':<16} {peak / GIB:9.3f} GiB"])


def compiler_step_lines(tc, cfg, exits, devices) -> list[str]:
    """The TPU compiler's estimate of a step and the tokens a second it implies. XLA's cost
    analysis counts a loop body once (the layer scan: one layer; the exit losses: one exit's
    piece; gradient accumulation: one micro-batch), so one micro-batch is compiled again
    with grad_accum 1 and the layers and exit losses unrolled, and its estimate
    (round_cost.compiler_seconds) taken grad_accum times."""
    import dataclasses

    from s2d_jax.decode.round_cost import compiler_seconds
    from s2d_jax.model import layers, sorted_draft
    from s2d_jax.train.loop import compile_step_aot
    accum = max(tc.optimizer.grad_accum_steps, 1)
    micro = dataclasses.replace(
        tc, data=dataclasses.replace(tc.data, batch_size=tc.data.batch_size // accum),
        optimizer=dataclasses.replace(tc.optimizer, grad_accum_steps=1))
    saved = layers.TRAIN_UNROLL, sorted_draft.LOSS_UNROLL
    layers.TRAIN_UNROLL = sorted_draft.LOSS_UNROLL = True
    try:
        compiled, _, t_compile = compile_step_aot(micro, cfg, exits, devices)
    finally:
        layers.TRAIN_UNROLL, sorted_draft.LOSS_UNROLL = saved
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    s = compiler_seconds(compiled, ca)
    if s is None:
        return [f"the TPU compiler's step estimate: n/a (optimal_seconds "
                f"{ca.get('optimal_seconds')})"]
    step = accum * s
    tokens = tc.data.batch_size * tc.data.seq_len  # a step's rows, over its micro-batches
    lines = [f"the TPU compiler's step estimate: {1e3 * step:.1f} ms ({accum} micro-batches x "
             f"{1e3 * s:.1f} ms, layers and exit losses unrolled; "
             f"{(ca.get('flops') or 0) / 1e12:.2f} TFLOP a micro-batch per chip; its compile "
             f"{t_compile:.1f} s): {tokens / step:,.0f} tokens a second on these {len(devices)} "
             f"chips"]
    # the model's flops (a formula: what the step must compute, not what XLA counts, which
    # includes rematerialisation) over the compiler's time: its model-flops utilisation
    flops = model_flops(tc, cfg, exits).total * tokens / accum / len(devices)
    lines.append(f"model flops a micro-batch per chip: {flops / 1e12:.4g} TFLOP")
    accelerator = TPU_PEAKS.get(devices[0].device_kind)
    if accelerator:
        from s2d_jax.train.throughput import ACCELERATORS
        peak = ACCELERATORS[accelerator][1]
        lines.append(f"MFU at the compiler's time: {flops / (s * peak):.3g} (peak "
                     f"{peak / 1e12:.0f} TFLOP/s a chip, {accelerator})")
    return lines
