"""The lookup rung (level 0 of the ladder): proposals copied from the context itself.

Answers copy from their prompt and from themselves (prompt lookup decoding, PLD; llama.cpp's
lookup decoding; vLLM's n-gram proposer). For each row: take the last n tokens of the
context (n_min <= n <= n_max), find where they occurred earlier, and propose the tokens
that followed there. It costs no model forward, only integer compares over the token
buffer, so it sits below the draft's cheapest exit.

On device and batched with static shapes: for every candidate end j of an earlier match
(the match is work[j-n, j), the proposal starts at work[j]) the compare of offsets
t = 0 .. n_max-1 backwards (work[j-1-t] vs work[E-1-t]) is one vectorised [B, S] op each
(n_max is small and static); the match length at j is the run of leading equal offsets.
One argmax over a packed score picks per row the longest match (capped at n_max), then
the one with the most tokens after it before E (up to the block length), then the
latest. Rows without a match of >= n_min tokens propose nothing (count 0), so rows with
and without matches (ragged) share one program.

Only work[:, :E] is read (the context: committed tokens, plus the tokens a chain level
accepted this round), so the proposal is a function of the context alone: a point mass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lookup_block(work: jnp.ndarray, end: jnp.ndarray, length: int, n_min: int, n_max: int):
    """Propose up to `length` tokens after work[b, :end[b]] by the longest earlier match of
    its last n_min..n_max tokens -> (tokens [B, length], count [B], match length [B]).
    Tokens past `count` are filler (the first candidate's), never proposed."""
    B, S = work.shape
    j = jnp.arange(S, dtype=jnp.int32)[None, :]  # candidate continuation start
    E = end[:, None]
    run = jnp.ones((B, S), bool)
    match_len = jnp.zeros((B, S), jnp.int32)
    for t in range(n_max):  # static, n_max <= a few: one [B, S] compare per offset
        at = j - 1 - t
        here = jnp.take_along_axis(work, jnp.clip(at, 0, S - 1), axis=1)
        last = jnp.take_along_axis(work, jnp.clip(E - 1 - t, 0, S - 1), axis=1)
        run = run & (at >= 0) & (E - 1 - t >= 0) & (here == last)
        match_len = match_len + run.astype(jnp.int32)
    avail = jnp.clip(E - j, 0, length)  # tokens after the match that are context (< E)
    ok = (match_len >= n_min) & (j < E) & (avail > 0)
    # lexicographic (match length, tokens available, position): all small non-negative ints
    score = (match_len * (length + 1) + avail) * S + j
    best = jnp.argmax(jnp.where(ok, score, -1), axis=1).astype(jnp.int32)
    found = jnp.any(ok, axis=1)
    take = lambda x: jnp.take_along_axis(x, best[:, None], axis=1)[:, 0]  # noqa: E731
    count = jnp.where(found, take(avail), 0).astype(jnp.int32)
    slots = jnp.clip(best[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :], 0, S - 1)
    tokens = jnp.take_along_axis(work, slots, axis=1)
    return tokens, count, jnp.where(found, take(match_len), 0)


def point_mass(tokens: jnp.ndarray, vocab_size: int) -> jnp.ndarray:
    """The distribution a lookup token is 'drawn' from: one-hot [..., V]. In the lossless
    rule (sampling.speculative_verify) it makes the acceptance min(1, p(x)/1) = p(x) and
    the residual max(p - onehot(x), 0) = p with x removed, renormalised."""
    return jax.nn.one_hot(tokens, vocab_size, dtype=jnp.float32)
