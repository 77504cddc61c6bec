"""Roofline bound of a decode round from its compiled HLO: bytes moved / memory bandwidth.

Decoding a few tokens per call is memory-bound on a GPU/TPU (a verify window of gamma + 1
tokens x a few rows does ~2 (gamma + 1) B flops per weight byte, far below the ~300 flops a
byte where an H100 or a v5e turns compute-bound), so the time of a round is at least the
bytes it moves over the device's memory bandwidth. That is a BOUND, not a measurement:
real rounds add kernel launches, collectives' latency and imperfect bandwidth use.
"""

from __future__ import annotations

import dataclasses
import math
import re

from s2d_jax.decode.methods import has
from s2d_jax.errors import S2DError
from s2d_jax.model.kvcache import cache_bytes
from s2d_jax.parallel.memory import tree_bytes_per_device

# Peak memory bandwidth per device, bytes/s (vendor datasheets): H100 SXM5 80GB HBM3
# 3.35 TB/s, H200 141GB HBM3e 4.8 TB/s, A100 80GB SXM 2.039 TB/s, A100 40GB 1.555 TB/s, L4
# 300 GB/s (NVIDIA product pages); Cloud TPU docs ("System architecture"): v5e 819 GB/s, v4
# 1.2 TB/s, v5p 2.765 TB/s, v6e (Trillium) 1.64 TB/s.
DEVICE_BANDWIDTH = {
    "h100-80gb": 3.35e12, "h200-141gb": 4.8e12, "a100-80gb": 2.039e12, "a100-40gb": 1.555e12,
    "l4-24gb": 300e9, "tpu-v5e-16gb": 819e9, "tpu-v4-32gb": 1.2e12, "tpu-v5p-95gb": 2.765e12,
    "tpu-v6e-32gb": 1.64e12,
}
# Per-token acceptance rates predicted at by default: the committed SmolLM2 sorted draft's
# measured T = 1 acceptance chance (docs/results.md, 0.24-0.26 over its exits).
DEFAULT_ACCEPTANCE = (0.25,)
# Ops whose bytes are the minimum's own: matmuls reading weights (dot, dot_general, the CPU
# matmul kernel's ffi_call) and the attention's block reads of the cache.
MINIMUM_OPS = re.compile(r"dot|ffi_call|BKCH")
# The attention's own intermediates (attention.py names their scope).
ATTENTION_OPS = re.compile(r"attention_block/")


def device_bandwidth(name: str, override: float | None = None) -> float | None:
    """Bytes/s of a --device-memory preset, or `override` (bytes/s); None when unknown."""
    if override is not None:
        if not 0 < override < float("inf"):
            raise S2DError(f"--bandwidth must be a positive number of GB/s, got {override}")
        return override
    return DEVICE_BANDWIDTH.get(name)


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens a round yields when each drafted token is accepted with probability
    `acceptance` independently (Leviathan et al. 2023, eq. 1): (1 - a^(g+1)) / (1 - a)."""
    return sum(acceptance ** k for k in range(gamma + 1))


def lemma_speedup(ar_round_s: float, round_s: float, tokens: float) -> float:
    """Lemma 3.1 with n = 2 (theory.py): T/N = (T_1 + beta T_2) / L_1, a round's time over
    its tokens, against AR's one token per round."""
    return tokens * ar_round_s / round_s


def call_bytes(cfg, batch: int, max_len: int, mesh=None) -> int:
    """Per-device bytes one forward call must read: every weight (the embedding table only
    where it is also the head: a call gathers just its tokens' rows) and the whole cache.
    A quantize.QuantizedConfig's weights as stored: the int8 bytes and float32 scales of
    its matrices and head (aot.abstract_params), its norms and cache in their dtype."""
    from s2d_jax.decode.aot import abstract_params
    params = dict(abstract_params(cfg, mesh))
    if "lm_head" in params:
        params.pop("embed")
    return tree_bytes_per_device(params) + cache_bytes(cfg, batch, max_len, mesh)[1]


def _draft_bytes(setup, exit_layers: int, mesh) -> int:
    cfg = dataclasses.replace(setup.draft_cfg, num_layers=exit_layers)
    return call_bytes(cfg, setup.batch, setup.spec.max_len, mesh)


def minimum_round_bytes(setup, mesh=None) -> tuple[int, int]:
    """(lo, hi) per-device bytes a round must move at least: the target's weights and cache
    once (its verify call), plus per draft step the draft's weights and cache up to the exit
    it stops at (lo: the first exit, with the K/V fill of the layers past it where kv_fill
    is CALM; hi: the deepest), gamma steps a round (call_bytes).
    A step that escalates reads the shared norm and head at every exit it passes: each
    exit's confidence decides whether the next layers run, so no program can read the head
    once for all of them (hi counts it len(exits) times)."""
    target = call_bytes(setup.target_cfg, setup.batch, setup.spec.max_len, mesh)
    if setup.draft_cfg is None:
        return target, target
    g, exits = setup.spec.gamma, setup.spec.exits
    passed = (len(exits) - 1) * _head_bytes(setup.draft_cfg, mesh)
    fill = (_kv_fill_bytes(setup.draft_cfg, exits[0], exits[-1], mesh)
            if setup.spec.kv_fill == "calm" else 0)
    return (target + g * (_draft_bytes(setup, exits[0], mesh) + fill),
            target + g * (_draft_bytes(setup, exits[-1], mesh) + passed))


def _kv_fill_bytes(cfg, start: int, end: int, mesh) -> int:
    """Per-device bytes a step stopping at layer `start` still reads to fill the K/V of
    layers [start, end) (CALM: each layer's input norm, wk and wv applied to the exit's
    hidden state; the cache must hold keys for the later tokens that attend to them)."""
    if end <= start:
        return 0
    from s2d_jax.decode.aot import abstract_params
    layers = dict(abstract_params(cfg, mesh))["layers"]
    stacks = tree_bytes_per_device({n: layers[n] for n in ("attn_norm", "wk", "wv")})
    return stacks * (end - start) // cfg.num_layers


def _head_bytes(cfg, mesh) -> int:
    """Per-device bytes of the final norm and the head (the tied embedding where there is
    no lm_head)."""
    from s2d_jax.decode.aot import abstract_params
    params = dict(abstract_params(cfg, mesh))
    return tree_bytes_per_device({k: params[k] for k in ("final_norm", "lm_head", "embed")
                                  if k in params and (k != "embed" or "lm_head" not in params)})


def float32_twin(cfg):
    """(cfg in float32, bytes factor back to cfg's dtype): the roofline's HLO is compiled in
    float32, where XLA:CPU runs the ops an accelerator runs in bf16 (no widening of weights
    before each matmul), and its bytes scaled by the itemsize ratio (small float32 buffers a
    bf16 program keeps, softmax statistics, are scaled too: a slight undercount)."""
    if cfg is None or cfg.param_dtype not in ("bfloat16", "float16"):
        return cfg, 1.0
    return dataclasses.replace(cfg, dtype="float32", param_dtype="float32"), 0.5


def scaled(traffic, factor: float):
    """A Traffic with every byte count times `factor`."""
    if factor == 1.0:
        return traffic
    return dataclasses.replace(traffic, lo=int(traffic.lo * factor), hi=int(traffic.hi * factor),
                               ops={k: int(v * factor) for k, v in traffic.ops.items()})


@dataclasses.dataclass
class RoundBound:
    """One method's round: HLO traffic (hlo_traffic.Traffic) beside its minimum bytes."""

    method: str
    traffic: object
    minimum: tuple[int, int]
    gamma: int


def _ms(x: float) -> str:
    """Milliseconds to 3 decimals, or to 3 significant digits below 1 (a tiny model's
    round), never in e-notation."""
    digits = 3 if x >= 1 or x <= 0 else max(3, 2 - math.floor(math.log10(x)))
    return f"{x:.{digits}f}"


def _span(lo: float, hi: float, fmt) -> str:
    """lo, or 'lo..hi' where they differ; `fmt`: a format string or a function."""
    fmt = fmt if callable(fmt) else fmt.format
    return fmt(lo) if abs(hi - lo) <= 1e-9 * max(hi, 1) else \
        f"{fmt(lo)}..{fmt(hi)}"


def format_roofline(rounds: list[RoundBound], bandwidth: float, device: str,
                    acceptances=DEFAULT_ACCEPTANCE, top: int = 3) -> list[str]:
    """Printable lines: per method the round's bytes beside the minimum and the time bound;
    Lemma 3.1's speedups at each acceptance against AR; what each method moves above its
    minimum, op by op."""
    gib = 2**30
    lines = [f"  roofline at {bandwidth / 1e12:.3g} TB/s ({device}): a LOWER BOUND on each "
             f"round's time (bytes moved / bandwidth), not a measurement",
             f"    {'method':<8}{'round bytes/device':>22}{'minimum':>20}{'round time >=':>22}"]
    for r in rounds:
        t = r.traffic
        lines.append(f"    {r.method:<8}{_span(t.lo / gib, t.hi / gib, '{:.3f}'):>18} GiB"
                     f"{_span(r.minimum[0] / gib, r.minimum[1] / gib, '{:.3f}'):>16} GiB"
                     f"{_span(1e3 * t.lo / bandwidth, 1e3 * t.hi / bandwidth, _ms):>19} ms")
    ar = next((r for r in rounds if has(r.method, proposes=False)), None)
    for a in acceptances if ar is not None else ():
        parts = []
        for r in rounds:
            if r is ar:
                continue
            n = expected_tokens(a, r.gamma)
            fast, slow = (lemma_speedup(ar.traffic.hi, r.traffic.lo, n),
                          lemma_speedup(ar.traffic.hi, r.traffic.hi, n))
            parts.append(f"{r.method} {_span(slow, fast, '{:.2f}')}x")
        lines.append(f"    Lemma 3.1 speedup bound at acceptance {a:g} ({n:.2f} tokens a "
                     f"round, gamma {rounds[-1].gamma}): {', '.join(parts)}")
    lines += [_excess_line(r, top) for r in rounds] + [EXCESS_LEGEND]
    if any(r.traffic.guessed_loops for r in rounds):
        lines.append("    note: some loops had no known trip count and count once")
    return lines


EXCESS_LEGEND = ("    (matmuls: their activations and results beyond the weights, and S2D's "
                 "head at every exit it passes; attention blocks: the scores and "
                 "probabilities written and read between the two matmuls of each cache "
                 "block, which a fused attention kernel keeps on chip; other: elementwise "
                 "ops on the activations - residual adds, RMSNorm, SwiGLU)")


def _excess_line(r: RoundBound, top: int) -> str:
    """A method's bytes over its (deepest) minimum, op by op: the largest ops, and the
    excess split into the matmuls' and cache reads' own excess, the attention's blocks
    (ops of attention.py's `attention_block` scope) and the rest."""
    gib = 2**30
    ops = r.traffic.top_ops(len(r.traffic.ops))
    matmuls = sum(b for n, b in ops if MINIMUM_OPS.search(n)) - r.minimum[1]
    blocks = [(n, b) for n, b in ops if not MINIMUM_OPS.search(n) and ATTENTION_OPS.search(n)]
    rest = [(n, b) for n, b in ops if not MINIMUM_OPS.search(n) and not ATTENTION_OPS.search(n)]
    fmt = lambda rows: ", ".join(f"{n} {b / gib:.3f}" for n, b in rows[:top])  # noqa: E731
    return (f"    {r.method}: {(r.traffic.hi - r.minimum[1]) / gib:+.3f} GiB over the minimum; "
            f"largest ops (GiB): {fmt(ops)}; the excess: matmuls and cache reads "
            f"{matmuls / gib:+.3f}, attention blocks {sum(b for _, b in blocks) / gib:.3f} "
            f"({fmt(blocks)}), other {sum(b for _, b in rest) / gib:.3f} ({fmt(rest)})")
