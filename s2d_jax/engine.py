"""The jitted S2D generation: prefill, then a `lax.while_loop` of speculative rounds.

A round: draft up to gamma tokens (escalating per token, drafting.py), verify gamma + 1
positions with one target forward, accept a prefix by the lossless rule (sampling.py), add
the target's correction or bonus token, roll back by moving cache lengths. Autoregressive
decoding (`ar`, gamma = 0: the round is one target step), vanilla SD (`sd`), early-exit
self-speculation (`self`) and S2D (`s2d`) all run this same code; only the static
SpecConfig and the draft params differ.

Public entry points (all pure; cfgs, spec and the optional mesh are static; params keep
the sharding they arrive with, caches are pinned to the mesh by CACHE_AXES):
  generate(...)      -> GenState   whole generation in one jit
  prefill(...)       -> GenState   then decode_chunk(state, ...) -> GenState, donated;
                                   used for streaming and for draft/verify timing
  draft_phase / verify_phase       one round in two halves (timed separately on host)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from s2d_jax import model
from s2d_jax.config import ModelConfig
from s2d_jax.drafting import draft_token
from s2d_jax.engine_state import DecodeParams, GenState, SpecConfig
from s2d_jax.kvcache import init_cache
from s2d_jax.sharding import CACHE_AXES, spec as logical_spec
from s2d_jax.sampling import probs_from_logits, sample, speculative_verify

STATIC = ("draft_cfg", "target_cfg", "spec", "mesh")


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
    cache_full = length + spec.gamma + 1 > spec.max_len
    return done | out_of_budget | cache_full


def _prefill(draft_params, target_params, prompts, prompt_lens, dp: DecodeParams, key, *,
             draft_cfg: ModelConfig | None, target_cfg: ModelConfig, spec: SpecConfig,
             mesh=None):
    """Prompts [B, P] (right-padded), prompt_lens [B] >= 1 -> state after the first token.

    The first new token comes from the prefill's target logits, so every later round starts
    from the invariant "caches hold positions < length - 1". Padded prompt positions write
    junk keys/values, which are overwritten before any query can attend to them.
    """
    B, P = prompts.shape
    S = spec.max_len
    positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    tcache = _place_cache(init_cache(target_cfg, B, S), mesh)
    logits, tcache = model.forward(target_params, target_cfg, prompts, positions, tcache)
    last_logits = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    key, k_first = jax.random.split(key)
    first = sample(k_first, probs_from_logits(last_logits, dp.sampling))

    dcache = None
    if spec.method != "ar":
        dcache = _place_cache(init_cache(draft_cfg, B, S), mesh)
        h = model.embed_tokens(draft_params, draft_cfg, prompts)
        _, dcache = model.run_layers(draft_params, draft_cfg, h, positions, 0,
                                     spec.exits[-1], dcache)

    valid = jnp.arange(P)[None, :] < prompt_lens[:, None]
    tokens = jnp.zeros((B, S), jnp.int32).at[:, :P].set(jnp.where(valid, prompts, 0))
    tokens = tokens.at[jnp.arange(B), prompt_lens].set(first)
    length = prompt_lens + 1
    done = _check_done(length, prompt_lens, first == dp.eos_id, dp, spec)
    G, m = spec.gamma, spec.num_exits
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)
    return GenState(
        tokens=tokens, length=length, prompt_len=prompt_lens, done=done,
        target_cache=tcache.with_lengths(length - 1),
        draft_cache=None if dcache is None else dcache.with_lengths(length - 1),
        key=key, round=jnp.int32(0), rounds=zeros((B,)), round_tokens=zeros((B,)),
        accepted_at=zeros((B, G)), proposed_at=zeros((B, G)), exit_counts=zeros((B, m)))


def draft_phase(state: GenState, draft_params, dp: DecodeParams, *, draft_cfg, spec):
    """Propose gamma tokens per row. Returns (drafts [B,G], q [B,G,V], exit [B,G],
    num_proposed [B], draft cache)."""
    B = state.tokens.shape[0]
    G = spec.gamma
    k_draft = jax.random.fold_in(jax.random.fold_in(state.key, state.round), 0)
    L = state.length
    step = functools.partial(draft_token, draft_params, draft_cfg, sp=dp.sampling,
                             thresholds=dp.thresholds, exits=spec.exits,
                             conf_kind=spec.confidence, kv_fill=spec.kv_fill)
    # First step feeds the last two tokens: if the previous round accepted every draft
    # token, the draft never processed the last of them (position L - 2).
    # Positions are clamped to the buffer: only finished rows can reach past it, and a
    # larger position would change dynamic-NTK rope (batch max position) for every row.
    S = state.tokens.shape[1]
    pos2 = jnp.stack([L - 2, L - 1], axis=-1)
    tok2 = jnp.take_along_axis(state.tokens, pos2, axis=1)
    d0, q0, e0, c0, dcache = step(state.draft_cache, tok2, pos2, jax.random.fold_in(k_draft, 0))
    # Dynamic draft length (off when stop_threshold = 0): a row stops proposing after a
    # token whose confidence is below stop_threshold; a step no row needs is skipped.
    active0 = (c0 >= dp.stop_threshold) & ~state.done

    def body(carry, g):
        dcache, prev, active = carry

        def run(dcache):
            pos = jnp.minimum(L - 1 + g, S - 1)[:, None]
            return step(dcache, prev[:, None], pos, jax.random.fold_in(k_draft, g))

        def skip(dcache):
            return (jnp.zeros_like(prev), jnp.zeros_like(q0), jnp.zeros_like(e0),
                    jnp.zeros_like(c0), dcache)

        d, q, e, c, dcache = jax.lax.cond(jnp.any(active), run, skip, dcache)
        return (dcache, d, active & (c >= dp.stop_threshold)), (d, q, e, active)

    (dcache, _, _), (ds, qs, es, act) = jax.lax.scan(
        body, (dcache, d0, active0), jnp.arange(1, G, dtype=jnp.int32))
    drafts = jnp.concatenate([d0[:, None], ds.T], axis=1)
    q = jnp.concatenate([q0[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    exit_idx = jnp.concatenate([e0[:, None], es.T], axis=1)
    num_proposed = 1 + jnp.sum(act.T, axis=1).astype(jnp.int32)
    return drafts, q, exit_idx, num_proposed, dcache


def verify_phase(state: GenState, target_params, dp: DecodeParams, drafted, *, target_cfg,
                 spec):
    """Score gamma + 1 positions with the target, accept, append, roll back, update stats."""
    B, S = state.tokens.shape
    G = spec.gamma
    drafts, q, exit_idx, num_proposed, dcache = drafted
    k_verify = jax.random.fold_in(jax.random.fold_in(state.key, state.round), 1)
    L, active = state.length, ~state.done
    last = jnp.take_along_axis(state.tokens, (L - 1)[:, None], axis=1)
    vtoks = jnp.concatenate([last, drafts], axis=1)
    vpos = jnp.minimum((L - 1)[:, None] + jnp.arange(G + 1, dtype=jnp.int32)[None, :], S - 1)
    logits, tcache = model.forward(target_params, target_cfg, vtoks, vpos, state.target_cache)
    p = probs_from_logits(logits, dp.sampling)
    n, nxt = speculative_verify(k_verify, drafts, q, p, num_proposed)

    j = jnp.arange(G + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    new = jnp.where(j < n[:, None], padded, jnp.where(j == n[:, None], nxt[:, None], 0))
    # Keep accepted + correction, cut after an EOS and at max_new_tokens.
    is_eos = (new == dp.eos_id) & (j <= n[:, None])
    eos_cut = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, G + 1)
    budget = dp.max_new_tokens - (L - state.prompt_len)
    count = jnp.where(active, jnp.minimum(jnp.minimum(n + 1, eos_cut), budget), 0)
    wpos = jnp.where(j < count[:, None], L[:, None] + j, S)  # S = out of bounds: dropped
    tokens = state.tokens.at[jnp.arange(B)[:, None], wpos].set(new, mode="drop")
    length = L + count
    hit_eos = jnp.any(is_eos & (j < count[:, None]), axis=1)
    done = _check_done(length, state.prompt_len, state.done | hit_eos, dp, spec)

    g = jnp.arange(G)[None, :]
    proposed = active[:, None] & (g < num_proposed[:, None])
    exit_hot = jax.nn.one_hot(exit_idx, spec.num_exits, dtype=jnp.int32)
    return state.replace(
        tokens=tokens, length=length, done=done,
        target_cache=tcache.with_lengths(length - 1),
        draft_cache=None if dcache is None else dcache.with_lengths(length - 1),
        round=state.round + 1,
        rounds=state.rounds + active.astype(jnp.int32),
        round_tokens=state.round_tokens + count,
        accepted_at=state.accepted_at + (proposed & (g < n[:, None])).astype(jnp.int32),
        proposed_at=state.proposed_at + proposed.astype(jnp.int32),
        exit_counts=state.exit_counts + jnp.sum(exit_hot * proposed[..., None], axis=1))


def one_round(state: GenState, draft_params, target_params, dp: DecodeParams, *, draft_cfg,
              target_cfg, spec) -> GenState:
    if spec.method == "ar":
        B = state.tokens.shape[0]
        V = target_cfg.vocab_size
        drafted = (jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, V), jnp.float32),
                   jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32), None)
    else:
        drafted = draft_phase(state, draft_params, dp, draft_cfg=draft_cfg, spec=spec)
    return verify_phase(state, target_params, dp, drafted, target_cfg=target_cfg, spec=spec)


def _decode_loop(state: GenState, draft_params, target_params, dp: DecodeParams, max_rounds,
                 *, draft_cfg, target_cfg, spec, mesh=None) -> GenState:
    """Run rounds until every row is done or `max_rounds` (traced) more rounds ran."""
    stop_at = state.round + max_rounds

    def cond(s):
        return jnp.any(~s.done) & (s.round < stop_at)

    body = functools.partial(one_round, draft_params=draft_params, target_params=target_params,
                             dp=dp, draft_cfg=draft_cfg, target_cfg=target_cfg, spec=spec)
    return jax.lax.while_loop(cond, body, state)


def _generate(draft_params, target_params, prompts, prompt_lens, dp: DecodeParams, key, *,
              draft_cfg, target_cfg, spec, mesh=None) -> GenState:
    state = _prefill(draft_params, target_params, prompts, prompt_lens, dp, key,
                     draft_cfg=draft_cfg, target_cfg=target_cfg, spec=spec, mesh=mesh)
    # Every round adds >= 1 token to each active row, so max_len rounds always suffice.
    return _decode_loop(state, draft_params, target_params, dp, jnp.int32(spec.max_len),
                        draft_cfg=draft_cfg, target_cfg=target_cfg, spec=spec)


generate = jax.jit(_generate, static_argnames=STATIC)
prefill = jax.jit(_prefill, static_argnames=STATIC)
decode_chunk = jax.jit(_decode_loop, static_argnames=STATIC, donate_argnames=("state",))
