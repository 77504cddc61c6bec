"""Logit transforms and the speculative accept/residual rule, checked in isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from s2d_jax.decode.sampling import (SAMPLE_BLOCK, SamplingParams, confidence, filter_top_k,
                                     sample_gumbel,
                                     filter_top_p, probs_from_logits, sample, speculative_verify,
                                     vocab_argmax)


def test_top_k_keeps_k_largest():
    logits = jnp.array([[1.0, 5.0, 3.0, 2.0]])
    kept = np.isfinite(np.asarray(filter_top_k(logits, jnp.int32(2))))
    assert kept.tolist() == [[False, True, True, False]]
    assert np.isfinite(np.asarray(filter_top_k(logits, jnp.int32(0)))).all()


def test_top_p_keeps_smallest_nucleus():
    probs = jnp.array([[0.15, 0.5, 0.05, 0.3]])
    logits = jnp.log(probs)
    kept = np.isfinite(np.asarray(filter_top_p(logits, jnp.float32(0.7))))
    assert kept.tolist() == [[False, True, False, True]]  # 0.5 + 0.3 reaches 0.7
    kept = np.isfinite(np.asarray(filter_top_p(logits, jnp.float32(0.4))))
    assert kept.tolist() == [[False, True, False, False]]
    assert np.isfinite(np.asarray(filter_top_p(logits, jnp.float32(1.0)))).all()


def test_probs_greedy_is_one_hot_and_temperature_sharpens():
    logits = jnp.array([[0.0, 2.0, 1.0]])
    greedy = probs_from_logits(logits, SamplingParams.make(0.0))
    assert np.asarray(greedy).tolist() == [[0.0, 1.0, 0.0]]
    warm = np.asarray(probs_from_logits(logits, SamplingParams.make(1.0)))[0]
    cold = np.asarray(probs_from_logits(logits, SamplingParams.make(0.5)))[0]
    np.testing.assert_allclose(warm, np.exp([0, 2, 1]) / np.exp([0, 2, 1]).sum(), rtol=1e-6)
    assert cold[1] > warm[1]
    filtered = np.asarray(probs_from_logits(logits, SamplingParams.make(1.0, top_k=2)))[0]
    assert filtered[0] == 0.0 and abs(filtered.sum() - 1) < 1e-6


def test_confidence_kinds():
    sp = SamplingParams.make(0.0)
    flat = jnp.zeros((1, 8))
    peaked = jnp.array([[20.0] + [0.0] * 7])
    np.testing.assert_allclose(confidence(flat, sp, "max_prob"), [1 / 8], rtol=1e-6)
    np.testing.assert_allclose(confidence(flat, sp, "entropy"), [0.0], atol=1e-6)
    assert float(confidence(peaked, sp, "max_prob")[0]) > 0.99
    assert float(confidence(peaked, sp, "entropy")[0]) > 0.99


def _one_hot(ids, V):
    return jax.nn.one_hot(jnp.asarray(ids), V, dtype=jnp.float32)


def test_verify_greedy_prefix_and_bonus():
    V = 6
    target_argmax = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0]]  # G = 3 proposals + bonus
    proposed = jnp.array([[1, 2, 0], [1, 2, 3], [4, 0, 0]], jnp.int32)
    p = _one_hot(target_argmax, V)
    q = _one_hot(proposed, V)
    n, nxt = speculative_verify(jax.random.key(0), proposed, q, p)
    assert n.tolist() == [2, 3, 0]
    assert nxt.tolist() == [3, 4, 5]  # correction, bonus, correction
    # Only the first num_proposed tokens count: the next token then comes from p.
    n, nxt = speculative_verify(jax.random.key(0), proposed, q, p, jnp.array([1, 2, 0]))
    assert n.tolist() == [1, 2, 0] and nxt.tolist() == [2, 3, 5]


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_verify_output_is_distributed_as_p(greedy_draft):
    """The token after verifying one proposal is exactly p-distributed (the lossless rule),
    also when the draft is greedy (q one-hot), which the S2D reference code gets wrong."""
    V, n_samples = 5, 200_000
    p = jnp.array([0.1, 0.4, 0.2, 0.25, 0.05])
    q = jnp.array([0.3, 0.1, 0.4, 0.1, 0.1])
    if greedy_draft:
        q = _one_hot(2, V)

    def one(key):
        kd, kv = jax.random.split(key)
        d = jax.random.categorical(kd, jnp.log(q)).astype(jnp.int32)
        n, nxt = speculative_verify(kv, d.reshape(1, 1), q.reshape(1, 1, V),
                                    jnp.stack([p, p]).reshape(1, 2, V))
        return jnp.where(n[0] == 1, d, nxt[0])

    out = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(1), n_samples))
    counts = np.bincount(np.asarray(out), minlength=V)
    _, pval = stats.chisquare(counts, np.asarray(p) * n_samples)
    assert pval > 0.01, (counts, pval)
    # A wrong rule (e.g. keeping every draft token) must be detectable by this test.
    _, bad = stats.chisquare(np.bincount(np.asarray(jax.random.categorical(
        jax.random.key(2), jnp.log(q + 1e-30), shape=(n_samples,))), minlength=V),
        np.asarray(p) * n_samples)
    assert bad < 1e-6


@pytest.mark.parametrize("sample", [sample, sample_gumbel], ids=["cpu-blockwise", "gumbel"])
def test_sample_draws_probs_across_blocks_and_never_a_zero(sample):
    """The draw (on CPU the blockwise inverse CDF; elsewhere the Gumbel-max draw, called
    here directly): chi-square against probs spread over three blocks (the last one short),
    with zeros at block starts and ends and inside, unnormalized; a zero-probability token
    is never drawn, also when all mass sits on the last token."""
    V, n = 2 * SAMPLE_BLOCK + 37, 150_000  # a 5% skew in one token still gives p < 1e-6
    rng = np.random.default_rng(0)
    weights = np.zeros(V, np.float32)
    live = np.array([1, 5, SAMPLE_BLOCK - 1, SAMPLE_BLOCK + 3, SAMPLE_BLOCK + 200,
                     2 * SAMPLE_BLOCK + 1, V - 2])
    weights[live] = rng.uniform(0.5, 2.0, live.size)
    rows = jnp.broadcast_to(jnp.asarray(weights) * 3.0, (n, V))  # sums to ~3, not 1
    out = np.asarray(jax.jit(sample)(jax.random.key(0), rows))
    counts = np.bincount(out, minlength=V)
    assert set(np.flatnonzero(counts)) <= set(live), np.flatnonzero(counts)
    expected = weights[live].astype(np.float64) / weights.sum(dtype=np.float64) * n
    _, pval = stats.chisquare(counts[live], expected)
    assert pval > 0.01, (counts[live], expected, pval)
    # the test can fail: the same counts against a distribution off by 5% in one token
    skewed = expected * np.where(np.arange(live.size) == 0, 1.05, 1.0)
    _, bad = stats.chisquare(counts[live], skewed / skewed.sum() * n)
    assert bad < 1e-6, bad
    last = jnp.zeros((64, V)).at[:, V - 1].set(1e-30)
    assert np.all(np.asarray(sample(jax.random.key(1), last)) == V - 1)
    first = jnp.zeros((4, 3, V)).at[..., 0].set(1.0)  # leading axes kept
    assert np.asarray(sample(jax.random.key(2), first)).shape == (4, 3)
    assert np.all(np.asarray(sample(jax.random.key(2), first)) == 0)


@pytest.mark.parametrize("shape", [(3, 5), (4, 3 * SAMPLE_BLOCK), (2, 3, 2 * SAMPLE_BLOCK + 7)])
def test_vocab_argmax_is_argmax_with_ties_and_nans(shape):
    """The blockwise argmax picks jnp.argmax's index: the first of tied maxima (across and
    inside blocks), the first NaN, 0 for a row of -inf."""
    x = jnp.round(jax.random.normal(jax.random.key(0), shape) * 2)  # many ties
    assert np.array_equal(np.asarray(vocab_argmax(x)), np.asarray(jnp.argmax(x, axis=-1)))
    V = shape[-1]
    x = jnp.zeros((3, V)).at[0, V - 1].set(jnp.nan).at[0, V // 2].set(jnp.nan)
    x = x.at[1].set(-jnp.inf).at[2, V - 1].set(1.0)
    assert np.asarray(vocab_argmax(x)).tolist() == np.asarray(jnp.argmax(x, axis=-1)).tolist()
