"""Losslessness of sampled S2D: the joint distribution of the first 3 generated tokens
equals the target's exact distribution (by enumeration), chi-square over 20,000 rows
generated in ONE jitted batch.

Why the joint: it checks every position's conditional at once, including how they depend
on earlier tokens, which is where cache rollback or key-reuse bugs would show. Cells with
expected count < 5 are pooled into one cell so the chi-square approximation holds.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.model import transformer as model
from s2d_jax.config import ModelConfig
from s2d_jax.decode.state import DecodeParams, SpecConfig
from s2d_jax.decode.sampling import SamplingParams, probs_from_logits
from tiny_models import numpy_params as numpy_init

V, ROWS, NEW = 12, 20_000, 3
CFG = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=3,
                  num_heads=2, num_kv_heads=1, max_position_embeddings=32)
PROMPT = [1, 5, 7]


@functools.lru_cache(maxsize=None)
def params():
    return numpy_init(CFG, 4, 0.4)


def exact_joint(sp: SamplingParams) -> np.ndarray:
    """p(t1, t2, t3 | prompt) [V, V, V] by running the target on every 2-token prefix."""
    seqs = np.array([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    logits, _ = jax.jit(model.forward, static_argnums=1)(params(), CFG, jnp.asarray(seqs))
    n = len(PROMPT)
    p = np.asarray(probs_from_logits(logits[:, n - 1:n + 2], sp), np.float64)
    p1 = p[0, 0]
    p2 = p[:, 1].reshape(V, V, V)[:, 0]  # [t1, t2], any t2 prefix gives the same position-2 row
    p3 = p[:, 2].reshape(V, V, V)  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_pooled(counts: np.ndarray, probs: np.ndarray):
    expected = probs.ravel() * counts.sum()
    obs = counts.ravel()
    big = expected >= 5
    exp_cells = np.append(expected[big], expected[~big].sum())
    obs_cells = np.append(obs[big], obs[~big].sum())
    if exp_cells[-1] < 5:  # fold a tiny pooled cell into the smallest kept one
        exp_cells[np.argmin(exp_cells[:-1])] += exp_cells[-1]
        obs_cells[np.argmin(exp_cells[:-1])] += obs_cells[-1]
        exp_cells, obs_cells = exp_cells[:-1], obs_cells[:-1]
    exp_cells *= obs_cells.sum() / exp_cells.sum()
    return stats.chisquare(obs_cells, exp_cells).pvalue, len(exp_cells)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_s2d_sampling_matches_target_distribution(temperature, top_p):
    # Draft = the target's first 2 layers with exits (1, 2), so drafts are often accepted.
    spec = SpecConfig(method="s2d", exits=(1, 2), gamma=2, max_len=16)
    dcfg = dataclasses.replace(CFG, num_layers=2)
    dp = DecodeParams.make(spec, [0.6, 0.0], temperature=temperature, top_p=top_p,
                           max_new_tokens=NEW, eos_id=-1)
    prompts = jnp.asarray([PROMPT] * ROWS, jnp.int32)
    lens = jnp.full((ROWS,), len(PROMPT), jnp.int32)
    state = engine.generate(params(), params(), prompts, lens, dp, jax.random.key(7),
                            chain=Chain(dcfg, (), CFG, spec))
    toks = np.asarray(state.tokens[:, len(PROMPT):len(PROMPT) + NEW])
    assert (np.asarray(state.length) == len(PROMPT) + NEW).all()
    counts = np.zeros((V, V, V), np.int64)
    np.add.at(counts, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
    joint = exact_joint(dp.sampling)
    pval, cells = chi_square_pooled(counts, joint)
    assert cells >= 10, cells  # the test has power: many cells are compared
    print(f"chi-square p={pval:.3f} over {cells} cells")
    assert pval > 0.01, (pval, cells)
    # Drafts were really accepted and both exits were used (so verification was exercised).
    assert int(state.stats.accepted_at.sum()) > ROWS // 4
    assert (np.asarray(state.stats.exit_counts.sum(0)) > 0).all()
    # Power check: a distribution off by a little is rejected by the same statistic.
    wrong = 0.85 * joint + 0.15 / joint.size
    assert chi_square_pooled(counts, wrong)[0] < 1e-4
