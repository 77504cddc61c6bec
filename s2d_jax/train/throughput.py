"""How many tokens a minute a SoFT training config should train on an accelerator: the
step's matmul flops per token (a formula, checked against XLA's compiled cost analysis in
tests/test_throughput.py), the accelerator's dense peak and an assumed model-flops
utilisation (MFU). The CPU runs of the same code give the utilisation this machine reaches
(docs/results.md); an accelerator's has to be measured there: the estimate says what to
expect and how long a cache takes, not what a run will do.

Per trained token, for a draft of L layers (hidden D, attention width Q, key/value width
KV, MLP width F), rows of T tokens, E exits and a head of V rows:
    layers  L * (6 * (2 D Q + 2 D KV + 3 D F) + 12 T Q)
            forward 2 and backward 4 flops per weight; scores and weighted values over the
            whole masked T x T block, forward and twice that backward
    heads   E * 6 D V    forward, its recomputation (the exit loss is rematerialised) and
                         the input gradient; the tied embedding is frozen (no weight grad)
    KD      E * 4 D V    the target's logits from its stored states, forward and recompute
"""

from __future__ import annotations

import dataclasses

# bf16 dense peak flops per second (vendor datasheets; sparsity not counted)
ACCELERATORS = {
    "h100": ("NVIDIA H100 SXM", 989e12),
    "h200": ("NVIDIA H200 SXM", 989e12),
    "a100": ("NVIDIA A100", 312e12),
    "tpu-v5e": ("TPU v5e chip", 197e12),
    "tpu-v5p": ("TPU v5p chip", 459e12),
}


@dataclasses.dataclass(frozen=True)
class TrainFlops:
    """Matmul flops per trained token, by part."""

    layers: float
    heads: float
    kd: float

    @property
    def total(self) -> float:
        return self.layers + self.heads + self.kd


def train_flops_per_token(cfg, exits, seq_len: int, head_rows: int | None = None,
                          kd: bool = False, frozen_head: bool = True) -> TrainFlops:
    """The formula of the module docstring for the draft `cfg` (its first exits[-1] layers)
    with exits `exits`; head_rows: the sub-vocabulary's size (default the vocabulary)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    Q, KV = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    V = head_rows or cfg.vocab_size
    layer = 6 * (2 * D * Q + 2 * D * KV + 3 * D * F) + 12 * seq_len * Q
    head = (6 if frozen_head else 8) * D * V
    return TrainFlops(layers=float(exits[-1] * layer), heads=float(len(exits) * head),
                      kd=float(len(exits) * 4 * D * V if kd else 0))


def throughput_lines(flops: TrainFlops, tokens_per_step: int, device: str, mfu: float,
                     cache_tokens: int = 0) -> list[str]:
    """The estimate for `device` at utilisation `mfu`, as printable lines."""
    name, peak = ACCELERATORS[device]
    step = flops.total * tokens_per_step / (peak * mfu)
    per_min = 60 * tokens_per_step / step
    lines = [f"matmul flops per trained token: {flops.total / 1e9:.3f} GFLOP (layers "
             f"{flops.layers / 1e9:.3f}, heads {flops.heads / 1e9:.3f}, KD {flops.kd / 1e9:.3f})",
             f"{name} at {peak / 1e12:.0f} TFLOP/s bf16 and MFU {mfu:g}: {step * 1e3:.1f} ms a "
             f"step of {tokens_per_step} tokens, {per_min / 1e6:.2f}M tokens a minute"]
    if cache_tokens:
        lines.append(f"one pass over {cache_tokens / 1e6:.3g}M tokens: "
                     f"{cache_tokens / per_min:.1f} min")
    return lines
