"""In-loop round probes (s2d_jax/loop_costs.py): a decoder with a dynamic draft length is
also timed with one draft step per round, and those rounds really run one step."""

import jax
import pytest

from s2d_jax.decode import engine
from s2d_jax.errors import S2DError
from s2d_jax.bench.loop_costs import ONE_STEP, LoopProbe
from test_engine import make_decoder


def _sampled(probe, rounds_of_samples=3):
    """probe.result() after 9 samples, or after 9 more while the machine was too noisy for
    a round to time above an empty call (what the probe's own error asks for): a round of
    this tiny model is ~0.2 ms, so a loaded machine (CI beside other work) can hide it."""
    for left in range(rounds_of_samples, 0, -1):
        for _ in range(9):
            probe.sample()
        try:
            return probe.result()
        except S2DError as e:
            if left == 1 or "measured no time" not in str(e):
                raise


@pytest.mark.slow
def test_a_draft_stop_adds_one_step_rounds_per_forced_exit():
    dec = make_decoder("s2d", (1, 2, 3), 3, thresholds=[0.3] * 3, stop_threshold=0.4)
    # the longest buffer the model allows and medians of 9: a round of this tiny model is
    # ~0.2 ms, below the noise of a loaded machine in any one timing
    probe = LoopProbe(dec, [5, 6, 7], max_len=96)
    res = _sampled(probe)
    assert res["rounds"] == (96 - 16 - 4 - 2) // 4  # as many as fit after a 16-wide prompt
    assert len(res["round_s"]) == 3 and len(res["one_step_round_s"]) == 3
    # The one-step program drafts exactly one token per round.
    dp = probe.dps[3]
    assert float(dp.stop_threshold) == ONE_STEP
    args = probe._prefill_args(dp)
    state = engine.decode_chunk(probe.first(*args), *probe._loop_args(dp, 4), chain=probe.chain)
    state = jax.device_get(state)
    assert int(state.round) == 4 and state.stats.proposed_at[0].tolist() == [4, 0, 0]
    plain = LoopProbe(make_decoder("s2d", (1, 2, 3), 3, thresholds=[0.3] * 3), [5, 6, 7],
                      max_len=96)
    assert "one_step_round_s" not in _sampled(plain)


def test_a_probe_that_measured_no_time_is_an_error():
    probe = LoopProbe.__new__(LoopProbe)  # the timings alone: no compilation needed
    probe.rounds, probe.prefill_s, probe.dps = 8, [0.1], [None]
    probe.times = [{0: [0.02], 8: [0.01]}]  # 8 rounds faster than none: noise
    with pytest.raises(S2DError, match="measured no time"):
        probe.result()
