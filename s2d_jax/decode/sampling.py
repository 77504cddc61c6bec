"""Logit transforms (temperature, top-k, top-p), greedy, confidence, and the speculative
accept/residual rule.

Temperature, top-k and top-p are *traced* values, so changing them never recompiles.
Greedy (temperature <= 0) is expressed as a one-hot distribution, so greedy and sampling
share one verification rule: with one-hot p and q the rejection rule below accepts a draft
token exactly when it is the target's argmax and the residual is the target's argmax.
Whether a generation is greedy is also a *static* flag (`SamplingParams.greedy`): the greedy
program skips what a one-hot makes pointless (softmaxes, vocabulary-sized random draws,
the top-k/top-p filters, which cannot change an argmax), which on a CPU costs more than
a small draft's forward. So switching between greedy and sampling compiles a second program;
switching between temperatures does not.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

CONFIDENCE_KINDS = ("max_prob", "entropy")

# On CPU, vocabulary-wide argmax and draws work in blocks of SAMPLE_BLOCK tokens: a draw
# inverts the cumulative distribution in two steps, the block by the blocks' cumulative
# mass, then the token inside it (one uniform number per row and two short prefix sums),
# where a Gumbel-max draw (jax.random.categorical) makes a random number and two logarithms
# for every vocabulary entry: at 32 rows x 49152 on a 2-core CPU, 21 ms, a third of a
# sampled 135M-model decode round (docs/results.md). Elsewhere the plain reductions stay
# (lax.platform_dependent): a vocabulary sharded over a mesh's tensor axis does not split
# into the blocks along its shards, and the TPU compiler gathered logits and the head for
# them (a v5e:2x2 SD round, vocabulary 32000 over 4 chips: 18.5 GiB of HBM traffic for a
# 0.36 GiB minimum; docs/distributed.md).
SAMPLE_BLOCK = 256


@struct.dataclass
class SamplingParams:
    """Traced sampling settings, applied identically to draft and target."""

    temperature: jnp.ndarray  # f32 scalar or [B] (per row); <= 0 means greedy
    top_k: jnp.ndarray  # i32 scalar; <= 0 means off
    top_p: jnp.ndarray  # f32 scalar or [B] (per row); >= 1 means off
    greedy: bool = struct.field(pytree_node=False, default=False)  # static: temperature <= 0

    @classmethod
    def make(cls, temperature=0.0, top_k=0, top_p=1.0) -> "SamplingParams":
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                   greedy=float(temperature) <= 0.0)


def per_row(x: jnp.ndarray, like: jnp.ndarray) -> jnp.ndarray:
    """A setting broadcast against logits `like` [B, ..., V]: a scalar as it is, a per-row
    [B] array (the slot engine's: one temperature / top-p per slot) over the other axes."""
    return x if jnp.ndim(x) == 0 else jnp.reshape(x, jnp.shape(x) + (1,) * (like.ndim - 1))


def filter_top_k(logits: jnp.ndarray, top_k: jnp.ndarray) -> jnp.ndarray:
    """Set logits below the k-th largest to -inf (ties at the k-th value are kept)."""
    V = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    kth = jnp.take(sorted_desc, jnp.clip(top_k - 1, 0, V - 1), axis=-1)[..., None]
    keep = (logits >= kth) | (top_k <= 0)
    return jnp.where(keep, logits, -jnp.inf)


def filter_top_p(logits: jnp.ndarray, top_p: jnp.ndarray) -> jnp.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (nucleus)."""
    probs = jax.nn.softmax(logits, axis=-1)
    sorted_desc = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(sorted_desc, axis=-1) - sorted_desc
    # The most likely token is always kept; its probability bounds the kept set from below.
    num_kept = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
    smallest_kept = jnp.take_along_axis(sorted_desc, num_kept - 1, axis=-1)
    keep = (probs >= smallest_kept) | (top_p >= 1.0)
    return jnp.where(keep, logits, -jnp.inf)


def _scaled_filtered_logits(logits: jnp.ndarray, sp: SamplingParams) -> jnp.ndarray:
    # Greedy still needs a proper distribution for confidence: use temperature 1 then.
    t = per_row(jnp.where(sp.temperature > 0, sp.temperature, 1.0), logits)
    z = logits.astype(jnp.float32) / t
    # Each filter sorts the vocabulary: skip it at run time when it is off (the usual
    # case); on CPU the two sorts cost more than a small model's forward.
    z = jax.lax.cond(sp.top_k > 0, filter_top_k, lambda x, _: x, z, sp.top_k)
    return jax.lax.cond(jnp.any(sp.top_p < 1.0), filter_top_p, lambda x, _: x, z,
                        per_row(sp.top_p, logits))


def vocab_argmax(x: jnp.ndarray) -> jnp.ndarray:
    """jnp.argmax over the last (vocabulary) axis, int32, the same index (the first maximum;
    the first NaN if any), found blockwise: the block with the largest maximum, then the
    position in it. XLA:CPU's argmax reduces value and index pairs one lane at a time
    (3.5 ms at 32 x 49152); a maximum vectorizes (0.25 ms blockwise)."""
    if x.shape[-1] <= SAMPLE_BLOCK:
        return _argmax(x)
    return jax.lax.platform_dependent(x, cpu=_blockwise_argmax, default=_argmax)


def _argmax(x: jnp.ndarray) -> jnp.ndarray:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def _blockwise_argmax(x: jnp.ndarray) -> jnp.ndarray:
    *lead, V = x.shape
    rows, nb = math.prod(lead), -(-V // SAMPLE_BLOCK)
    blocks = jnp.pad(x.reshape(rows, V), ((0, 0), (0, nb * SAMPLE_BLOCK - V)),
                     constant_values=-jnp.inf).reshape(rows, nb, SAMPLE_BLOCK)
    b = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    inside = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    return (b * SAMPLE_BLOCK + jnp.argmax(inside, axis=-1)).reshape(lead).astype(jnp.int32)


def probs_from_logits(logits: jnp.ndarray, sp: SamplingParams) -> jnp.ndarray:
    """The distribution tokens are drawn from: softmax of the transformed logits, or the
    one-hot argmax when greedy. float32 [..., V]."""
    onehot = jax.nn.one_hot(vocab_argmax(logits), logits.shape[-1], dtype=jnp.float32)
    if sp.greedy:
        return onehot
    probs = jax.nn.softmax(_scaled_filtered_logits(logits, sp), axis=-1)
    return jnp.where(per_row(sp.temperature > 0, logits), probs, onehot)


def confidence(logits: jnp.ndarray, sp: SamplingParams, kind: str = "max_prob") -> jnp.ndarray:
    """Per-row confidence in [0, 1] of an exit's prediction, after temperature/top-k/top-p
    (temperature 1 when greedy, since the greedy one-hot would always say 1; greedy
    ignores top-k/top-p, as `transformers` does without sampling).

    max_prob: the largest probability. entropy: 1 - H(p) / log(V).
    """
    if sp.greedy and kind == "max_prob":  # max softmax = 1 / sum exp(z - max z)
        z = logits.astype(jnp.float32)
        return 1.0 / jnp.sum(jnp.exp(z - jnp.max(z, axis=-1, keepdims=True)), axis=-1)
    z = logits.astype(jnp.float32) if sp.greedy else _scaled_filtered_logits(logits, sp)
    probs = jax.nn.softmax(z, axis=-1)
    if kind == "max_prob":
        return jnp.max(probs, axis=-1)
    if kind == "entropy":
        ent = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0),
                       axis=-1)
        return 1.0 - ent / jnp.log(jnp.float32(logits.shape[-1]))
    raise ValueError(f"unknown confidence kind {kind!r}; use one of {CONFIDENCE_KINDS}")


def _last_positive(mass: jnp.ndarray) -> jnp.ndarray:
    """Index of the last entry > 0 along the last axis (0 when none is)."""
    n = mass.shape[-1]
    return n - 1 - jnp.argmax(mass[..., ::-1] > 0, axis=-1)


def _inverse_cdf(mass: jnp.ndarray, u: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(index, u minus the mass before it): the first entry of mass [R, N] whose inclusive
    prefix sum passes u [R] (u in [0, total)). An entry of mass 0 never is: its prefix sum
    equals the one before. Rounding that puts u at the total takes the last entry > 0."""
    cum = jnp.cumsum(mass, axis=-1)
    i = jnp.minimum(jnp.sum(cum <= u[:, None], axis=-1), _last_positive(mass))
    # the exclusive prefix sum: u >= it at i by the count above, so the rest is >= 0
    exclusive = jnp.pad(cum[:, :-1], ((0, 0), (1, 0)))
    return i, u - jnp.take_along_axis(exclusive, i[:, None], axis=-1)[:, 0]


def sample(key: jax.Array, probs: jnp.ndarray, greedy: bool = False) -> jnp.ndarray:
    """Draw one token per row from probs [..., V] (zero-probability tokens are never drawn):
    on CPU inverse-CDF sampling, blockwise (SAMPLE_BLOCK), elsewhere a Gumbel-max draw over
    the log-probabilities. probs need not sum to 1.
    greedy (static): probs are one-hot, so the draw is their argmax (no random numbers)."""
    if greedy:
        return vocab_argmax(probs)
    return jax.lax.platform_dependent(key, probs, cpu=sample_blockwise, default=sample_gumbel)


def sample_gumbel(key: jax.Array, probs: jnp.ndarray) -> jnp.ndarray:
    """sample's draw off the CPU: jax.random.categorical over log probs (log 0 = -inf is
    never drawn), whose one reduction over the vocabulary stays within its shards."""
    p = probs.astype(jnp.float32)
    logits = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_blockwise(key: jax.Array, probs: jnp.ndarray) -> jnp.ndarray:
    """sample's draw on the CPU: the inverse CDF, a block, then a token inside it."""
    *lead, V = probs.shape
    p = probs.reshape(-1, V).astype(jnp.float32)
    rows, nb = p.shape[0], -(-V // SAMPLE_BLOCK)
    blocks = jnp.pad(p, ((0, 0), (0, nb * SAMPLE_BLOCK - V))).reshape(rows, nb, SAMPLE_BLOCK)
    mass = jnp.sum(blocks, axis=-1)
    u = jax.random.uniform(key, (rows,)) * jnp.sum(mass, axis=-1)
    b, rest = _inverse_cdf(mass, u)
    inside = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    t, _ = _inverse_cdf(inside, rest)
    return (b * SAMPLE_BLOCK + t).reshape(lead).astype(jnp.int32)


def speculative_verify(key: jax.Array, proposed: jnp.ndarray, q: jnp.ndarray, p: jnp.ndarray,
                       num_proposed: jnp.ndarray | None = None, greedy: bool = False):
    """Lossless speculative rejection sampling (Leviathan et al. / Chen et al.), tree-free.

    proposed [B, G] tokens drawn from q [B, G, V] (the distribution each token was actually
    drawn from: one-hot for a greedy proposer); p [B, G+1, V] the verifier's distributions at
    the G proposed positions plus one. Only the first num_proposed [B] tokens of a row count.
    Token i is accepted with prob min(1, p_i(d_i) / q_i(d_i)); the first rejection draws the
    correction from norm(max(0, p_i - q_i)); with every proposal accepted the bonus is drawn
    from p_num_proposed. Returns (accepted count [B] in [0, num_proposed], next token [B]).
    greedy (static): p and q are one-hot, so the ratio is 0 or 1 and every uniform draw
    would give the same answer; the draws are skipped, the result is the same.
    Reusable at any level of a chain: the verifier of one pair is the proposer of the next.
    """
    B, G = proposed.shape
    if num_proposed is None:
        num_proposed = jnp.full((B,), G, jnp.int32)
    k_accept, k_next = jax.random.split(key)
    if G > 0:
        p_d = jnp.take_along_axis(p[:, :G], proposed[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q, proposed[..., None], axis=-1)[..., 0]
        ratio = jnp.where(q_d > 0, p_d / jnp.where(q_d > 0, q_d, 1.0), 0.0)
        u = 0.0 if greedy else jax.random.uniform(k_accept, (B, G))
        ok = (u < ratio) & (jnp.arange(G)[None, :] < num_proposed[:, None])
        n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)
        q_pad = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)  # [B, G+1, V]
    else:
        n = jnp.zeros((B,), jnp.int32)
        q_pad = jnp.zeros_like(p)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    rejected = n < num_proposed
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # If rounding leaves no residual mass, p itself is the only sensible fallback.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    dist = jnp.where(rejected[:, None], residual, p_n)
    return n, sample(k_next, dist, greedy)
