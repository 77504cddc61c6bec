"""infer.agreement on the demo family: per-exit teacher-forced agreement of sorted drafts."""

import json
import os

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
                    "--chat-template", "none", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.count("exit ") == 6  # 3 exits, the draft twice
    report = json.loads(out.read_text())
    rows = report["drafts"][DRAFT]
    assert [r["exit"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.0 <= r["agreement"] <= 1.0 and r["tokens"] > 0
    # the demo draft predicts its target well: agreement far above chance
    assert max(r["agreement"] for r in rows) > 0.5
    assert f"exit 1 {rows[0]['agreement']:.3f}" in printed
    assert all(0.0 <= r["accept_t1"] <= 1.0 for r in rows)


def test_the_target_as_its_own_draft_agrees_everywhere(tmp_path):
    out = tmp_path / "self.json"
    agreement.main(["--target", TARGET, "--draft", TARGET, "--questions", QUESTIONS,
                    "--max-prompts", "2", "--max-new-tokens", "12", "--chat-template", "none",
                    "--out", str(out)])
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
