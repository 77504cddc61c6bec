"""infer.agreement on the demo family: per-exit teacher-forced agreement of sorted drafts."""

import json
import os

import pytest

from infer import agreement
from tiny_models import cli_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "models", "demo", "target-l")
DRAFT = os.path.join(ROOT, "models", "demo", "draft")
QUESTIONS = os.path.join(ROOT, "data", "demo_calibration.jsonl")


def test_agreement_per_exit_and_draft(tmp_path, capsys):
    out = tmp_path / "agree.json"
    agreement.main(["--target", TARGET, "--draft", DRAFT, "--draft", DRAFT, "--questions",
                    QUESTIONS, "--max-prompts", "3", "--max-new-tokens", "16",
                    "--chat-template", "none", "--out-file", str(out)])
    printed = capsys.readouterr().out
    lines = [ln for ln in printed.splitlines() if ln.startswith(DRAFT)]
    assert [ln.count("exit ") for ln in lines] == [3, 3]  # 3 exits, the draft twice
    report = json.loads(out.read_text())
    rows = report["drafts"][DRAFT]
    assert [r["exit"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.0 <= r["agreement"] <= 1.0 and r["tokens"] > 0
    # the demo draft predicts its target well: agreement far above chance
    assert max(r["agreement"] for r in rows) > 0.5
    assert f"exit 1 {rows[0]['agreement']:.3f}" in printed
    assert all(0.0 <= r["accept_t1"] <= 1.0 for r in rows)
    # paired on the same tokens: a deeper exit's gain is the difference of the agreements
    for prev, r in zip(rows, rows[1:]):
        assert r["gain_over_previous"] == pytest.approx(r["agreement"] - prev["agreement"])
        assert r["gain_se"] >= 0.0
    assert "3 - 2: " in printed
    # and escalation's whole range, paired: the deepest exit over the shallowest
    assert rows[-1]["gain_over_first"] == pytest.approx(rows[-1]["agreement"] - rows[0]["agreement"])
    assert rows[-1]["gain_over_first_se"] >= 0.0
    assert f"deepest minus shallowest, paired: 3 - 1: {rows[-1]['gain_over_first']:+.3f}" in printed
    # escalation's ceiling: some exit right is at least every exit's agreement
    last = rows[-1]
    assert max(r["agreement"] for r in rows) <= last["oracle_agreement"] <= 1.0
    assert last["oracle_gain_over_first"] == pytest.approx(
        last["oracle_agreement"] - rows[0]["agreement"])
    assert f"some exit right (escalation's ceiling): {last['oracle_agreement']:.3f}" in printed
    # greedy MAT replayed per gamma: a longer draft never takes more rounds here, and the
    # oracle (right wherever the first exit is, and more) never more than the first exit
    for r in rows:
        mats = [r["greedy_mat"][str(g)] for g in (1, 2, 3, 4)]
        assert 1.0 <= mats[0] <= 2.0 and mats == sorted(mats)
    assert [c["gamma"] for c in last["oracle_chain"]] == [1, 2, 3, 4]
    for c in last["oracle_chain"]:
        assert c["first_exit_mat"] == rows[0]["greedy_mat"][str(c["gamma"])]
        assert c["oracle_mat"] >= max(r["greedy_mat"][str(c["gamma"])] for r in rows)
        assert c["speedup_cap"] == pytest.approx(c["oracle_mat"] / c["first_exit_mat"])
        assert c["speedup_cap"] >= 1.0 and c["speedup_cap_se"] >= 0.0
    assert "greedy MAT at gamma 1 / 2 / 3 / 4 (replayed along the answers): exit 1 " \
        f"{rows[0]['greedy_mat']['1']:.2f}" in printed


def test_escalation_bound_counts_a_token_once_when_several_exits_are_right():
    import numpy as np

    from s2d_jax.bench.agreement import escalation_bound
    from s2d_jax.bench.exit_stats import ExitStats
    # prompt 0: exit 1 right on token 0, exit 2 on tokens 0 and 1; prompt 1: neither
    correct = [np.array([[True, True], [False, True], [False, False]]),
               np.array([[False, False]])]
    conf = [np.full((3, 2), 0.5), np.full((1, 2), 0.5)]
    b = escalation_bound(ExitStats((1, 2), correct, conf), gammas=(1, 2))
    assert b["oracle_agreement"] == pytest.approx(2 / 4)
    assert b["oracle_gain_over_first"] == pytest.approx(1 / 4)
    assert b["oracle_gain_se"] > 0
    # gamma 1: both take 2 rounds for prompt 0's 3 tokens (a hit skips the next guess) and 1
    # for prompt 1's; gamma 2: the oracle's [T, T] writes prompt 0 in one round, exit 1's
    # [T, F] in two
    g1, g2 = b["oracle_chain"]
    assert (g1["first_exit_mat"], g1["oracle_mat"], g1["speedup_cap"]) == (4 / 3, 4 / 3, 1.0)
    assert (g2["first_exit_mat"], g2["oracle_mat"]) == (4 / 3, 2.0)
    assert g2["speedup_cap"] == pytest.approx(1.5) and g2["speedup_cap_se"] > 0


def test_the_target_as_its_own_draft_agrees_everywhere(tmp_path):
    out = tmp_path / "self.json"
    agreement.main(["--target", TARGET, "--draft", TARGET, "--questions", QUESTIONS,
                    "--max-prompts", "2", "--max-new-tokens", "12", "--chat-template", "none",
                    "--out-file", str(out)])
    (row,) = json.loads(out.read_text())["drafts"][TARGET]
    assert row["agreement"] == 1.0
    assert abs(row["accept_t1"] - 1.0) < 1e-5


def test_bad_input_is_one_error_line(tmp_path, capsys):
    err = cli_error(agreement.main, capsys, ["--target", TARGET, "--draft", DRAFT,
                                             "--questions", str(tmp_path / "nope.jsonl")])
    assert "nope.jsonl" in err
    err = cli_error(agreement.main, capsys, ["--target", TARGET, "--draft", DRAFT,
                                             "--max-prompts", "0"])
    assert "--max-prompts" in err


def test_measurable_exits_stop_at_the_first_exit_without_a_clear_gain():
    def rows(*gains):
        out = [{"exit": 2}]
        for k, (g, se) in enumerate(gains):
            out.append({"exit": 4 + 2 * k, "gain_over_previous": g, "gain_se": se})
        return out
    assert agreement.measurable_exits(rows((0.03, 0.006), (0.004, 0.005), (0.05, 0.01))) == [2, 4]
    assert agreement.measurable_exits(rows((0.01, 0.006))) == [2]
    assert agreement.measurable_exits(rows((0.02, 0.005), (0.02, 0.005))) == [2, 4, 6]
    assert agreement.measurable_exits(rows()) == [2]
