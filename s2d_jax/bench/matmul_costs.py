"""Decode-path matmul costs for M = 1..8 rows, the small-matmul kernel beside XLA's dots.

Speculative decoding pays when verifying k tokens costs about one step; on CPU that rests
on the matmuls (model/small_matmul.py). Measured here in one process, the probes timed in
turn (round-robin, median of `repeats`), so both paths see the same machine state:
- each projection of a decoder block (wq .. w_down) across all layers, as a step reads
  them (one layer's weights after another from the stacks), the cached attention of all
  layers (cpu_attention.cc or XLA's blockwise path) and the LM head;
- the whole cached forward of k tokens (model.forward with a K/V cache, the target's
  verify call; k = 1 is the decode step), inside a loop on a carried cache as the engine
  runs it (per forward: (T(n forwards) - T(0)) / n).
Ratios are to the same path's M = 1.

`format_probes` / `format_table`: the whole cached forward per weight format (float32 as
loaded; Q8_0, Q4_0, Q4_1 blocks of 32 as a GGUF holds them, quantized here by
ggml_quantize, the head untied and quantized as a GGUF's output weight) on the kernels,
each format's quantized matrices read as stored (quant_matmul.cc).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

import dataclasses

from s2d_jax.config import ModelConfig
from s2d_jax.model import small_matmul
from s2d_jax.model import transformer as model
from s2d_jax.model.attention import ATTENTION_BLOCK, cache_attention
from s2d_jax.model.kvcache import init_cache

# name -> einsum of the block (x's letters, then the weight's) as model.block.block runs it
PROJECTIONS = {"wq": "BTD,DNH->BTNH", "wk": "BTD,DKH->BTKH", "wv": "BTD,DKH->BTKH",
               "wo": "BTNH,NHD->BTD", "w_gate": "BTD,DF->BTF", "w_up": "BTD,DF->BTF",
               "w_down": "BTF,FD->BTD"}
PATHS = ("kernel", "xla")


def _projection_fn(eq: str, kernel: bool):
    """(stack, x) -> the projection applied with every layer's weight in turn; each layer's
    input depends on the last output (one element), so no layer's work can be skipped."""
    def run(stack, x):
        def body(l, carry):
            x, acc = carry
            y = model.dense(eq, x, small_matmul.StackedWeight(stack, l), x.dtype, kernel)
            return x.at[(0,) * x.ndim].add(1e-6 * y.reshape(-1)[0]), acc + y.reshape(-1)[0]
        # a quantized stack's .shape is one layer's; its q holds the layer axis
        layers = (stack.q if hasattr(stack, "q") else stack).shape[0]
        return jax.lax.fori_loop(0, layers, body, (x, jnp.float32(0)))[1]
    return run


def _attention_fn(cfg: ModelConfig):
    """(cache, q, positions) -> the cached attention of every layer in turn, as a step
    runs it (the kernel, or XLA's blockwise path); chained as the projections are."""
    def run(cache, q, pos):
        def body(l, carry):
            q, acc = carry
            y = cache_attention(q, cache.k, cache.v, l, pos, cfg, ATTENTION_BLOCK)
            return q.at[(0,) * q.ndim].add(1e-6 * y.reshape(-1)[0]), acc + y.reshape(-1)[0]
        return jax.lax.fori_loop(0, cfg.num_layers, body, (q, jnp.float32(0)))[1]
    return run


def _head_fn(cfg: ModelConfig):
    return lambda params, h: model.lm_logits(params, cfg, h, decode=True)


def _compile(fn, kernel: bool, *args, activations: str | None = None):
    """fn jitted and compiled with the kernel (on any CPU it is built on) or with XLA's dots;
    `activations` ("int8" / "float"): how the block-quantized kernels take them (default: the
    decode path's, small_matmul.activation_mode)."""
    import contextlib
    acts = (small_matmul.quant_activations(activations) if activations
            else contextlib.nullcontext())
    with small_matmul.forced() if kernel else small_matmul.disabled(), acts:
        return jax.jit(fn).lower(*args).compile()


def probes(params: dict, cfg: ModelConfig, rows: list[int], max_len: int, position: int):
    """{(item, path, M): (compiled, args)} for every projection, the head and the step."""
    out = {}
    dt = jnp.dtype(cfg.dtype)
    for m in rows:
        for path in PATHS:
            # the kernel where it can be built (else both rows time XLA's dots)
            kernel = path == "kernel" and small_matmul.built() and m <= small_matmul.MAX_ROWS
            for name, eq in PROJECTIONS.items():
                stack = params["layers"][name]
                lead = 2 if name == "wo" else 1
                x = jnp.ones((1, m) + stack.shape[1:1 + lead], dt)
                out[(name, path, m)] = (_compile(_projection_fn(eq, kernel), kernel, stack, x),
                                        (stack, x))
            h = jnp.ones((1, m, cfg.hidden_size), dt)
            out[("head", path, m)] = (_compile(_head_fn(cfg), kernel, params, h), (params, h))
            cache = init_cache(cfg, 1, max_len)
            toks = jnp.ones((1, m), jnp.int32)
            pos = position + jnp.arange(m, dtype=jnp.int32)[None]
            q = jnp.ones((1, m, cfg.num_heads, cfg.head_dim), dt)
            out[("attention", path, m)] = (_compile(_attention_fn(cfg), kernel, cache, q, pos),
                                           (cache, q, pos))
            loop = _compile(_step_loop_fn(cfg), kernel, params, cache, toks, pos, jnp.int32(0))
            for key, n in (("step", STEP_CALLS), ("step_empty", 0)):
                out[(key, path, m)] = (loop, (params, cache, toks, pos, jnp.int32(n)))
    return out


# Forwards per timed step loop; a step is (T(STEP_CALLS) - T(0)) / STEP_CALLS, which removes
# the dispatch and the copy of the (not donated) cache on entry.
STEP_CALLS = 8


def _step_loop_fn(cfg: ModelConfig):
    """n cached forwards of the same tokens on a carried cache (updated in place, as in
    the engine's loop); the sum of a logit keeps every forward's work live."""
    def run(params, cache, toks, pos, n):
        def body(i, carry):
            cache, acc = carry
            logits, cache = model.forward(params, cfg, toks, pos, cache)
            return cache, acc + logits[0, -1, 0]
        return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))[1]
    return run


def measure(compiled: dict, repeats: int, statistic=statistics.median) -> dict:
    """Median (or `statistic`, e.g. min on a machine shared with other work) seconds per
    probe, probes called in turn `repeats` times (after one warm-up)."""
    times = {key: [] for key in compiled}
    for key, (fn, args) in compiled.items():
        jax.block_until_ready(fn(*args))
    for _ in range(repeats):
        for key, (fn, args) in compiled.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[key].append(time.perf_counter() - t)
    return {key: statistic(v) for key, v in times.items()}


def table(med: dict, rows: list[int]) -> list[str]:
    """One line per item and path: ms at each M and the ratio to M = 1."""
    med = dict(med)
    for m in rows:
        for path in PATHS:
            med[("step", path, m)] = (med[("step", path, m)] - med.pop(("step_empty", path, m))) / STEP_CALLS
    items = list(PROJECTIONS) + ["attention", "head", "step"]
    lines = [f"{'item':9} {'path':6} " + " ".join(f"{'M=' + str(m):>14}" for m in rows)]
    for item in items:
        for path in PATHS:
            base = med[(item, path, rows[0])]
            cells = [f"{med[(item, path, m)] * 1e3:7.3f} ({med[(item, path, m)] / base:4.2f})"
                     for m in rows]
            lines.append(f"{item:9} {path:6} " + " ".join(cells))
    lines.append("ms per call (ratio to M = %d); projections and attention: summed over all layers" % rows[0])
    return lines


def format_params(params: dict, cfg: ModelConfig, fmt: str):
    """(params, cfg) of `fmt`: "f32" as given, else the layer matrices and the (untied)
    head in GGUF blocks of 32."""
    from s2d_jax.bench.ggml_quantize import quantize_model, untied
    if fmt == "f32":
        return params, cfg
    if cfg.tie_word_embeddings:
        params, cfg = untied(params), dataclasses.replace(cfg, tie_word_embeddings=False)
    return quantize_model(params, fmt), cfg


def format_probes(params: dict, cfg: ModelConfig, formats: list[str], rows: list[int],
                  max_len: int, position: int) -> dict:
    """{("step", fmt, M) / ("step_empty", fmt, M): (compiled, args)}: the cached forward
    loop of each format on the kernels ("<format>:xla": on XLA's dots, a quantized weight
    dequantized whole before its dot, the path without the kernels; "<format>:int8" /
    "<format>:float": the kernels taking the activations as int8 blocks or float32)."""
    out, made = {}, {}
    for fmt in formats:
        weights, _, path = fmt.partition(":")  # "Q4_1:xla": XLA's dots (dequantize, then dot)
        if weights not in made:
            made[weights] = format_params(params, cfg, weights)
        p, c = made[weights]
        for m in rows:
            cache = init_cache(c, 1, max_len)
            toks = jnp.ones((1, m), jnp.int32)
            pos = position + jnp.arange(m, dtype=jnp.int32)[None]
            loop = _compile(_step_loop_fn(c), path != "xla", p, cache, toks, pos, jnp.int32(0),
                            activations=path if path in small_matmul.ACTIVATION_MODES else None)
            for key, n in (("step", STEP_CALLS), ("step_empty", 0)):
                out[(key, fmt, m)] = (loop, (p, cache, toks, pos, jnp.int32(n)))
    return out


def format_table(med: dict, formats: list[str], rows: list[int]) -> list[str]:
    """One line per format: ms per cached forward at each M (ratio to the first format's)."""
    step = {(f, m): (med[("step", f, m)] - med[("step_empty", f, m)]) / STEP_CALLS
            for f in formats for m in rows}
    lines = [f"{'weights':8} " + " ".join(f"{'M=' + str(m):>16}" for m in rows)]
    for f in formats:
        lines.append(f"{f:8} " + " ".join(
            f"{step[(f, m)] * 1e3:8.2f} ({step[(f, m)] / step[(formats[0], m)]:4.2f})" for m in rows))
    lines.append(f"ms per cached forward of M tokens, on the kernels unless ':xla' (ratio to "
                 f"{formats[0]} at the same M)")
    return lines
