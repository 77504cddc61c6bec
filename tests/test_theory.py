"""The time model (Lemma 3.1) and the insertion rule on hand-computed cases."""

import pytest

from s2d_jax.bench import theory
from s2d_jax.errors import S2DError


def test_lemma_3_1_two_and_three_models():
    # n = 2: T_1 = 10, T_2 = 1, L_1 = 3, beta = 4 -> 10/3 + 4*1/3 = 14/3
    assert theory.chain_time_per_token([10, 1], [3], 4) == pytest.approx(14 / 3)
    # n = 3: T = (10, 4, 1), L = (4, 2), beta = 3 -> 10/4 + 4/2 + 3*1/2 = 6.0
    assert theory.chain_time_per_token([10, 4, 1], [4, 2], 3) == pytest.approx(6.0)


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
        theory.draft_step_cost([1, 2], [0, 0])
    with pytest.raises(S2DError):
        theory.insertion_gain([10, 1], [2], 4, position=2, candidate_cost=3,
                              new_accept_lengths=[4, 2])


def test_time_terms_are_the_lemma_summands():
    # T = (10, 4, 1), L = (4, 2), beta = 3: terms 10/4, 4/2, 3*1/2
    assert theory.time_terms([10, 4, 1], [4, 2], 3) == pytest.approx([2.5, 2.0, 1.5])
    with pytest.raises(S2DError):
        theory.time_terms([10, 1], [2], -1)


def test_insertion_with_new_costs_of_the_old_models():
    # the same insertion as above helps (7 -> 6) while the target costs 10 per call; if
    # verifying the longer block costs it 16: 16/4 + 3/2 + 4*1/2 = 7.5 > 7 -> hurts
    out = theory.insertion_gain([10, 1], [2], 4, position=1, candidate_cost=3,
                                new_accept_lengths=[4, 2], new_costs=[16, 1])
    assert out["before"] == pytest.approx(7.0) and out["after"] == pytest.approx(7.5)
    assert not out["helps"]
    # inserting deeper in a 3-model chain (between M_2 and M_3): 10/4 + 4/3 + 2/2.5 + 2*1/2.5
    deep = theory.insertion_gain([10, 4, 1], [4, 2], 3, position=2, candidate_cost=2,
                                 new_accept_lengths=[4, 3, 2.5], new_beta=2)
    assert deep["before"] == pytest.approx(6.0)
    assert deep["after"] == pytest.approx(2.5 + 4 / 3 + 0.8 + 0.8) and deep["helps"]
    with pytest.raises(S2DError):
        theory.insertion_gain([10, 1], [2], 4, 1, 3, [4, 2], new_costs=[16])


def test_lemma_inputs_reproduce_the_measured_forward_time():
    # 120 tokens, target called 40 times, intermediate 60 times, 240 draft steps
    L, beta = theory.lemma_inputs(120, [40, 60], 240)
    assert L == pytest.approx([3.0, 2.0]) and beta == pytest.approx(4.0)
    costs = [10.0, 3.0, 1.0]
    total = 40 * 10.0 + 60 * 3.0 + 240 * 1.0  # sum_i F_i T_i
    assert theory.chain_time_per_token(costs, L, beta) == pytest.approx(total / 120)
    with pytest.raises(S2DError):
        theory.lemma_inputs(120, [40, 0], 240)
    with pytest.raises(S2DError):
        theory.lemma_inputs(0, [40], 10)


def test_loop_speedup_is_prefill_plus_rounds_times_usage_weighted_round_cost():
    out = theory.loop_speedup(0.002, 0.01, [0.004, 0.006], [3, 1], 0.012, prompts=2,
                              tokens=100, rounds=30)
    round_s = (3 * 0.004 + 1 * 0.006) / 4
    assert out["round_s"] == pytest.approx(round_s)
    assert out["predicted_ar_s"] == pytest.approx(2 * 0.01 + 100 * 0.002)
    assert out["predicted_s"] == pytest.approx(2 * 0.012 + 30 * round_s)
    assert out["predicted_speedup"] == pytest.approx(0.22 / (0.024 + 30 * round_s))
    with pytest.raises(S2DError):
        theory.loop_speedup(0.002, 0.0, [0.0], [1], 0.01, prompts=1, tokens=1, rounds=1)


def test_round_costs_at_steps_interpolates_between_one_and_gamma_steps():
    full, one = [2.0, 3.0], [1.0, 1.5]
    assert theory.round_costs_at_steps(full, one, 4.0, 4) == [2.0, 3.0]
    assert theory.round_costs_at_steps(full, one, 1.0, 4) == [1.0, 1.5]
    assert theory.round_costs_at_steps(full, one, 2.5, 4) == pytest.approx([1.5, 2.25])
    assert theory.round_costs_at_steps(full, one, 1.0, 1) == [2.0, 3.0]  # gamma 1: one step


def test_loop_prediction_applies_the_one_step_rounds_of_a_draft_stop():
    ar = {"prefill_s": 0.01, "round_s": [0.002]}
    probe = {"prefill_s": 0.012, "round_s": [0.004, 0.006]}
    kw = dict(prompts=2, tokens=100, rounds=30)
    want = theory.loop_speedup(0.002, 0.01, [0.004, 0.006], [3, 1], 0.012, **kw)
    assert theory.loop_prediction(ar, probe, [3, 1], 4.0, 4, **kw) == want
    # 2.5 of gamma 4 draft steps per round: halfway between one-step and full rounds
    stop = {**probe, "one_step_round_s": [0.002, 0.003]}
    got = theory.loop_prediction(ar, stop, [3, 1], 2.5, 4, **kw)
    assert got == theory.loop_speedup(0.002, 0.01, [0.003, 0.0045], [3, 1], 0.012, **kw)
    # no drafted token: every forced exit's round weighs the same
    none = theory.loop_prediction(ar, probe, [0, 0], 0.0, 4, **kw)
    assert none["round_s"] == pytest.approx(0.005)
