"""Polybasic chains (Wang et al., ICML 2025, arXiv 2510.26527): levels M_0 (the sorted
draft) -> M_1 -> ... -> M_{n-1} (the target), all inside one jitted round.

Two-level S2D is the chain with n = 2 (no intermediate level); the engine has no other
implementation. The algorithm of one round, per row (batched: compute for all rows, keep
the results of rows that need them):

  work = the committed tokens [0, L) (a scratch copy of the token buffer), end E = L.
  produce(0): the draft proposes gamma tokens after E (escalating over its exits,
      drafting.py; the dynamic-length stop may propose fewer), with the distributions q
      they were drawn from.
  produce(k), 0 < k < n-1 (an intermediate level with static mu_k):
      acc = 0; while acc < mu_k:
          block, q = produce(k-1) starting at E + acc
          level k scores the block (one forward over its positions plus one), accepts a
          prefix of length m by the lossless rule with proposal q and its own distribution
          p_k (accept d with prob min(1, p_k(d)/q(d)); on the first rejection draw from
          norm(max(0, p_k - q)); all accepted: the bonus from p_k)
          append the m accepted tokens + the correction/bonus; their distributions are
          p_k at those positions; acc += m + 1
      return the acc tokens (mu_k <= acc <= mu_k + |block| = M_k tokens) and their p_k.
  the target verifies produce(n-2)'s block the same way and commits accepted + correction
      (cut at EOS / max_new_tokens).

Why it is lossless: every token a level k outputs is, given everything before it,
distributed as p_k (the speculative-sampling guarantee applied at level k), and whether a
position is proposed at all is decided before its token is drawn; so level k+1 may use
p_k as the proposal distribution of level k's tokens. By induction the committed tokens
are distributed as the target's p. Greedy: every p is the one-hot argmax, so a token is
accepted at level k iff it is level k's argmax, and the output is the target's argmax.

Caches and rollback: every level has its own KV cache, slot == position, so a rejection
only moves the point up to which a cache is valid; nothing is copied. A level feeds a
fixed catch-up window of W_k = n - k tokens before its block (positions E - W_k .. E - 1,
clamped at 0): after a level's verification its cache is valid up to its correction
token, and each level above can add one more (a bonus) before it runs again, so its gap is
at most n - k (n = 2: the target feeds the last token, the draft the last two). Feeding
an already-valid position again recomputes the same keys/values.

Shapes are static: M_0 = gamma, M_k = mu_k + M_{k-1} (acc < mu_k before a block of at most
M_{k-1} + 1 tokens); the target scores M_{n-2} + 1 positions and a round adds at most
M_{n-2} + 1 tokens. Keys: each call of each level folds (level, call index) into the
round's key, so draws never repeat and chunked decoding equals the single jit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from s2d_jax.model import transformer as model
from s2d_jax.decode.drafting import draft_token
from s2d_jax.decode.sampling import probs_from_logits, speculative_verify


@struct.dataclass
class RoundCtx:
    """What the levels of one round share and update."""

    work: jnp.ndarray  # i32 [B, S] committed tokens + tokens being built this round
    end: jnp.ndarray  # i32 [B] where the next block starts (E)
    caches: tuple  # KVCache per level: (draft, intermediates..., target); draft None for ar
    calls: jnp.ndarray  # i32 [n] calls of each level so far this round (key derivation)
    accepted_at: jnp.ndarray  # i32 [B, gamma] draft position accepted by level 1
    proposed_at: jnp.ndarray  # i32 [B, gamma]
    exit_counts: jnp.ndarray  # i32 [B, num_exits] drafted tokens kept at each exit
    level_accepted: jnp.ndarray  # i32 [B, n-1] tokens level k+1 accepted from level k
    level_proposed: jnp.ndarray  # i32 [B, n-1] tokens level k proposed to level k+1
    level_calls: jnp.ndarray  # i32 [B, n-1] forwards of level k+1 in which the row took part


def _rows(x):
    return jnp.arange(x.shape[0])[:, None]


def draft_block(ctx: RoundCtx, rows, round_key, draft_params, dp, *, draft_cfg, spec):
    """Level 0: propose gamma tokens after ctx.end (written to work). Returns
    (ctx, q [B, G, V], num_proposed [B], exit index [B, G])."""
    n = spec.num_levels
    G, S = spec.gamma, ctx.work.shape[1]
    k_draft = jax.random.fold_in(round_key, 0)
    if n > 2:
        k_draft = jax.random.fold_in(k_draft, ctx.calls[0])
    L = ctx.end
    step = functools.partial(draft_token, draft_params, draft_cfg, sp=dp.sampling,
                             thresholds=dp.thresholds, exits=spec.exits,
                             conf_kind=spec.confidence, kv_fill=spec.kv_fill)
    # The first step feeds the last n tokens (the catch-up window, see module docstring).
    # Positions are clamped to the buffer: only finished rows can reach past it, and a
    # larger position would change dynamic-NTK rope (batch max position) for every row.
    pos_w = jnp.maximum((L - n)[:, None] + jnp.arange(n, dtype=jnp.int32), 0)
    tok_w = jnp.take_along_axis(ctx.work, pos_w, axis=1)
    d0, q0, e0, c0, dcache = step(ctx.caches[0], tok_w, pos_w, jax.random.fold_in(k_draft, 0))
    # Dynamic draft length (off when stop_threshold = 0): a row stops proposing after a
    # token whose confidence is below stop_threshold; a step no row needs is skipped.
    active0 = (c0 >= dp.stop_threshold) & rows

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
        body, (dcache, d0, active0), jnp.arange(1, G, dtype=jnp.int32), unroll=True)
    drafts = jnp.concatenate([d0[:, None], ds.T], axis=1)
    q = jnp.concatenate([q0[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    exit_idx = jnp.concatenate([e0[:, None], es.T], axis=1)
    num_proposed = 1 + jnp.sum(act.T, axis=1).astype(jnp.int32)
    work = ctx.work.at[_rows(drafts), L[:, None] + jnp.arange(G)].set(drafts, mode="drop")
    caches = (dcache,) + tuple(ctx.caches[1:])
    ctx = ctx.replace(work=work, caches=caches, calls=ctx.calls.at[0].add(1))
    return ctx, q, num_proposed, exit_idx


def verify_block(ctx: RoundCtx, level: int, q, num_proposed, exit_idx, rows, round_key,
                 params, dp, *, cfg, spec):
    """Level `level` >= 1 scores the block of M = q.shape[1] tokens at work[E, E+M) and
    accepts a prefix. Returns (ctx with its cache and stats, accepted n [B], next token [B],
    p [B, M+1, V] its distributions at positions E .. E+M)."""
    n_levels = spec.num_levels
    W = n_levels - level
    B, S = ctx.work.shape
    M = q.shape[1]
    E = ctx.end
    if level == n_levels - 1:
        key = jax.random.fold_in(round_key, 1)  # one target call per round
    else:
        key = jax.random.fold_in(jax.random.fold_in(round_key, 1 + level), ctx.calls[level])
    pos = (E - W)[:, None] + jnp.arange(W + M, dtype=jnp.int32)[None, :]
    pos = jnp.minimum(jnp.maximum(pos, 0), S - 1)
    toks = jnp.take_along_axis(ctx.work, pos, axis=1)
    logits, cache = model.forward(params, cfg, toks, pos, ctx.caches[level])
    p = probs_from_logits(logits[:, W - 1:], dp.sampling)
    n, nxt = speculative_verify(key, toks[:, W:], q, p, num_proposed, dp.sampling.greedy)

    live = rows.astype(jnp.int32)
    caches = tuple(ctx.caches[:level]) + (cache,) + tuple(ctx.caches[level + 1:])
    hot = jax.nn.one_hot(level - 1, n_levels - 1, dtype=jnp.int32)[None, :]
    ctx = ctx.replace(
        caches=caches, calls=ctx.calls.at[level].add(1),
        level_accepted=ctx.level_accepted + hot * (n * live)[:, None],
        level_proposed=ctx.level_proposed + hot * (num_proposed * live)[:, None],
        level_calls=ctx.level_calls + hot * live[:, None])
    if level == 1 and M > 0:  # the draft's own statistics, as seen by its verifier
        g = jnp.arange(M)[None, :]
        proposed = rows[:, None] & (g < num_proposed[:, None])
        exit_hot = jax.nn.one_hot(exit_idx, spec.num_exits, dtype=jnp.int32)
        ctx = ctx.replace(
            accepted_at=ctx.accepted_at + (proposed & (g < n[:, None])).astype(jnp.int32),
            proposed_at=ctx.proposed_at + proposed.astype(jnp.int32),
            exit_counts=ctx.exit_counts + jnp.sum(exit_hot * proposed[..., None], axis=1))
    return ctx, n, nxt, p


def produce(level: int, ctx: RoundCtx, rows, round_key, params: tuple, cfgs: tuple, dp, spec):
    """Level `level`'s block after ctx.end for the rows that need it, written to work.
    Returns (ctx with end unchanged, q [B, M_level, V], count [B], exit index or None)."""
    if level == 0:
        return draft_block(ctx, rows, round_key, params[0], dp, draft_cfg=cfgs[0], spec=spec)
    mu = spec.mus[level - 1]
    M_out = spec.block_len(level)
    B, S = ctx.work.shape
    V = cfgs[level].vocab_size
    start = ctx.end

    def cond(carry):
        _, acc, _ = carry
        return jnp.any(rows & (acc < mu))

    def body(carry):
        ctx, acc, qbuf = carry
        need = rows & (acc < mu)
        ctx = ctx.replace(end=start + acc)
        ctx, q, count, exit_idx = produce(level - 1, ctx, need, round_key, params, cfgs, dp,
                                          spec)
        ctx, n, nxt, p = verify_block(ctx, level, q, count, exit_idx, need, round_key,
                                      params[level], dp, cfg=cfgs[level], spec=spec)
        E = ctx.end
        work = ctx.work.at[jnp.arange(B), jnp.where(need, E + n, S)].set(nxt, mode="drop")
        i = jnp.arange(p.shape[1])[None, :]
        dst = jnp.where(need[:, None] & (i <= n[:, None]), acc[:, None] + i, M_out)
        qbuf = qbuf.at[_rows(dst), dst].set(p, mode="drop")
        acc = acc + jnp.where(need, n + 1, 0)
        return ctx.replace(work=work), acc, qbuf

    init = (ctx, jnp.zeros((B,), jnp.int32), jnp.zeros((B, M_out, V), jnp.float32))
    ctx, acc, qbuf = jax.lax.while_loop(cond, body, init)
    return ctx.replace(end=start), qbuf, acc, None
