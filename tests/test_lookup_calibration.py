"""The lookup rung's calibration (calibration/lookup_calibration.py): its greedy replay of
rounds on the target's trajectories equals the engine's own rounds, for `lookup` and for
the ladder (whose draft's tokens the replay scores with calibrate.exit_stats), and the
prediction ranks on measured costs."""

import numpy as np
import pytest

from s2d_jax.calibration import calibrate
from s2d_jax.calibration.lookup_calibration import (LookupSetting, grid, lookup_proposals,
                                              predicted_speedup, replay, section)
from test_engine import CFG, NEW, draft, reference
from test_lookup import PROMPTS, _decoder


@pytest.mark.slow  # three compilations; the calibration's exactness guard
def test_replay_equals_the_engines_greedy_rounds():
    conts = [reference(tuple(p)) for p in PROMPTS]
    dcfg, dparams = draft()
    stats = calibrate.exit_stats(dcfg, dparams, (3,), PROMPTS, conts, 64)
    for setting, dec in [
            (LookupSetting("lookup", (1, 3), 3), _decoder("lookup", 3)),
            (LookupSetting("ladder", (1, 3), 3, 0, 3), _decoder("ladder", 3, 0, (1, 3), (3,))),
            (LookupSetting("ladder", (2, 3), 3, 2, 3), _decoder("ladder", 3, 2, (2, 3), (3,)))]:
        out = dec.generate(PROMPTS, max_new_tokens=NEW, eos_id=-1)
        for j, (p, c, o) in enumerate(zip(PROMPTS, conts, out)):
            sim = replay(list(p) + c, len(p), setting, None, stats.correct[j][:, 0])
            st = o["stats"]
            assert (sim["rounds"], sim["tokens"]) == (st["rounds"], NEW - 1), (setting, p)
            assert sim["lookup_accepted"] == st["accepted_by_rung"]["lookup"], (setting, p)
            if setting.method == "ladder":
                assert sim["draft_accepted"] == st["accepted_by_rung"]["exit 3"], (setting, p)


def test_lookup_proposals_of_every_position_and_the_prediction():
    toks, count = lookup_proposals([1, 2, 3, 1, 2], 3, 2, (1, 3))  # ends E = 3, 4
    assert count.tolist() == [0, 2] and toks[1].tolist() == [2, 3]  # "3" is new; "1" is not
    sims = [{"rounds": 10, "tokens": 20, "draft_steps": 15}]
    costs = {"ar": 1.0, ("lookup", 4): 1.25, ("sd", 2, 4): 2.25}
    assert predicted_speedup(LookupSetting("lookup", (1, 3), 4), sims, costs) == 20 / 12.5
    # ladder: 10 rounds of lookup(4) + 15 draft steps of (2.25 - 1.25) / 4 each
    lad = LookupSetting("ladder", (1, 3), 4, 2, 2)
    assert np.isclose(predicted_speedup(lad, sims, costs), 20 / (12.5 + 15 * 0.25))
    assert len(grid([2, 3], [2, 4])) == 5 * 2 + 5 * 2 * (2 + 3)
    assert section(lad, 1.4, 1.5)["exits"] == [2] and lad.label == "ladder_n1-3_g4_l2_e2"


def test_calibrate_lookup_cli_refuses_bad_input_in_one_line(tmp_path, capsys):
    from infer.calibrate_lookup import main
    from tiny_models import cli_error

    (tmp_path / "t").mkdir()
    base = ["--target", str(tmp_path / "t"), "--draft", str(tmp_path / "t")]
    assert "run python -m infer.calibrate first" in cli_error(main, capsys, base)
    assert "--gammas" in cli_error(main, capsys, base + ["--gammas", "0,2"])
    assert "does not exist" in cli_error(main, capsys, ["--target", str(tmp_path / "x"),
                                                        "--draft", str(tmp_path / "t")])
