"""Speculation that adapts to load (s2d_jax/server/occupancy.py, slots.py): the policy's
choice from measured round costs, the draft's catch-up after AR chunks, the row buckets,
and greedy answers unchanged whichever program decodes each chunk."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from s2d_jax.decode import engine
from s2d_jax.server import programs
from s2d_jax.server.occupancy import PROBE_EVERY, OccupancyPolicy
from s2d_jax.server.request import Request
from s2d_jax.server.slots import row_buckets

from test_serve_slots import NEW, TEXTS, check_alone, make_engine


def test_row_buckets():
    assert row_buckets(1) == (1,)
    assert row_buckets(3) == (1, 2, 3)
    assert row_buckets(16) == (1, 2, 4, 8, 16)


def test_policy_speculates_where_its_tokens_per_round_beat_the_cost_ratio():
    p = OccupancyPolicy({1: 1.2, 4: 3.0}, {1: 1.0, 4: 1.0}, round_span=5)
    assert p.speculate(1) and p.speculate(4)  # the optimistic prior: 5 tokens a round
    p.observe(150, 100)  # the traffic gets ~1.57 tokens a round
    assert p.speculate(1) and not p.speculate(4)
    choices = [p.choose(4) for _ in range(3 * PROBE_EVERY)]  # a round costs 3x AR's
    assert choices == [False] * (3 * PROBE_EVERY - 1) + [True]  # a probe refreshes the count
    assert [r["speculate"] for r in p.table()] == [True, False]
    p = OccupancyPolicy({1: 1.0, 4: 6.0}, {1: 1.0, 4: 1.0}, round_span=5)  # 4: never pays
    assert not p.can_pay(4) and p.can_pay(1)
    assert not any(p.choose(4) for _ in range(3 * PROBE_EVERY))  # so it is never probed
    with pytest.raises(ValueError, match="same row buckets"):
        OccupancyPolicy({1: 1.0}, {2: 1.0}, round_span=5)


@pytest.fixture(scope="module")
def s2d_engine():
    eng, tok = make_engine("s2d")
    eng.warm()
    return eng, tok


@pytest.mark.slow
def test_warm_up_measures_both_programs_at_every_row_bucket(s2d_engine):
    eng, _ = s2d_engine
    table = eng.policy.table()
    assert [r["rows"] for r in table] == list(row_buckets(eng.slots))
    assert all(0 < r["spec_round_s"] < 10 and 0 < r["ar_round_s"] < 10 for r in table)
    assert make_engine("ar")[0].ar is None  # AR has nothing to switch to: no policy


class Alternate:
    """A policy that switches program every chunk and gives every other admitted request
    the draft's prefill, and records the row counts."""

    def __init__(self):
        self.picks, self.admits = [], []

    def speculate(self, rows):
        self.admits.append(len(self.admits) % 2 == 0)
        return self.admits[-1]

    def choose(self, rows):
        self.picks.append((rows, len(self.picks) % 2 == 0))
        return self.picks[-1][1]

    def observe(self, tokens, rounds):
        pass


def test_answers_do_not_depend_on_which_program_runs_each_chunk(s2d_engine):
    eng, tok = s2d_engine
    policy, eng.policy = eng.policy, Alternate()
    try:
        reqs = [Request(tuple(tok.encode(t)), max_new_tokens=n) for t, n in zip(TEXTS, NEW)]
        results = eng.run(reqs)
        picks, admits = eng.policy.picks, eng.policy.admits
    finally:
        eng.policy = policy
    check_alone(eng, tok, reqs, results)
    assert {p for _, p in picks} == {True, False} and set(admits) == {True, False}
    assert {r for r, _ in picks} == {1, 2, 3}  # the batch shrank as requests ended
    assert all(j is None for j in eng.jobs)
    assert any(r.stats["accepted"] > 0 for r in results)


@pytest.mark.parametrize("held", [0, 5])  # 0: a request inserted without the draft's prefill
def test_the_draft_catches_up_on_the_tokens_an_ar_chunk_skipped(s2d_engine, held):
    eng, tok = s2d_engine
    ids = tok.encode(TEXTS[1] + TEXTS[3] + TEXTS[1])[:40]
    assert len(ids) == 40
    arr = np.zeros((1, 64), np.int32)
    arr[0, :40] = ids
    one = engine.prefill(*eng._prefill_args(arr, np.array([40], np.int32),
                                            eng._request_dp(Request(tuple(ids))), 0),
                         chain=eng.chain)
    exact = jax.device_get(one.draft_cache)
    lagging = one.draft_cache.replace(k=one.draft_cache.k.at[:, :, :, held:].set(0.0),
                                      v=one.draft_cache.v.at[:, :, :, held:].set(0.0),
                                      lengths=jnp.array([held], jnp.int32))
    caught = programs.catch_up_draft(one.replace(draft_cache=lagging), eng.draft_params,
                                     chain=eng.chain).draft_cache
    assert int(caught.lengths[0]) == 40  # all but the newest token (length 41)
    for new, old in ((caught.k, exact.k), (caught.v, exact.v)):
        np.testing.assert_allclose(np.asarray(new)[:, :, :, :40], old[:, :, :, :40],
                                   atol=2e-4, rtol=2e-4)
