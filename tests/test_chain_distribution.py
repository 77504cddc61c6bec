"""Losslessness of a sampled 3-level chain (draft -> intermediate -> target) at T = 1:
the joint distribution of the first 3 generated tokens equals the target's exact one,
chi-square over 20,000 rows generated in ONE jitted batch (method and helpers as in
test_engine_distribution.py). The intermediate is the int4-quantized target, a genuinely
different distribution, so both levels accept and reject."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.state import DecodeParams, SpecConfig
from s2d_jax.model.quantize import quantize_params
from test_engine_distribution import CFG, PROMPT, ROWS, chi_square_pooled, exact_joint, params

V = CFG.vocab_size
NEW = 3


@pytest.mark.slow  # CI time: tests/test_buffer_end.py's [chain] case checks a chain's sampling distribution fast
def test_three_level_chain_sampling_matches_target_distribution():
    spec = SpecConfig(method="s2d", exits=(1, 2), gamma=2, max_len=24, mus=(2,))
    dcfg = dataclasses.replace(CFG, num_layers=2)
    mid = quantize_params(params(), "int4", group=8)
    dp = DecodeParams.make(spec, [0.6, 0.0], temperature=1.0, max_new_tokens=NEW, eos_id=-1)
    prompts = jnp.asarray([PROMPT] * ROWS, jnp.int32)
    lens = jnp.full((ROWS,), len(PROMPT), jnp.int32)
    state = engine.generate(params(), params(), prompts, lens, dp, jax.random.key(11), (mid,),
                            chain=Chain(dcfg, (CFG,), CFG, spec))
    assert (np.asarray(state.length) == len(PROMPT) + NEW).all()
    # Token 1 comes from the prefill; tokens 2 and 3 from chain rounds, so the joint checks
    # each round-made token's conditional distribution given all earlier ones.
    toks = np.asarray(state.tokens[:, len(PROMPT):len(PROMPT) + NEW])
    counts = np.zeros((V, V, V), np.int64)
    np.add.at(counts, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
    joint = exact_joint(dp.sampling)
    pval, cells = chi_square_pooled(counts, joint)
    print(f"chain chi-square p={pval:.3f} over {cells} cells")
    assert cells >= 10, cells
    assert pval > 0.01, (pval, cells)
    # Both verifications really happened with both outcomes.
    acc = np.asarray(state.stats.level_accepted).sum(0)
    prop = np.asarray(state.stats.level_proposed).sum(0)
    rates = acc / prop
    print(f"acceptance draft->int4: {rates[0]:.3f}, int4->target: {rates[1]:.3f}")
    assert (rates > 0.2).all() and (rates < 0.999).all(), rates
    # Power check: a distribution off by a little is rejected by the same statistic.
    wrong = 0.85 * joint + 0.15 / joint.size
    assert chi_square_pooled(counts, wrong)[0] < 1e-4
