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
    compiler's own step time and the tokens a second it implies are then added."""
    import jax

    from s2d_jax.config import load_model_config
    from s2d_jax.train.config import load_train_config
    from s2d_jax.train.loop import _with_dtypes, compile_step_aot, draft_of_target

    tc = load_train_config(config_path, list(overrides))
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


def estimate_lines(tc, cfg, exits, device: str, mfu: float, cache_tokens: int) -> list[str]:
    """throughput.throughput_lines for this config: its head's rows (draft.head_vocab), its
    KD term (draft.kd_weight > 0) and its frozen tied head."""
    from s2d_jax.model.sorted_draft import read_head_vocab
    from s2d_jax.train.throughput import throughput_lines, train_flops_per_token
    rows = len(read_head_vocab(tc.draft.head_vocab, cfg.vocab_size)) if tc.draft.head_vocab \
        else None
    frozen = cfg.tie_word_embeddings and "embed" in tc.optimizer.frozen
    flops = train_flops_per_token(cfg, exits, tc.data.seq_len, rows, tc.draft.kd_weight > 0,
                                  frozen)
    return throughput_lines(flops, tc.data.batch_size * tc.data.seq_len, device, mfu,
                            cache_tokens)


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
    analysis counts a loop body once (the layer scan: one layer; gradient accumulation: one
    micro-batch), so one micro-batch is compiled again with grad_accum 1 and the layers
    unrolled, and its estimate (round_cost.compiler_seconds) taken grad_accum times."""
    import dataclasses

    from s2d_jax.decode.round_cost import compiler_seconds
    from s2d_jax.model import layers
    from s2d_jax.train.loop import compile_step_aot
    accum = max(tc.optimizer.grad_accum_steps, 1)
    micro = dataclasses.replace(
        tc, data=dataclasses.replace(tc.data, batch_size=tc.data.batch_size // accum),
        optimizer=dataclasses.replace(tc.optimizer, grad_accum_steps=1))
    saved, layers.TRAIN_UNROLL = layers.TRAIN_UNROLL, True
    try:
        compiled, _, t_compile = compile_step_aot(micro, cfg, exits, devices)
    finally:
        layers.TRAIN_UNROLL = saved
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    s = compiler_seconds(compiled, ca)
    if s is None:
        return [f"the TPU compiler's step estimate: n/a (optimal_seconds "
                f"{ca.get('optimal_seconds')})"]
    step = accum * s
    tokens = tc.data.batch_size * tc.data.seq_len  # a step's rows, over its micro-batches
    return [f"the TPU compiler's step estimate: {1e3 * step:.1f} ms ({accum} micro-batches x "
            f"{1e3 * s:.1f} ms, layers unrolled; {(ca.get('flops') or 0) / 1e12:.2f} TFLOP a "
            f"micro-batch per chip; its compile {t_compile:.1f} s): {tokens / step:,.0f} tokens a "
            f"second on these {len(devices)} chips"]
