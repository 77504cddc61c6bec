"""What one draft step of a sorted draft spends its time on, relative to a target step.

A draft step (drafting.draft_token) stopping at exit i runs the exit segments 0..i, one
head and one confidence per exit reached, the token draw, and the CALM K/V fill of the
layers it skipped, all under the escalation's `lax.cond`s. Each part is timed here alone,
and the whole step forced to stop at exit i (loop_costs.forced_exit_thresholds) beside
them: overhead = whole - the parts that step needs, i.e. what the step pays beyond its
useful work (the conds, the per-row selects, the embedding lookup, and the confidences
of the zero logits a skipped level still scores). The target's one-token decode step is
the unit everything is shown against.

Each item is timed the way loop_costs / call_costs time a call: a jitted `lax.fori_loop`
of `steps` iterations on a carried state (the K/V cache where the item writes it), at
the buffer length the generation uses (attention and cache updates cover the whole static
buffer), per iteration = (median T(steps) - median T(0)) / steps, the probes sampled in
turn. Every iteration depends on the last one's result (call `_chain`), or XLA would hoist
the loop-invariant work out of the loop and time nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp

from s2d_jax.bench.call_costs import CallProbe, draft_step_probes
from s2d_jax.config import ModelConfig
from s2d_jax.decode.drafting import fill_skipped_kv, with_exit_segments
from s2d_jax.decode.sampling import SamplingParams, confidence, probs_from_logits, sample
from s2d_jax.errors import S2DError
from s2d_jax.model import transformer as model
from s2d_jax.model.exits import exits_problem
from s2d_jax.model.kvcache import init_cache

SHARED_ITEMS = ("head", "full_head", "confidence", "draw")  # the same cost at every exit
EXIT_ITEMS = ("segment", "fill", "step", "overhead")
LABELS = {"target_step": "target decode step (forward, T=1)",
          "head": "head (final norm + LM head)", "full_head": "full-vocabulary head",
          "confidence": "confidence", "draw": "token draw",
          "segment": "segment", "fill": "CALM K/V fill", "step": "whole draft step",
          "overhead": "overhead (whole - parts)"}


def _chain(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """x with its first element moved by y's first: the next iteration depends on this
    one's result at the cost of one element."""
    first = (0,) * x.ndim
    return x.at[first].add(1e-6 * y.reshape(-1)[0].astype(x.dtype))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _target_loop(params, cache, tok, pos, n, *, cfg):
    """n one-token target decode steps (model.forward with the cache); each step's greedy
    token is the next step's input."""
    def body(i, carry):
        cache, tok = carry
        logits, cache = model.forward(params, cfg, tok[:, None], pos + i, cache)
        return cache, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    return jax.lax.fori_loop(0, n, body, (cache, tok))


@functools.partial(jax.jit, static_argnames=("cfg", "exits", "i"))
def _segment_loop(params, cache, h, pos, n, *, cfg, exits, i):
    """n runs of exit segment i (layers [e_{i-1}, e_i)) on one token, writing its K/V."""
    lo, hi = (exits[i - 1] if i else 0), exits[i]
    seg = with_exit_segments(params, exits)["exit_segments"][i]  # sliced once, as the engine

    def body(j, carry):
        h, cache = carry
        return model.decode_layers(params, cfg, h, pos + j, lo, hi, cache, layers=seg)

    return jax.lax.fori_loop(0, n, body, (h, cache))


@functools.partial(jax.jit, static_argnames=("cfg", "exits"))
def _head_loop(params, h, n, *, cfg, exits):
    """n head applications (lm_logits on [B, D]) as the draft step makes them (with the
    pre-gathered sub-vocabulary rows if the draft has them); the loop adds a max over the
    logits to feed back (a read of [B, V], small beside the [D, V] head)."""
    params = with_exit_segments(params, exits)

    def body(_, h):
        logits = model.lm_logits(params, cfg, h)
        return _chain(h, jnp.max(logits))

    return jax.lax.fori_loop(0, n, body, h)


@functools.partial(jax.jit, static_argnames=("kind",))
def _confidence_loop(logits, sp, n, *, kind):
    def body(_, logits):
        return _chain(logits, confidence(logits, sp, kind))

    return jax.lax.fori_loop(0, n, body, logits)


@jax.jit
def _draw_loop(logits, sp, key, n):
    """n token draws (the draft step's probs_from_logits + sample on the kept logits)."""
    def body(i, logits):
        tok = sample(jax.random.fold_in(key, i), probs_from_logits(logits, sp), sp.greedy)
        return _chain(logits, tok)

    return jax.lax.fori_loop(0, n, body, logits)


@functools.partial(jax.jit, static_argnames=("cfg", "exits", "i"))
def _fill_loop(params, cache, h, pos, n, *, cfg, exits, i):
    """n CALM fills of what a step stopping at exit i skips: segment by segment, as the
    step's skip branches fill them ([e_i, e_{i+1}), then [e_{i+1}, e_{i+2}), ...)."""
    segs = with_exit_segments(params, exits)["exit_segments"]
    bounds = tuple(zip(exits[i:-1], exits[i + 1:]))

    def body(j, carry):
        h, cache = carry
        for k, (lo, hi) in enumerate(bounds, start=i + 1):
            cache = fill_skipped_kv(params, cfg, h, pos + j, lo, hi, cache, segs[k])
        return _chain(h, cache.k[exits[i], 0, :, pos[0, 0] + j]), cache

    return jax.lax.fori_loop(0, n, body, (h, cache))


def _per_iteration(probe: CallProbe) -> float:
    """(median T(steps) - median T(0)) / steps. Unlike CallProbe.result() it does not
    refuse a result <= 0: a part that cheap is below the machine's noise, and the report
    shows that rather than losing the other items."""
    med = statistics.median
    return (med(probe.times[probe.calls]) - med(probe.times[0])) / probe.calls


def _probes(draft_cfg, draft_params, exits, target_cfg, target_params, *, batch, max_len,
            steps, sp, conf_kind, start) -> dict:
    """{item: CallProbe} (exit items as "segment/i" ...), compiled."""
    m, B = len(exits), batch
    cache_cfg = dataclasses.replace(draft_cfg, num_layers=exits[-1])  # the engine's cache
    cache = init_cache(cache_cfg, B, max_len).with_lengths(jnp.full((B,), start, jnp.int32))
    pos = jnp.full((B, 1), start, jnp.int32)
    dt = jnp.dtype(draft_cfg.dtype)
    h = jax.random.normal(jax.random.key(1), (B, 1, draft_cfg.hidden_size)).astype(dt)
    logits = jax.random.normal(jax.random.key(2), (B, draft_cfg.vocab_size), jnp.float32)
    key = jax.random.key(0)
    tok = jnp.ones((B,), jnp.int32)
    probes = {"target_step": CallProbe(
        functools.partial(_target_loop, cfg=target_cfg),
        (target_params, init_cache(target_cfg, B, max_len), tok, pos), steps)}
    heads = {"head": draft_params}
    if "head_ids" in draft_params:
        heads["full_head"] = {k: v for k, v in draft_params.items()
                              if k not in ("head_ids", "head_rows")}
    for name, p in heads.items():
        probes[name] = CallProbe(functools.partial(_head_loop, cfg=draft_cfg, exits=exits),
                                 (p, h[:, 0]), steps)
    probes["confidence"] = CallProbe(functools.partial(_confidence_loop, kind=conf_kind),
                                     (logits, sp), steps)
    probes["draw"] = CallProbe(_draw_loop, (logits, sp, key), steps)
    for i in range(m):
        kw = dict(cfg=cache_cfg, exits=exits, i=i)
        probes[f"segment/{i}"] = CallProbe(functools.partial(_segment_loop, **kw),
                                           (draft_params, cache, h, pos), steps)
        if i < m - 1:
            probes[f"fill/{i}"] = CallProbe(functools.partial(_fill_loop, **kw),
                                            (draft_params, cache, h, pos), steps)
    whole = draft_step_probes(draft_params, draft_cfg, exits, start=start, max_len=max_len,
                              temperature=float(sp.temperature), conf_kind=conf_kind,
                              calls=steps, batch=B)
    probes.update({f"step/{i}": p for i, p in enumerate(whole)})
    return probes


def draft_step_breakdown(draft_cfg: ModelConfig, draft_params: dict, exits, *,
                         target_cfg: ModelConfig, target_params: dict, batch: int = 1,
                         max_len: int, samples: int = 5, steps: int = 32,
                         temperature: float = 0.0, conf_kind: str = "max_prob") -> dict:
    """Seconds per draft-step part, and each over the target's decode step ("_x" keys).

    Returns {"target_step_s", "head_s", "confidence_s", "draw_s" (+ "full_head_s" when the
    draft has a sub-vocabulary head, params["head_ids"]), each with its "_x" ratio, and
    "exits": one dict per exit i: "exit", "layers" [e_{i-1}, e_i), "fill_layers"
    [e_i, e_m), "segment_s", "fill_s" (0 at the last exit: nothing is skipped), "step_s"
    (the whole draft_token forced to stop at i), "parts_s" (segments 0..i, i + 1 heads and
    confidences, the fill, the draw), "overhead_s" = step_s - parts_s (a difference of
    medians), each with "_x"; plus the settings}. An item timed at <= 0 was below the
    machine's noise (raise steps or samples); only the unit must be measurable.
    """
    problem = exits_problem(exits, draft_cfg.num_layers)
    if problem:
        raise S2DError(f"exits {list(exits)} must increase within the draft's "
                       f"{draft_cfg.num_layers} layers: {problem}")
    exits = tuple(int(e) for e in exits)
    for flag, v in (("batch", batch), ("samples", samples), ("steps", steps)):
        if v < 1:
            raise S2DError(f"the step breakdown's {flag} must be >= 1, got {v}")
    if steps + 1 > max_len:
        raise S2DError(f"a buffer of {max_len} tokens cannot hold {steps} timed steps; "
                       f"lower steps or raise max_len")
    start = min(max_len // 2, max_len - steps - 1)  # every step writes inside the buffer
    sp = SamplingParams.make(temperature)
    probes = _probes(draft_cfg, draft_params, exits, target_cfg, target_params, batch=batch,
                     max_len=max_len, steps=steps, sp=sp, conf_kind=conf_kind, start=start)
    for _ in range(samples):
        for p in probes.values():
            p.sample()
    t = {name: _per_iteration(p) for name, p in probes.items()}
    unit = t["target_step"]
    if unit <= 0:
        raise S2DError(f"the target's decode step measured no time over {samples} samples "
                       f"of {steps} steps (a noisy machine); raise samples or steps")

    def item(name: str, seconds: float) -> dict:
        return {f"{name}_s": seconds, f"{name}_x": seconds / unit}

    out = {"max_len": max_len, "batch": batch, "steps": steps, "samples": samples,
           "temperature": float(temperature), "confidence_kind": conf_kind,
           **item("target_step", unit)}
    for name in SHARED_ITEMS:
        if name in t:
            out.update(item(name, t[name]))
    out["exits"] = []
    for i, e in enumerate(exits):
        fill = t.get(f"fill/{i}", 0.0)
        parts = (sum(t[f"segment/{k}"] for k in range(i + 1))
                 + (i + 1) * (t["head"] + t["confidence"]) + fill + t["draw"])
        step = t[f"step/{i}"]
        out["exits"].append({"exit": e, "layers": [exits[i - 1] if i else 0, e],
                             "fill_layers": [e, exits[-1]],
                             **item("segment", t[f"segment/{i}"]), **item("fill", fill),
                             **item("step", step), **item("parts", parts),
                             **item("overhead", step - parts)})
    return out


def format_breakdown(d: dict) -> list[str]:
    """Markdown table lines (item | ms | x target step) of a draft_step_breakdown result:
    the target step, the shared items, then per exit its segment, fill, whole step and
    overhead."""
    def row(label: str, entry: dict, name: str) -> str:
        return f"| {label} | {1e3 * entry[f'{name}_s']:.3f} | {entry[f'{name}_x']:.3f} |"

    lines = [f"Draft step breakdown (buffer {d['max_len']}, batch {d['batch']}, "
             f"T={d['temperature']:g}; median of {d['samples']} loops of {d['steps']} "
             f"iterations):", "", "| item | ms | x target step |", "|---|---|---|",
             row(LABELS["target_step"], d, "target_step")]
    lines += [row(LABELS[n], d, n) for n in SHARED_ITEMS if f"{n}_s" in d]
    for e in d["exits"]:
        lo, hi = e["layers"]
        at = f"exit {e['exit']}:"
        lines.append(row(f"{at} {LABELS['segment']} (layers {lo}-{hi - 1})", e, "segment"))
        flo, fhi = e["fill_layers"]
        skipped = f"layers {flo}-{fhi - 1}" if fhi > flo else "none skipped"
        lines.append(row(f"{at} {LABELS['fill']} ({skipped})", e, "fill"))
        lines.append(row(f"{at} {LABELS['step']}", e, "step"))
        lines.append(row(f"{at} {LABELS['overhead']}", e, "overhead"))
    return lines
