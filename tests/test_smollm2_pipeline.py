"""train.smollm2_draft's own steps on the demo family: the exits kept by measurement, the
pack's copy of the calibrated setting, bad flags."""

import json
import os
import shlex

import pytest

from infer import agreement
from tiny_models import cli_error
from train import smollm2_draft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "models", "demo", "target-l")
DRAFT = os.path.join(ROOT, "models", "demo", "draft")


class Args:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.slow  # CI time: two drafts' agreement measured end to end
def test_choose_exits_keeps_the_measurably_better_prefix(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(smollm2_draft, "CALIBRATION_PROMPTS",
                        os.path.join(ROOT, "data", "demo_calibration.jsonl"))
    logged = []
    args = Args(target=TARGET, work=str(tmp_path), exit_choice="auto")
    kept = smollm2_draft.choose_exits(args, DRAFT, [1, 2, 3], logged.append)
    rows = json.loads((tmp_path / "exit_choice.json").read_text())["drafts"][DRAFT]
    assert [r["exit"] for r in rows] == [1, 2, 3]
    assert kept == agreement.measurable_exits(rows) and kept == [1, 2, 3][:len(kept)]
    assert f"exits {kept} of [1, 2, 3] (auto" in logged[0]
    args.exit_choice = "all"
    assert smollm2_draft.choose_exits(args, DRAFT, [1, 2, 3], logged.append) == [1, 2, 3]


def test_the_pack_keeps_the_setting_with_repository_paths_and_its_command(tmp_path):
    target = tmp_path / "target"
    record = {"draft": "../../x/models/smollm2-draft", "exits": [2], "thresholds": [0.0],
              "gamma": 1, "calibrated_on": {"questions": "../../x/data/q.jsonl", "prompts": 12}}
    out = json.loads(smollm2_draft.pack_serving_record(Args(target=str(target),
                                                            out="models/smollm2-draft"), record))
    assert record["draft"] == "../../x/models/smollm2-draft"  # the target's copy unchanged
    assert out["draft"] == "models/smollm2-draft" and out["exits"] == [2]
    assert out["calibrated_on"]["questions"] == smollm2_draft.CALIBRATION_PROMPTS
    command = out["calibrated_on"]["command"]
    assert command.startswith("python -m infer.calibrate --target smollm2=")
    assert "--draft models/smollm2-draft" in command and str(target) in command
    # the command's flags are the calibration's settings, as infer.calibrate parses them
    from infer.calibrate import _validate, options, parse_args
    from s2d_jax.calibration.calibration import CalibrateOptions
    cli = parse_args(shlex.split(command)[3:])
    assert options(cli, *_validate(cli)) == CalibrateOptions(
        draft="models/smollm2-draft", questions=smollm2_draft.CALIBRATION_PROMPTS,
        **smollm2_draft.CALIBRATION)


def test_a_bad_exit_choice_is_one_error_line(tmp_path, capsys):
    err = cli_error(smollm2_draft.main, capsys, ["--target", str(tmp_path), "--exit-choice",
                                                 "best", "--out", str(tmp_path / "pack")])
    assert "--exit-choice" in err and "auto" in err
