"""The jitted S2D generation: prefill, then a `lax.while_loop` of speculative rounds.

A round: the chain below the target (chain.py) builds a block: the draft proposes up to
gamma tokens (escalating per token, drafting.py) and each intermediate level, if any,
verifies and accumulates until it holds mu_k tokens; the target scores the block with one
forward, accepts a prefix by the lossless rule (sampling.py), adds its correction or bonus
token; rollback only moves what each cache is trusted for. Autoregressive decoding (`ar`,
gamma = 0: the round is one target step), vanilla SD (`sd`), early-exit self-speculation
(`self`), S2D (`s2d`) and polybasic chains (`spec.mus` non-empty, intermediate models in
`mid_params` / `mid_cfgs`) all run this same code; only the static SpecConfig and the
params differ.

Public entry points (all pure; cfgs, spec and the optional mesh are static; params keep
the sharding they arrive with, caches are pinned to the mesh by CACHE_AXES):
  generate(...)      -> GenState   whole generation in one jit
  prefill(...)       -> GenState   then decode_chunk(state, ...) -> GenState, donated;
                                   used for streaming and for draft/verify timing
  draft_phase / verify_phase       one round in two halves (timed separately on host):
                                   everything below the target, then the target
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from s2d_jax.model import transformer as model
from s2d_jax.decode.chain import RoundCtx, produce, verify_block
from s2d_jax.config import ModelConfig
from s2d_jax.decode.state import DecodeParams, GenState, SpecConfig
from s2d_jax.errors import S2DError
from s2d_jax.model.kvcache import init_cache
from s2d_jax.parallel.mesh import CACHE_AXES, spec as logical_spec
from s2d_jax.decode.drafting import with_exit_segments
from s2d_jax.decode.sampling import probs_from_logits, sample

STATIC = ("draft_cfg", "target_cfg", "spec", "mesh", "mid_cfgs")


def _place_cache(cache, mesh):
    """Pin a cache to the (Auto-axes) mesh by its logical axes (batch over data/fsdp, kv
    heads over tensor); the while loop then keeps that layout. No-op without a mesh."""
    if mesh is None or cache is None:
        return cache
    sharding = NamedSharding(mesh, logical_spec(CACHE_AXES))
    pin = functools.partial(jax.lax.with_sharding_constraint, shardings=sharding)
    return cache.replace(k=pin(cache.k), v=pin(cache.v))


def _check_done(length, prompt_len, done, dp: DecodeParams, spec: SpecConfig):
    """A row stops at max_new_tokens or when the next round could overflow the cache."""
    out_of_budget = length - prompt_len >= dp.max_new_tokens
    cache_full = length + spec.round_span > spec.max_len
    return done | out_of_budget | cache_full


def _prefill(draft_params, target_params, prompts, prompt_lens, dp: DecodeParams, key,
             mid_params=(), *, draft_cfg: ModelConfig | None, target_cfg: ModelConfig,
             spec: SpecConfig, mesh=None, mid_cfgs=()):
    """Prompts [B, P] (right-padded), prompt_lens [B] >= 1 -> state after the first token.

    The first new token comes from the prefill's target logits, so every later round starts
    from the invariant "caches hold positions < length - 1" (GenState). Padded prompt
    positions write junk keys/values, overwritten before any query can attend to them.
    """
    if len(mid_params) != len(spec.mus) or len(mid_cfgs) != len(spec.mus):
        raise S2DError(f"{len(spec.mus)} chain level(s) in spec.mus but "
                         f"{len(mid_params)} intermediate params / {len(mid_cfgs)} configs")
    B, P = prompts.shape
    S = spec.max_len
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    tcache = _place_cache(init_cache(target_cfg, B, S), mesh)
    logits, tcache = model.forward(target_params, target_cfg, prompts, positions, tcache)
    last_logits = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    key, k_first = jax.random.split(key)
    first = sample(k_first, probs_from_logits(last_logits, dp.sampling), dp.sampling.greedy)

    dcache = None
    if spec.method != "ar":
        dcache = _place_cache(init_cache(draft_cfg, B, S), mesh)
        h = model.embed_tokens(draft_params, draft_cfg, prompts)
        _, dcache = model.run_layers(draft_params, draft_cfg, h, positions, 0,
                                     spec.exits[-1], dcache)
    mid_caches = []
    for mp, mc in zip(mid_params, mid_cfgs):
        mcache = _place_cache(init_cache(mc, B, S), mesh)
        mid_caches.append(model.forward(mp, mc, prompts, positions, mcache)[1])

    valid = jnp.arange(P)[None, :] < prompt_lens[:, None]
    tokens = jnp.zeros((B, S), jnp.int32).at[:, :P].set(jnp.where(valid, prompts, 0))
    tokens = tokens.at[jnp.arange(B), prompt_lens].set(first)
    length = prompt_lens + 1
    done = _check_done(length, prompt_lens, first == dp.eos_id, dp, spec)
    G, m, n = spec.gamma, spec.num_exits, spec.num_levels
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)
    return GenState(
        tokens=tokens, length=length, prompt_len=prompt_lens, done=done,
        target_cache=tcache.with_lengths(length - 1),
        draft_cache=None if dcache is None else dcache.with_lengths(length - 1),
        key=key, round=jnp.int32(0), rounds=zeros((B,)), round_tokens=zeros((B,)),
        accepted_at=zeros((B, G)), proposed_at=zeros((B, G)), exit_counts=zeros((B, m)),
        level_accepted=zeros((B, n - 1)), level_proposed=zeros((B, n - 1)),
        level_calls=zeros((B, n - 1)),
        mid_caches=tuple(c.with_lengths(length - 1) for c in mid_caches))


def _round_start(state: GenState, spec: SpecConfig):
    """(round key, RoundCtx) at the start of a round: work = the committed tokens."""
    ctx = RoundCtx(
        work=state.tokens, end=state.length,
        caches=(state.draft_cache,) + tuple(state.mid_caches) + (state.target_cache,),
        calls=jnp.zeros((spec.num_levels,), jnp.int32),
        accepted_at=state.accepted_at, proposed_at=state.proposed_at,
        exit_counts=state.exit_counts, level_accepted=state.level_accepted,
        level_proposed=state.level_proposed, level_calls=state.level_calls)
    return jax.random.fold_in(state.key, state.round), ctx


def draft_phase(state: GenState, draft_params, dp: DecodeParams, mid_params=(), *,
                draft_cfg, spec, mid_cfgs=()):
    """Everything below the target: the block the target verifies next. Returns an opaque
    `drafted` for verify_phase: (ctx, q [B, M, V], count [B], exit index or None)."""
    round_key, ctx = _round_start(state, spec)
    n = spec.num_levels
    if spec.method == "ar":
        B = state.tokens.shape[0]
        return ctx, jnp.zeros((B, 0, 1), jnp.float32), jnp.zeros((B,), jnp.int32), None
    return produce(n - 2, ctx, ~state.done, round_key, (draft_params,) + tuple(mid_params),
                   (draft_cfg,) + tuple(mid_cfgs), dp, spec)


def verify_phase(state: GenState, target_params, dp: DecodeParams, drafted, *, target_cfg,
                 spec):
    """Score the block with the target, accept, append, roll back, update stats."""
    B, S = state.tokens.shape
    ctx, q, num_proposed, exit_idx = drafted
    if q.shape[-1] != target_cfg.vocab_size:  # ar: an empty block
        q = jnp.zeros(q.shape[:2] + (target_cfg.vocab_size,), jnp.float32)
    M = q.shape[1]
    round_key = jax.random.fold_in(state.key, state.round)
    L, active = state.length, ~state.done
    ctx, n, nxt, _ = verify_block(ctx, spec.num_levels - 1, q, num_proposed, exit_idx, active,
                                  round_key, target_params, dp, cfg=target_cfg, spec=spec)
    work = ctx.work.at[jnp.arange(B), L + n].set(nxt, mode="drop")
    j = jnp.arange(M + 1)[None, :]
    new = jnp.take_along_axis(work, jnp.minimum(L[:, None] + j, S - 1), axis=1)
    # Keep accepted + correction, cut after an EOS and at max_new_tokens.
    is_eos = (new == dp.eos_id) & (j <= n[:, None])
    eos_cut = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, M + 1)
    budget = dp.max_new_tokens - (L - state.prompt_len)
    count = jnp.where(active, jnp.minimum(jnp.minimum(n + 1, eos_cut), budget), 0)
    length = L + count
    tokens = jnp.where(jnp.arange(S)[None, :] < length[:, None], work, 0)
    hit_eos = jnp.any(is_eos & (j < count[:, None]), axis=1)
    done = _check_done(length, state.prompt_len, state.done | hit_eos, dp, spec)

    caches = [None if c is None else c.with_lengths(length - 1) for c in ctx.caches]
    return state.replace(
        tokens=tokens, length=length, done=done,
        draft_cache=caches[0], mid_caches=tuple(caches[1:-1]), target_cache=caches[-1],
        round=state.round + 1,
        rounds=state.rounds + active.astype(jnp.int32),
        round_tokens=state.round_tokens + count,
        accepted_at=ctx.accepted_at, proposed_at=ctx.proposed_at, exit_counts=ctx.exit_counts,
        level_accepted=ctx.level_accepted, level_proposed=ctx.level_proposed,
        level_calls=ctx.level_calls)


def one_round(state: GenState, draft_params, target_params, dp: DecodeParams, mid_params=(),
              *, draft_cfg, target_cfg, spec, mid_cfgs=()) -> GenState:
    drafted = draft_phase(state, draft_params, dp, mid_params, draft_cfg=draft_cfg, spec=spec,
                          mid_cfgs=mid_cfgs)
    return verify_phase(state, target_params, dp, drafted, target_cfg=target_cfg, spec=spec)


def _decode_loop(state: GenState, draft_params, target_params, dp: DecodeParams, max_rounds,
                 mid_params=(), *, draft_cfg, target_cfg, spec, mesh=None,
                 mid_cfgs=()) -> GenState:
    """Run rounds until every row is done or `max_rounds` (traced) more rounds ran."""
    stop_at = state.round + max_rounds
    if spec.method in ("sd", "s2d"):  # not self: that would copy the target's layers
        draft_params = with_exit_segments(draft_params, spec.exits)

    def cond(s):
        return jnp.any(~s.done) & (s.round < stop_at)

    body = functools.partial(one_round, draft_params=draft_params, target_params=target_params,
                             dp=dp, mid_params=mid_params, draft_cfg=draft_cfg,
                             target_cfg=target_cfg, spec=spec, mid_cfgs=mid_cfgs)
    return jax.lax.while_loop(cond, body, state)


def _generate(draft_params, target_params, prompts, prompt_lens, dp: DecodeParams, key,
              mid_params=(), *, draft_cfg, target_cfg, spec, mesh=None,
              mid_cfgs=()) -> GenState:
    state = _prefill(draft_params, target_params, prompts, prompt_lens, dp, key, mid_params,
                     draft_cfg=draft_cfg, target_cfg=target_cfg, spec=spec, mesh=mesh,
                     mid_cfgs=mid_cfgs)
    # Every round adds >= 1 token to each active row, so max_len rounds always suffice.
    return _decode_loop(state, draft_params, target_params, dp, jnp.int32(spec.max_len),
                        mid_params, draft_cfg=draft_cfg, target_cfg=target_cfg, spec=spec,
                        mid_cfgs=mid_cfgs)


generate = jax.jit(_generate, static_argnames=STATIC)
prefill = jax.jit(_prefill, static_argnames=STATIC)
decode_chunk = jax.jit(_decode_loop, static_argnames=STATIC, donate_argnames=("state",))
