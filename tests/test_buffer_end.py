"""The end of the token buffer: every method stops where autoregressive decoding stops (at
max_new_tokens, an EOS or a full buffer), with AR's tokens, the last rounds shrinking
their blocks (round.py); an explicit buffer with no room for a new token is refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from s2d_jax.decode import engine
from s2d_jax.decode.chain import Chain
from s2d_jax.decode.state import DecodeParams, SpecConfig
from s2d_jax.errors import S2DError
from test_chain import chain_decoder, other_model
from test_engine import PROMPTS, make_decoder, reference
from test_engine_distribution import CFG as DIST_CFG, PROMPT as DIST_PROMPT, ROWS
from test_engine_distribution import chi_square_pooled, exact_joint, params as dist_params

# 24 slots, 22 new tokens: rows of 7, 2 and 3 prompt tokens fill the buffer (17, 22, 21
# tokens), the 1-token row stops on its budget one slot before the end; every row is within
# a round's span of the end for its last rounds, at a different round than the others.
MAX_LEN, NEW = 24, 22
ESCALATING = ([0.3] * 3, [0.9, 0.2, 0.5], [1.0] * 3)


def expected(p, max_len=MAX_LEN, new=NEW):
    """AR's greedy tokens: the budget or the buffer, whichever ends first."""
    return reference(tuple(p), 0, min(new, max_len - len(p)))


def _decoder(method):
    if method == "chain":  # 3 levels; a different intermediate rejects at both levels
        return chain_decoder([other_model()], mus=(2,), gamma=3)
    return {"ar": lambda: make_decoder("ar", (), 0),
            "sd": lambda: make_decoder("sd", (2,), 2),
            "self": lambda: make_decoder("self", (2,), 4),
            "s2d": lambda: make_decoder("s2d", (1, 2, 3), 4)}[method]()


def _check_stats(o):
    s = o["stats"]
    # Every round counts with the tokens it added (a shrunk round adds fewer); the
    # prefill's token is not a round's.
    assert round(s["mean_accepted_tokens"] * s["rounds"]) == s["new_tokens"] - 1, s
    for rate in s["acceptance_rate_per_position"] + s["level_acceptance_rate"]:
        assert rate is None or 0.0 <= rate <= 1.0, s


# s2d with batched rows (each at its own buffer end), every other method alone; the rest
# slow (CI time).
@pytest.mark.parametrize("method, batch", [("s2d", 4)] + [
    (m, 1) for m in ("ar", "chain", "sd", "self")] + [
    pytest.param(m, b, marks=pytest.mark.slow) for m, b in (
        ("s2d", 1), ("ar", 4), ("chain", 4), ("sd", 4), ("self", 4))])
def test_greedy_runs_to_the_full_buffer_like_ar(method, batch):
    dec = _decoder(method)
    prompts = PROMPTS if batch > 1 else [PROMPTS[0]]
    thresholds = [None] if method in ("ar", "sd", "self") else ESCALATING
    for th in thresholds:
        out = dec.generate(prompts, max_new_tokens=NEW, thresholds=th, eos_id=-1,
                           max_len=MAX_LEN)
        for p, o in zip(prompts, out):
            want = expected(p)
            assert o["token_ids"] == want, (method, th, p)
            assert o["stats"]["new_tokens"] == len(want)
            _check_stats(o)
    if method == "s2d":
        usage = np.sum([o["stats"]["exit_usage"] for o in out], axis=0)
        assert usage[-1] > 0  # threshold 1 escalated to the last exit


@pytest.mark.slow  # CI time: the shrunk-rounds test below samples to the buffer's end too
def test_sampled_rows_run_to_the_full_buffer_like_ar():
    dec = _decoder("s2d")
    out = dec.generate(PROMPTS, max_new_tokens=NEW, thresholds=[0.3] * 3, temperature=1.0,
                       seed=5, eos_id=-1, max_len=MAX_LEN)
    for p, o in zip(PROMPTS, out):
        assert len(o["token_ids"]) == o["stats"]["new_tokens"] == len(expected(p))
        _check_stats(o)


@pytest.mark.parametrize("mus", [(), pytest.param((2,), marks=pytest.mark.slow)],
                         ids=["s2d", "chain"])  # chain slow (CI time)
def test_sampling_in_shrunk_rounds_matches_target_distribution(mus):
    """T = 1 with a buffer of prompt + 3 slots and a larger budget: the 2nd and 3rd tokens
    come from rounds whose blocks the buffer cuts (gamma 2: one round would need 3 more
    slots), and their joint with the 1st is the target's exact distribution."""
    max_len = len(DIST_PROMPT) + 3
    spec = SpecConfig(method="s2d", exits=(1, 2), gamma=2, max_len=max_len, mus=mus)
    dcfg = dataclasses.replace(DIST_CFG, num_layers=2)
    dp = DecodeParams.make(spec, [0.6, 0.0], temperature=1.0, max_new_tokens=8, eos_id=-1)
    prompts = jnp.asarray([DIST_PROMPT] * ROWS, jnp.int32)
    lens = jnp.full((ROWS,), len(DIST_PROMPT), jnp.int32)
    mid = (dist_params(),) if mus else ()
    state = engine.generate(dist_params(), dist_params(), prompts, lens, dp, jax.random.key(3),
                            mid, chain=Chain(dcfg, (DIST_CFG,) * len(mus), DIST_CFG, spec))
    assert (np.asarray(state.length) == max_len).all()  # where AR stops: the full buffer
    toks = np.asarray(state.tokens[:, len(DIST_PROMPT):max_len])
    counts = np.zeros((DIST_CFG.vocab_size,) * 3, np.int64)
    np.add.at(counts, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
    joint = exact_joint(dp.sampling)
    pval, cells = chi_square_pooled(counts, joint)
    print(f"chi-square p={pval:.3f} over {cells} cells")
    assert cells >= 10 and pval > 0.01, (pval, cells)
    assert int(state.stats.level_accepted[:, 0].sum()) > ROWS // 4  # drafts were accepted
    wrong = 0.85 * joint + 0.15 / joint.size
    assert chi_square_pooled(counts, wrong)[0] < 1e-4


def test_a_buffer_just_past_the_prompt_gives_ars_tokens():
    """max_len below prompt + round span + 1 (here 9 and 8 slots after 7- and 8-token
    prompts, s2d gamma 4) gives AR's tokens up to the buffer, whatever the budget."""
    dec = _decoder("s2d")
    prompts = [PROMPTS[0], PROMPTS[0] + [2]]
    out = dec.generate(prompts, max_new_tokens=NEW, thresholds=[0.3] * 3, eos_id=-1, max_len=9)
    assert [o["token_ids"] for o in out] == [expected(p, 9) for p in prompts]
    assert [len(o["token_ids"]) for o in out] == [2, 1]


def test_a_buffer_without_room_after_the_prompt_is_refused():
    dec = _decoder("s2d")
    for max_len in (len(PROMPTS[0]), 3):
        with pytest.raises(S2DError, match=r"max_len \d+ leaves no room .* pass max_len > 7"):
            dec.generate(PROMPTS, max_new_tokens=NEW, max_len=max_len)
    with pytest.raises(S2DError, match="does not fit the context of 96 tokens"):
        dec.prepare([[1] * 96], NEW)
    spec, arr, _ = dec.prepare([[1] * 95], NEW)  # one slot left: AR's one token
    assert spec.max_len == 96 and arr.shape == (1, 96)
