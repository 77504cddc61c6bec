"""The time model (Lemma 3.1) and the insertion rule on hand-computed cases."""

import pytest

from s2d_jax import theory
from s2d_jax.errors import S2DError


def test_lemma_3_1_two_and_three_models():
    # n = 2: T_1 = 10, T_2 = 1, L_1 = 3, beta = 4 -> 10/3 + 4*1/3 = 14/3
    assert theory.chain_time_per_token([10, 1], [3], 4) == pytest.approx(14 / 3)
    # n = 3: T = (10, 4, 1), L = (4, 2), beta = 3 -> 10/4 + 4/2 + 3*1/2 = 6.0
    assert theory.chain_time_per_token([10, 4, 1], [4, 2], 3) == pytest.approx(6.0)


def test_two_level_speedup_by_hand():
    # exits cost 1 and 2 ms, used 3:1 -> mean step 1.25 ms; gamma 4 -> 5 ms drafting;
    # verify 12 ms -> round 17 ms; MAT 3.4 -> speedup 10 * 3.4 / 17 = 2.0
    out = theory.two_level(10.0, 12.0, [1.0, 2.0], [3, 1], 3.4, 4)
    assert out["draft_step_s"] == pytest.approx(1.25)
    assert out["round_s"] == pytest.approx(17.0)
    assert out["time_per_token_s"] == pytest.approx(5.0)
    assert out["predicted_speedup"] == pytest.approx(2.0)
    # the same number from the general lemma: T_ar / (T / N)
    per_token = theory.chain_time_per_token([12.0, 1.25], [3.4], 4)
    assert 10.0 / per_token == pytest.approx(out["predicted_speedup"])


def test_insertion_rule_both_sides():
    # before: 10/2 + 4*1/2 = 7; after (10, 3, 1), L = (4, 2), beta 4 -> 2.5 + 1.5 + 2 = 6
    out = theory.insertion_gain([10, 1], [2], 4, position=1, candidate_cost=3,
                                new_accept_lengths=[4, 2])
    assert out["before"] == pytest.approx(7.0) and out["after"] == pytest.approx(6.0)
    assert out["helps"] and out["gain"] == pytest.approx(7 / 6)
    # a slow candidate that barely helps acceptance makes things worse: 10/2.2 + 8/1.5 + 4/1.5
    bad = theory.insertion_gain([10, 1], [2], 4, position=1, candidate_cost=8,
                                new_accept_lengths=[2.2, 1.5])
    assert bad["after"] == pytest.approx(10 / 2.2 + 8 / 1.5 + 4 / 1.5)
    assert not bad["helps"] and bad["gain"] < 1


def test_bad_inputs_raise():
    with pytest.raises(S2DError):
        theory.chain_time_per_token([10, 1], [3, 2], 4)
    with pytest.raises(S2DError):
        theory.chain_time_per_token([10, 0], [3], 4)
    with pytest.raises(S2DError):
        theory.two_level(1, 1, [1, 2], [0, 0], 2, 4)
    with pytest.raises(S2DError):
        theory.two_level(1, 1, [1], [1], 0.5, 4)
    with pytest.raises(S2DError):
        theory.insertion_gain([10, 1], [2], 4, position=2, candidate_cost=3,
                              new_accept_lengths=[4, 2])
