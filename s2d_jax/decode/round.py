"""One speculative round: propose, verify, commit.

  propose  the levels below the target build a block after the committed tokens: the draft
           drafts up to gamma tokens, escalating over its exits per token (drafting.py);
           each intermediate level of a polybasic chain, if any, verifies and accumulates
           the blocks of the level below until it holds mu_k tokens.
  verify   the level above scores the block with one forward and accepts a prefix by the
           lossless rule (sampling.speculative_verify); it also gives the next token: the
           correction after a rejection, the bonus when everything was accepted.
  commit   the target's verdict becomes the sequence: accepted + next token, cut after an
           EOS and at max_new_tokens; every cache rolls back to the new length.

Polybasic chains (Wang et al., ICML 2025, arXiv 2510.26527): levels M_0 (the sorted draft)
-> M_1 -> ... -> M_{n-1} (the target). Two-level S2D is the chain with n = 2 (no
intermediate level); autoregressive decoding (`ar`) is an empty block. Per row (batched:
compute for all rows, keep the results of rows that need them):

  work = the committed tokens [0, L) (a scratch copy of the token buffer), end E = L.
  block of level 0: the draft's gamma tokens after E (the dynamic-length stop may
      propose fewer), with the distributions q they were drawn from.
  block of level k, 0 < k < n-1 (static mu_k):
      acc = 0; while acc < mu_k:
          block, q = the block of level k-1 starting at E + acc
          verify at level k: accept a prefix of length m with proposal q and its own
          distribution p_k (accept d with prob min(1, p_k(d)/q(d)); on the first
          rejection draw from norm(max(0, p_k - q)); all accepted: the bonus from p_k)
          append the m accepted tokens + the next token; their distributions are p_k at
          those positions; acc += m + 1
      return the acc tokens (mu_k <= acc <= mu_k + |block| = M_k tokens) and their p_k.
  the target verifies the block of level n-2 the same way, then commit.

Level 0 may start with the lookup rung (lookup.py; methods lookup and ladder): up to
lookup_len tokens copied from the context after the best earlier match of its last
tokens, then (ladder) the draft's tokens in the block's remaining slots after them. Its
tokens are a deterministic function of the context, so they are proposed with the point
mass q = one-hot(x): the rule below accepts x with probability p(x) and on rejection
draws from p with x removed and renormalised, which is exactly p; a mixed block (point
masses, then the draft's q conditioned on them) is one sequence of proposals, each drawn
from its q given the block before it, with its length (k) fixed by the context before any
token is drawn: the argument below holds unchanged (docs/design.md, the lookup rung).

Why it is lossless: every token a level k outputs is, given everything before it,
distributed as p_k (the speculative-sampling guarantee applied at level k), and whether a
position is proposed at all is decided before its token is drawn; so level k+1 may use
p_k as the proposal distribution of level k's tokens. By induction the committed tokens
are distributed as the target's p. Greedy: every p is the one-hot argmax, so a token is
accepted at level k iff it is level k's argmax, and the output is the target's argmax.

Caches and rollback: every level has its own KV cache, slot == position, so a rejection
only moves the point up to which a cache is valid; nothing is copied. A level feeds a
fixed catch-up window of W_k = n - k tokens before its block (positions E - W_k .. E - 1,
clamped at 0): after a level's verification its cache is valid up to its next token, and
each level above can add one more (a bonus) before it runs again, so its gap is at most
n - k (n = 2: the target feeds the last token, the draft the last two). Feeding an
already-valid position again recomputes the same keys/values.

Shapes are static: M_0 = gamma, M_k = mu_k + M_{k-1} (acc < mu_k before a block of at most
M_{k-1} + 1 tokens); the target scores M_{n-2} + 1 positions and a round adds at most
M_{n-2} + 1 tokens (spec.round_span). Near the end of the buffer a round shrinks: every
block is cut to the room left before the buffer's last slot (`room`: the draft skips the
steps no row has room for, an intermediate level stops accumulating there), so the
round's tokens still fit and every method stops where autoregressive decoding does: at
max_new_tokens, an EOS or a full buffer. Cutting needs no other shape and costs a few
integer ops per round; the verifiers still score their whole static block (positions
past the buffer are clamped to its last slot, whose keys/values no kept token depends
on).

Keys: the round's key is the generation key folded with the round index; each call of
each level folds (level, call index) into it, so draws never repeat and chunked decoding
equals the single jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from s2d_jax.decode.chain import Chain
from s2d_jax.decode.drafting import draft_block
from s2d_jax.decode.lookup import lookup_block, point_mass
from s2d_jax.decode.sampling import probs_from_logits, speculative_verify
from s2d_jax.decode.state import DecodeParams, GenState, RoundStats, SpecConfig
from s2d_jax.model import transformer as model


@struct.dataclass
class RoundCtx:
    """What the levels of one round share and update."""

    work: jnp.ndarray  # i32 [B, S] committed tokens + tokens being built this round
    end: jnp.ndarray  # i32 [B] where the next block starts (E)
    caches: tuple  # KVCache per level: (draft, intermediates..., target); draft None for ar
    key: jax.Array  # the round's PRNG key
    calls: jnp.ndarray  # i32 [n] calls of each level so far this round (key derivation)
    stats: RoundStats


@struct.dataclass
class Proposal:
    """The block of tokens a level proposes to the level above, written at
    ctx.work[:, E : E + M]."""

    q: jnp.ndarray  # f32 [B, M, V] the distribution each token was drawn from
    count: jnp.ndarray  # i32 [B] tokens proposed (a prefix of the M slots)
    exit_idx: jnp.ndarray | None = None  # i32 [B, M] the draft's exit per token (-1: lookup)
    lookup_count: jnp.ndarray | None = None  # i32 [B] the first ones are the lookup's


@struct.dataclass
class Verdict:
    """A level's answer to a proposal."""

    accepted: jnp.ndarray  # i32 [B] length of the accepted prefix
    next_token: jnp.ndarray  # i32 [B] the correction (after a rejection) or the bonus
    p: jnp.ndarray  # f32 [B, M+1, V] the verifier's distributions at positions E .. E+M


def check_done(length, prompt_len, done, dp: DecodeParams, spec: SpecConfig):
    """A row stops at max_new_tokens or a full buffer, where autoregressive decoding stops."""
    out_of_budget = length - prompt_len >= dp.max_new_tokens
    buffer_full = length >= spec.max_len
    return done | out_of_budget | buffer_full


def room(end, spec: SpecConfig):
    """Most tokens a block starting at `end` may propose: its verifier's next token must
    still fit the buffer (slot <= max_len - 1). Near the end of the buffer this shrinks a
    round's block (down to 0: a plain target step); it depends only on where the block
    starts, never on the tokens drawn, so the verification stays lossless."""
    return jnp.maximum(spec.max_len - 1 - end, 0)


def _rows(x):
    return jnp.arange(x.shape[0])[:, None]


def _draft(ctx: RoundCtx, rows, draft_params, dp, chain: Chain):
    """Level 0's block after ctx.end, written to work: the lookup's tokens (lookup,
    ladder), then the draft's (sd, self, s2d; ladder: in the slots the lookup left)."""
    spec = chain.spec
    key = jax.random.fold_in(ctx.key, 0)
    if spec.num_levels > 2:
        key = jax.random.fold_in(key, ctx.calls[0])
    limit = room(ctx.end, spec)
    B, G = ctx.work.shape[0], spec.gamma
    g = jnp.arange(G)[None, :]
    k = jnp.zeros((B,), jnp.int32)
    work = ctx.work
    if spec.lookup:  # rung 0: a point mass on the tokens that followed the best match
        looked, k, _ = lookup_block(work, ctx.end, spec.lookup_tokens, *spec.ngram)
        k = jnp.minimum(k, limit)
        looked = jnp.pad(looked, ((0, 0), (0, G - spec.lookup_tokens)))
        slots = jnp.where(g < k[:, None], ctx.end[:, None] + g, work.shape[1])
        work = work.at[_rows(looked), slots].set(looked, mode="drop")
        if chain.draft is None:  # lookup alone
            q = point_mass(looked, chain.target.vocab_size)
            ctx = ctx.replace(work=work, calls=ctx.calls.at[0].add(1))
            return ctx, Proposal(q, k, jnp.full((B, G), -1, jnp.int32), k)
    # The draft after the lookup's k tokens (k = 0 without the rung). Its first step feeds
    # those k tokens too (a window k_max wider): its cache then holds every position
    # before its block, whichever rung the round took.
    start = ctx.end + k
    window = spec.num_levels + (spec.lookup_tokens if spec.lookup else 0)
    tokens, q_d, count, exit_idx, cache = draft_block(
        draft_params, chain.draft, ctx.caches[0], work, start, key, rows, dp, spec,
        jnp.minimum(limit, G) - k, window)
    count = jnp.minimum(count, jnp.minimum(limit, G) - k)  # the first is drafted even without room
    slots = start[:, None] + g
    work = work.at[_rows(tokens), slots].set(tokens, mode="drop")
    ctx = ctx.replace(work=work, caches=(cache,) + tuple(ctx.caches[1:]),
                      calls=ctx.calls.at[0].add(1))
    if not spec.lookup:
        return ctx, Proposal(q_d, count, exit_idx)
    # Block slot i: the lookup's point mass for i < k, else the draft's slot i - k.
    from_draft = g >= k[:, None]
    src = jnp.clip(g - k[:, None], 0, G - 1)
    q_d = jnp.take_along_axis(q_d, src[..., None], axis=1)
    q = jnp.where(from_draft[..., None], q_d, point_mass(looked, q_d.shape[-1]))
    exit_idx = jnp.where(from_draft, jnp.take_along_axis(exit_idx, src, axis=1), -1)
    return ctx, Proposal(q, k + count, exit_idx, k)


def _block_of(level: int, ctx: RoundCtx, rows, params: tuple, dp, chain: Chain):
    """Level `level`'s block after ctx.end for `rows`, written to work (ctx.end unchanged).
    An intermediate level verifies the blocks of the level below until it holds mu.
    `params`: every level's, bottom-up (as chain.cfgs)."""
    if level == 0:
        return _draft(ctx, rows, params[0], dp, chain)
    spec = chain.spec
    M_out = spec.block_len(level)
    B, S = ctx.work.shape
    start = ctx.end
    limit = room(start, spec)
    mu = jnp.minimum(spec.mus[level - 1], limit)

    def cond(carry):
        _, acc, _ = carry
        return jnp.any(rows & (acc < mu))

    def body(carry):
        ctx, acc, qbuf = carry
        need = rows & (acc < mu)
        ctx = ctx.replace(end=start + acc)
        ctx, below = _block_of(level - 1, ctx, need, params, dp, chain)
        ctx, v = verify(ctx, level, below, need, params[level], dp, chain)
        # Append accepted + next token; their distributions are this level's p.
        slot = jnp.where(need, ctx.end + v.accepted, S)
        work = ctx.work.at[jnp.arange(B), slot].set(v.next_token, mode="drop")
        i = jnp.arange(v.p.shape[1])[None, :]
        dst = jnp.where(need[:, None] & (i <= v.accepted[:, None]), acc[:, None] + i, M_out)
        qbuf = qbuf.at[_rows(dst), dst].set(v.p, mode="drop")
        acc = acc + jnp.where(need, v.accepted + 1, 0)
        return ctx.replace(work=work), acc, qbuf

    V = chain.cfgs[level].vocab_size
    init = (ctx, jnp.zeros((B,), jnp.int32), jnp.zeros((B, M_out, V), jnp.float32))
    ctx, acc, qbuf = jax.lax.while_loop(cond, body, init)
    return ctx.replace(end=start), Proposal(qbuf, jnp.minimum(acc, limit))


def propose(state: GenState, params: tuple, dp: DecodeParams, chain: Chain):
    """Everything below the target -> (RoundCtx, the Proposal the target verifies next).
    `params`: every level's, bottom-up (as chain.cfgs)."""
    spec = chain.spec
    ctx = RoundCtx(work=state.tokens, end=state.length, caches=state.caches,
                   key=jax.random.fold_in(state.key, state.round),
                   calls=jnp.zeros((spec.num_levels,), jnp.int32), stats=state.stats)
    if not spec.proposer.proposes:  # an empty block: the target's round is one plain step
        B = state.tokens.shape[0]
        return ctx, Proposal(jnp.zeros((B, 0, 1), jnp.float32), jnp.zeros((B,), jnp.int32))
    return _block_of(spec.num_levels - 2, ctx, ~state.done, params, dp, chain)


def verify(ctx: RoundCtx, level: int, block: Proposal, rows, params, dp: DecodeParams,
           chain: Chain):
    """Level `level` >= 1 (its `params`) scores the block at work[E, E+M) with one forward
    (after its catch-up window) and accepts a prefix -> (ctx with its cache and stats,
    Verdict)."""
    n_levels = chain.spec.num_levels
    W = n_levels - level
    S = ctx.work.shape[1]
    M = block.q.shape[1]
    if level == n_levels - 1:
        key = jax.random.fold_in(ctx.key, 1)  # one target call per round
    else:
        key = jax.random.fold_in(jax.random.fold_in(ctx.key, 1 + level), ctx.calls[level])
    pos = (ctx.end - W)[:, None] + jnp.arange(W + M, dtype=jnp.int32)[None, :]
    pos = jnp.minimum(jnp.maximum(pos, 0), S - 1)
    toks = jnp.take_along_axis(ctx.work, pos, axis=1)
    logits, cache = model.forward(params, chain.cfgs[level], toks, pos, ctx.caches[level])
    p = probs_from_logits(logits[:, W - 1:], dp.sampling)
    n, nxt = speculative_verify(key, toks[:, W:], block.q, p, block.count, dp.sampling.greedy)

    stats = ctx.stats.add_verification(level, n, block.count, rows)
    if level == 1 and M > 0:  # the draft's own statistics, as seen by its verifier
        stats = stats.add_draft_block(n, block.count, block.exit_idx, rows,
                                      block.lookup_count)
    caches = tuple(ctx.caches[:level]) + (cache,) + tuple(ctx.caches[level + 1:])
    ctx = ctx.replace(caches=caches, calls=ctx.calls.at[level].add(1), stats=stats)
    return ctx, Verdict(n, nxt, p)


def commit(state: GenState, ctx: RoundCtx, verdict: Verdict, dp: DecodeParams,
           spec: SpecConfig) -> GenState:
    """The target's verdict -> the next state: keep accepted + next token, cut after an EOS
    and at max_new_tokens, roll every cache back to the new length."""
    B, S = state.tokens.shape
    L, active, n = state.length, ~state.done, verdict.accepted
    work = ctx.work.at[jnp.arange(B), L + n].set(verdict.next_token, mode="drop")
    j = jnp.arange(spec.round_span)[None, :]
    new = jnp.take_along_axis(work, jnp.minimum(L[:, None] + j, S - 1), axis=1)
    is_eos = (new == dp.eos_id) & (j <= n[:, None])
    eos_cut = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, spec.round_span)
    budget = dp.max_new_tokens - (L - state.prompt_len)
    count = jnp.where(active, jnp.minimum(jnp.minimum(n + 1, eos_cut), budget), 0)
    length = L + count
    tokens = jnp.where(jnp.arange(S)[None, :] < length[:, None], work, 0)
    hit_eos = jnp.any(is_eos & (j < count[:, None]), axis=1)
    done = check_done(length, state.prompt_len, state.done | hit_eos, dp, spec)
    # Every cache holds the K/V of the accepted tokens but the newest. The draft's may hold
    # less: draft_block set its lengths to what it fed, which misses the last drafted
    # token of a fully accepted block (a later CALM fill writes from there).
    caches = [None if c is None else c.with_lengths(
        jnp.minimum(c.lengths, length - 1) if level == 0 else length - 1)
        for level, c in enumerate(ctx.caches)]
    return state.with_caches(caches).replace(
        tokens=tokens, length=length, done=done, round=state.round + 1,
        stats=ctx.stats.add_round(active, count))


def one_round(state: GenState, params: tuple, dp: DecodeParams, chain: Chain) -> GenState:
    """propose -> verify at the target -> commit. `params`: every level's, bottom-up."""
    ctx, block = propose(state, params, dp, chain)
    ctx, verdict = verify(ctx, chain.spec.num_levels - 1, block, ~state.done, params[-1], dp,
                          chain)
    return commit(state, ctx, verdict, dp, chain.spec)
