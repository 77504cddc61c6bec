"""Per-call costs of a chain's levels, timed inside one jitted loop.

The insertion rule (theory.py, Lemma 3.1 / Theorem 3.2 forms) needs the cost of one call
of each level: a target or intermediate forward + verification over a catch-up window and
a block (the engine's round.verify), and one draft step stopping at each exit (its
drafting.draft_token on pre-sliced exit segments). Timing each call as its own jitted
call (one dispatch, a cache handed back and forth) made them 10-50% dearer than the same
call inside the engine's while loop, and the chain predictions missed by as much. Here a
`lax.fori_loop` runs the call `n` times on a carried cache in one program (the way the
engine runs it), and a probe takes (median T(n calls) - median T(0 calls)) / n: the empty
run removes dispatch and the copies of the arguments.

Like loop_costs.LoopProbe, a CallProbe compiles once, is `sample()`d between the
benchmark's prompts (so costs and runs see the same machine) and gives `result()`.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from s2d_jax.bench.loop_costs import forced_exit_thresholds
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.round import Proposal, RoundCtx, verify
from s2d_jax.decode.drafting import draft_token, with_exit_segments
from s2d_jax.decode.sampling import SamplingParams
from s2d_jax.decode.state import DecodeParams, RoundStats, SpecConfig
from s2d_jax.errors import S2DError
from s2d_jax.model.kvcache import init_cache

CALLS = 24  # calls per timed loop: long enough to dwarf the dispatch, short for the probes


def verify_chain(cfg, window: int, block: int, max_len: int) -> Chain:
    """A chain of `cfg` at every level whose level 1 feeds a catch-up window of `window`
    tokens before a block of `block`: round.verify then makes exactly the call a level
    with that window makes in the engine (the target of a two-level round: window 1; the
    intermediate of a 3-level chain: window 2)."""
    spec = SpecConfig(method="s2d", exits=(1,), gamma=max(block, 1), max_len=max_len,
                      mus=(1,) * (window - 1))
    return Chain(cfg, (cfg,) * (window - 1), cfg, spec)


@functools.partial(jax.jit, static_argnames=("chain",))
def _verify_loop(params, cache, toks, start, q, key, dp, n, *, chain):
    """n calls of the engine's round.verify (level 1 of `spec`: a forward over the
    window + block, the distributions, the accept rule) on the block at toks[start:];
    each call depends on the cache the last one wrote."""
    B, M = q.shape[:2]
    spec = chain.spec
    L = spec.num_levels
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)
    ctx = RoundCtx(work=toks, end=jnp.full((B,), start, jnp.int32),
                   caches=(None, cache) + (None,) * (L - 2), key=key, calls=zeros((L,)),
                   stats=RoundStats.zeros(B, spec))
    block = Proposal(q, jnp.full((B,), M, jnp.int32), zeros((B, M)))
    rows = jnp.ones((B,), bool)

    def body(i, carry):
        ctx, acc = carry
        ctx, v = verify(ctx.replace(key=jax.random.fold_in(key, i)), 1, block, rows, params,
                        dp, chain)
        return ctx, acc + v.accepted[0] + v.next_token[0]

    return jax.lax.fori_loop(0, n, body, (ctx, jnp.int32(0)))[1]


@functools.partial(jax.jit, static_argnames=("cfg", "exits", "conf_kind", "kv_fill"))
def _draft_loop(params, cache, tok, pos, key, sp, thresholds, n, *, cfg, exits, conf_kind,
                kv_fill):
    """n draft steps (drafting.draft_token, one fed token each) on the engine's pre-sliced
    exit segments; the token each step drafts is the next step's input."""
    params = with_exit_segments(params, exits)

    def body(i, carry):
        cache, prev = carry
        d, _, _, _, cache = draft_token(params, cfg, cache, prev[:, None], pos + i,
                                        jax.random.fold_in(key, i), sp, thresholds, exits,
                                        conf_kind, kv_fill)
        return cache, d

    return jax.lax.fori_loop(0, n, body, (cache, tok))[1]


class CallProbe:
    """One call kind, compiled; `sample()` times a loop of 0 and of CALLS calls."""

    def __init__(self, loop, args: tuple, calls: int = CALLS):
        self.loop, self.args, self.calls = loop, args, calls
        jax.block_until_ready(loop(*args, jnp.int32(1)))  # compile (n is traced)
        self.times = {0: [], calls: []}

    def sample(self) -> None:
        for n in self.times:
            t0 = time.perf_counter()
            jax.block_until_ready(self.loop(*self.args, jnp.int32(n)))
            self.times[n].append(time.perf_counter() - t0)

    def result(self) -> float:
        if not self.times[0]:
            raise S2DError("CallProbe.result() before any sample(); call sample() first")
        med = statistics.median
        cost = (med(self.times[self.calls]) - med(self.times[0])) / self.calls
        if cost <= 0:
            raise S2DError(f"the call probe measured no time for {self.calls} calls over an "
                           f"empty loop ({len(self.times[0])} samples): the machine was too "
                           f"noisy; sample() more often or time more calls per loop (calls=)")
        return cost


def verify_probe(params, cfg, *, window: int, block: int, start: int, max_len: int,
                 temperature: float = 0.0, calls: int = CALLS,
                 compiler_options: dict | None = None) -> CallProbe:
    """Cost of one call of a level scoring `block` proposed tokens after a catch-up window
    of `window` tokens (block 0, window 1: one autoregressive step), on a cache of the
    benchmark's length (attention covers the whole buffer, so only the shapes and greedy
    vs sampling, a different program, matter; not the token values). `compiler_options`:
    XLA flags of this probe's compile alone (e.g. {"xla_gpu_enable_triton_gemm": False})."""
    chain = verify_chain(cfg, window, block, max_len)
    start = max(window, min(start, max_len - block - 1))
    q = jnp.full((1, block, cfg.vocab_size), 1.0 / cfg.vocab_size, jnp.float32)
    dp = DecodeParams.make(chain.spec, [0.0], temperature=temperature)
    args = (params, init_cache(cfg, 1, max_len), jnp.ones((1, max_len), jnp.int32),
            jnp.int32(start), q, jax.random.key(0), dp)
    loop = functools.partial(_verify_loop, chain=chain)
    if compiler_options:
        loop = _verify_loop.lower(*args, jnp.int32(1), chain=chain).compile(compiler_options)
    return CallProbe(loop, args, calls)


def draft_step_probes(params, cfg, exits: tuple, *, start: int, max_len: int,
                      temperature: float = 0.0, conf_kind: str = "max_prob",
                      kv_fill: str = "calm", calls: int = CALLS,
                      batch: int = 1) -> list[CallProbe]:
    """One probe per exit j: a draft step of the sorted draft with `exits` forced to stop
    at exit j (thresholds are traced: one compilation serves every exit), for `batch`
    rows."""
    exits = tuple(int(e) for e in exits)
    cfg = dataclasses.replace(cfg, num_layers=exits[-1])  # the engine's draft cache
    start = max(0, min(start, max_len - calls - 1))
    loop = functools.partial(_draft_loop, cfg=cfg, exits=exits, conf_kind=conf_kind,
                             kv_fill=kv_fill)
    probes = []
    for j in range(len(exits)):
        th = jnp.asarray(forced_exit_thresholds(len(exits), j), jnp.float32)
        args = (params, init_cache(cfg, batch, max_len), jnp.ones((batch,), jnp.int32),
                jnp.full((batch, 1), start, jnp.int32), jax.random.key(0),
                SamplingParams.make(temperature), th)
        probes.append(CallProbe(loop, args, calls))
    return probes

