"""The jitted S2D generation: prefill, then a `lax.while_loop` whose body is one
speculative round (round.py: propose, verify, commit).

Autoregressive decoding (`ar`, gamma = 0: the round is one target step), vanilla SD
(`sd`), early-exit self-speculation (`self`), S2D (`s2d`) and polybasic chains
(`spec.mus` non-empty, intermediate models in `mid_params` / `mid_cfgs`) all run this same
code; only the static SpecConfig and the params differ.

Public entry points (all pure; cfgs, spec and the optional mesh are static; params keep
the sharding they arrive with, caches are pinned to the mesh by CACHE_AXES):
  generate(...)      -> GenState   whole generation in one jit
  prefill(...)       -> GenState   then decode_chunk(state, ...) -> GenState, donated;
                                   used for streaming and for the in-loop cost probes
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from s2d_jax.config import ModelConfig
from s2d_jax.decode.drafting import with_exit_segments
from s2d_jax.decode.round import check_done, one_round
from s2d_jax.decode.sampling import probs_from_logits, sample
from s2d_jax.decode.state import DecodeParams, GenState, RoundStats, SpecConfig
from s2d_jax.errors import S2DError
from s2d_jax.model import small_matmul, transformer as model
from s2d_jax.model.kvcache import cache_sharding, init_cache

STATIC = ("draft_cfg", "target_cfg", "spec", "mesh", "mid_cfgs")


def _place_cache(cache, mesh):
    """Pin a cache to the (Auto-axes) mesh by its logical axes (batch over data/fsdp, kv
    heads over tensor); the while loop then keeps that layout. No-op without a mesh."""
    if mesh is None or cache is None:
        return cache
    pin = functools.partial(jax.lax.with_sharding_constraint, shardings=cache_sharding(mesh))
    return cache.replace(k=pin(cache.k), v=pin(cache.v))


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
    h = model.embed_tokens(target_params, target_cfg, prompts)
    h, tcache = model.run_layers(target_params, target_cfg, h, positions, 0,
                                 target_cfg.num_layers, tcache)
    # Only the last prompt token's logits are needed: the head runs on one row, not P.
    h_last = jnp.take_along_axis(h, (prompt_lens - 1)[:, None, None], axis=1)
    last_logits = model.lm_logits(target_params, target_cfg, h_last, decode=True)[:, 0]
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
        hm = model.embed_tokens(mp, mc, prompts)
        mid_caches.append(model.run_layers(mp, mc, hm, positions, 0, mc.num_layers, mcache)[1])

    valid = jnp.arange(P)[None, :] < prompt_lens[:, None]
    tokens = jnp.zeros((B, S), jnp.int32).at[:, :P].set(jnp.where(valid, prompts, 0))
    tokens = tokens.at[jnp.arange(B), prompt_lens].set(first)
    length = prompt_lens + 1
    done = check_done(length, prompt_lens, first == dp.eos_id, dp, spec)
    return GenState(
        tokens=tokens, length=length, prompt_len=prompt_lens, done=done,
        target_cache=tcache.with_lengths(length - 1),
        draft_cache=None if dcache is None else dcache.with_lengths(length - 1),
        key=key, round=jnp.int32(0), stats=RoundStats.zeros(B, spec),
        mid_caches=tuple(c.with_lengths(length - 1) for c in mid_caches))


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


def _traced_for_mesh(fn):
    """fn traced with the small-matmul kernel only where it runs unsharded (small_matmul.for_mesh)."""
    @functools.wraps(fn)
    def wrapped(*args, mesh=None, **kwargs):
        with small_matmul.for_mesh(mesh):
            return fn(*args, mesh=mesh, **kwargs)
    return wrapped


generate = jax.jit(_traced_for_mesh(_generate), static_argnames=STATIC)
prefill = jax.jit(_traced_for_mesh(_prefill), static_argnames=STATIC)
decode_chunk = jax.jit(_traced_for_mesh(_decode_loop), static_argnames=STATIC,
                       donate_argnames=("state",))
