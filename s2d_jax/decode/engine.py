"""The jitted S2D generation: prefill, then a `lax.while_loop` whose body is one
speculative round (round.py: propose, verify, commit).

Autoregressive decoding (`ar`, gamma = 0: the round is one target step), vanilla SD
(`sd`), early-exit self-speculation (`self`), S2D (`s2d`), prompt lookup (`lookup`: no
draft model), the ladder (`ladder`: the lookup, then S2D's exits) and polybasic chains
(`spec.mus` non-empty, intermediate models in `mid_params`) all run this same code; only
the static Chain (chain.py: the configs, the SpecConfig, the mesh) and the params differ.

Public entry points (all pure; `chain` is the one static argument, so each function
compiles once per chain and shapes; params keep the sharding they arrive with, caches are
pinned to the mesh by kvcache.CACHE_AXES):
  generate(...)      -> GenState   whole generation in one jit
  prefill(...)       -> GenState   then decode_chunk(state, ...) -> GenState, donated;
                                   used for streaming and for the in-loop cost probes
  prefill_caches(...) -> (tokens, caches, last logits), then start(...) -> GenState:
                                   prefill in two programs, one prefill for several starts
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from s2d_jax.decode.chain import Chain
from s2d_jax.decode.drafting import with_exit_segments
from s2d_jax.decode.round import check_done, one_round
from s2d_jax.decode.sampling import probs_from_logits, sample
from s2d_jax.decode.state import DecodeParams, GenState, RoundStats
from s2d_jax.errors import S2DError
from s2d_jax.model import transformer as model
from s2d_jax.model.kvcache import cache_sharding, init_cache


def _place_cache(cache, mesh):
    """Pin a cache to the (Auto-axes) mesh by its logical axes (batch over data/fsdp, kv
    heads over tensor); the while loop then keeps that layout. No-op without a mesh."""
    if mesh is None or cache is None:
        return cache
    pin = functools.partial(jax.lax.with_sharding_constraint, shardings=cache_sharding(mesh))
    return cache.replace(k=pin(cache.k), v=pin(cache.v))


def _prefill_level(params, cfg, prompts, positions, max_len: int, mesh):
    """One level over the prompt: a fresh cache of `max_len` slots filled with the
    prompt's keys/values (all cfg.num_layers layers: a draft's cfg is already cut to its
    deepest exit, Chain) -> (hidden states [B, P, D] after the last layer, cache)."""
    cache = _place_cache(init_cache(cfg, prompts.shape[0], max_len), mesh)
    h = model.embed_tokens(params, cfg, prompts)
    return model.run_layers(params, cfg, h, positions, 0, cfg.num_layers, cache)


def _prefill_caches(draft_params, target_params, prompts, prompt_lens, mid_params=(), *,
                    chain: Chain):
    """Prompts [B, P] (right-padded), prompt_lens [B] >= 1 -> (tokens [B, max_len] holding
    the prompts, every level's cache of the prompts, the target's logits at each prompt's
    last position [B, V]): a prefill before its first token is drawn (`_start`)."""
    if len(mid_params) != len(chain.mids):
        raise S2DError(f"{len(chain.mids)} intermediate level(s) in the chain but "
                       f"{len(mid_params)} intermediate params")
    B, P = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    params = (draft_params,) + tuple(mid_params) + (target_params,)
    levels = [None if cfg is None else
              _prefill_level(p, cfg, prompts, positions, chain.spec.max_len, chain.mesh)
              for p, cfg in zip(params, chain.cfgs)]
    h, _ = levels[-1]
    h_last = jnp.take_along_axis(h, (prompt_lens - 1)[:, None, None], axis=1)
    # the head runs on one row per prompt, not P
    last_logits = model.lm_logits(target_params, chain.target, h_last, decode=True)[:, 0]
    valid = jnp.arange(P)[None, :] < prompt_lens[:, None]
    tokens = jnp.zeros((B, chain.spec.max_len), jnp.int32).at[:, :P].set(
        jnp.where(valid, prompts, 0))
    caches = [None if c is None else c[1].with_lengths(prompt_lens) for c in levels]
    return tokens, caches, last_logits


def _start(tokens, caches, last_logits, prompt_lens, dp: DecodeParams, key, *,
           chain: Chain) -> GenState:
    """A prefill's state after its first token, drawn from `last_logits` with `dp` and
    `key`: every later round starts from the invariant "caches hold positions <
    length - 1" (GenState). One prefill can start several requests of the same prompt
    (the slot engine's two temperatures of a corpus prompt)."""
    spec = chain.spec
    B = tokens.shape[0]
    key, k_first = jax.random.split(key)
    first = sample(k_first, probs_from_logits(last_logits, dp.sampling), dp.sampling.greedy)
    tokens = tokens.at[jnp.arange(B), prompt_lens].set(first)
    length = prompt_lens + 1
    done = check_done(length, prompt_lens, first == dp.eos_id, dp, spec)
    state = GenState(tokens=tokens, length=length, prompt_len=prompt_lens, done=done,
                     target_cache=None, draft_cache=None, key=key, round=jnp.int32(0),
                     stats=RoundStats.zeros(B, spec))
    return state.with_caches(caches)


def _prefill(draft_params, target_params, prompts, prompt_lens, dp: DecodeParams, key,
             mid_params=(), *, chain: Chain):
    """Prompts [B, P] (right-padded), prompt_lens [B] >= 1 -> state after the first token.

    The first new token comes from the prefill's target logits (`_start`). Padded prompt
    positions write junk keys/values, overwritten before any query can attend to them.
    """
    tokens, caches, last_logits = _prefill_caches(draft_params, target_params, prompts,
                                                  prompt_lens, mid_params, chain=chain)
    return _start(tokens, caches, last_logits, prompt_lens, dp, key, chain=chain)


def _decode_loop(state: GenState, draft_params, target_params, dp: DecodeParams, max_rounds,
                 mid_params=(), *, chain: Chain) -> GenState:
    """Run rounds until every row is done or `max_rounds` (traced) more rounds ran."""
    stop_at = state.round + max_rounds
    # not self: that would copy the target's layers; a streamed decode splits them once
    # (split_draft) instead of in every chunk
    if chain.spec.proposer.needs_draft and "exit_segments" not in draft_params:
        draft_params = with_exit_segments(draft_params, chain.spec.exits)
    params = (draft_params,) + tuple(mid_params) + (target_params,)

    def cond(s):
        return jnp.any(~s.done) & (s.round < stop_at)

    body = functools.partial(one_round, params=params, dp=dp, chain=chain)
    return jax.lax.while_loop(cond, body, state)


def _generate(draft_params, target_params, prompts, prompt_lens, dp: DecodeParams, key,
              mid_params=(), *, chain: Chain) -> GenState:
    state = _prefill(draft_params, target_params, prompts, prompt_lens, dp, key, mid_params,
                     chain=chain)
    # Every round adds >= 1 token to each active row, so max_len rounds always suffice.
    return _decode_loop(state, draft_params, target_params, dp, jnp.int32(chain.spec.max_len),
                        mid_params, chain=chain)


# XLA:GPU splits the contraction of a few-row GEMM over thread blocks and writes each
# block's partial sums to HBM in f32 for a reduce to read back (split-K): at a verify window
# of 8 rows x 5 tokens that is 15% more than the weight's own bytes for each MLP matrix of a
# 70B layer split 8 ways (docs/distributed.md). One pass reads each weight once (a choice
# by bytes, not yet timed on a GPU). Compiler options of GPU programs only.
GPU_COMPILER_OPTIONS = {"xla_gpu_experimental_force_split_k": 1}


class _PerChain:
    """A decode function jitted per chain: called (or lowered) at the top level for GPU
    devices, with GPU_COMPILER_OPTIONS; anywhere else (CPU, TPU, or inside another trace,
    where JAX takes no compiler options) as a plain jit."""

    def __init__(self, fn, **jit_kw):
        @functools.wraps(fn)
        def traced(*args, chain: Chain, **kwargs):
            with chain.kernel_scope():
                return fn(*args, chain=chain, **kwargs)
        self._plain = jax.jit(traced, static_argnames=("chain",), **jit_kw)
        self._gpu = jax.jit(traced, static_argnames=("chain",),
                            compiler_options=dict(GPU_COMPILER_OPTIONS), **jit_kw)
        functools.update_wrapper(self, fn)

    def _for(self, args, kwargs):
        chain = kwargs["chain"]
        platform = (chain.mesh.devices.flat[0].platform if chain.mesh is not None
                    else jax.default_backend())
        nested = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))
        return self._gpu if platform in ("gpu", "cuda", "rocm") and not nested else self._plain

    def __call__(self, *args, **kwargs):
        return self._for(args, kwargs)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._for(args, kwargs).lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return self._plain._cache_size() + self._gpu._cache_size()


def _jit_per_chain(fn, **jit_kw) -> _PerChain:
    """fn jitted with `chain` static (one program per chain and shapes), traced in the
    chain's kernel scope (Chain.kernel_scope); GPU programs with GPU_COMPILER_OPTIONS."""
    return _PerChain(fn, **jit_kw)


generate = _jit_per_chain(_generate)
prefill = _jit_per_chain(_prefill)
prefill_caches = _jit_per_chain(_prefill_caches)
start = _jit_per_chain(_start)
decode_chunk = _jit_per_chain(_decode_loop, donate_argnames=("state",))


def _split_draft(draft_params, *, chain: Chain):
    """The draft's exit segments, sliced once for a streamed decode's many chunks (each
    chunk would otherwise copy the draft's layers again)."""
    if chain.spec.proposer.needs_draft and "exit_segments" not in draft_params:
        return with_exit_segments(draft_params, chain.spec.exits)
    return draft_params


split_draft = _jit_per_chain(_split_draft)
