"""train.smollm2_draft's own steps on the demo family: the exits kept by measurement, the
pack's copy of the calibrated setting, bad flags, a run spread over sessions."""

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


@pytest.mark.slow  # four short SoFT runs of a tiny target (~1 min on the loaded 2-core CPU)
def test_a_run_over_sessions_commits_its_progress_and_continues_on_a_new_machine(
        tmp_path, monkeypatch, capsys):
    """--train-minutes stops SoFT and packs every trained exit into --progress; with --work
    gone (a new machine) the same command continues from it at its step; the whole run
    ends in --out with the recipe of every session."""
    import shutil

    import numpy as np

    from s2d_jax.data import corpus
    from s2d_jax.io.checkpoint import checkpoint_kind
    from s2d_jax.train.loop import RECIPE
    from test_corpus import TARGET as TINY, make_corpus
    from tiny_models import tiny_target
    import jax

    from s2d_jax.train import loop
    monkeypatch.setattr(smollm2_draft, "CALIBRATION_PROMPTS",
                        os.path.join(ROOT, "data", "demo_calibration.jsonl"))
    whole_train = loop.train  # the tests' 8 host devices: the pipeline's mesh is one
    monkeypatch.setattr(loop, "train", lambda tc: whole_train(tc, devices=jax.devices()[:1]))
    target = tiny_target(str(tmp_path / "target"))
    make_corpus(tmp_path / "c")
    assert corpus.read_manifest(str(tmp_path / "c"))["target"] == TINY
    progress, out, work = tmp_path / "progress", tmp_path / "out", tmp_path / "work"
    argv = ["--target", target, "--work", str(work), "--out", str(out), "--progress",
            str(progress), "--train-corpus", str(tmp_path / "c"), "--train-exits", "1,3",
            "--head-vocab", "0", "--steps", "3", "--exit-choice", "all",
            "--skip-calibration"]
    smollm2_draft.main(argv + ["--train-minutes", "1e-9"])  # a budget spent at step 1
    said = capsys.readouterr().out
    assert "stopped at step 1 of 3" in said and f"progress in {progress}" in said
    assert checkpoint_kind(str(progress)) == "draft-pack" and not out.exists()
    assert json.loads((progress / RECIPE).read_text())["steps"] == 1
    # a new machine: --work is gone; the next session continues at step 1, stops at 2
    shutil.rmtree(work)
    smollm2_draft.main(argv + ["--train-minutes", "1e-9"])
    said = capsys.readouterr().out
    assert "this run's progress at step 1" in said and "stopped at step 2 of 3" in said
    assert json.loads((progress / RECIPE).read_text())["steps"] == 2
    # the same machine: its checkpoint resumes exactly; the run ends and is packed to --out
    smollm2_draft.main(argv)
    said = capsys.readouterr().out
    assert "stopped at" not in said and f"[pack] wrote {out}" in said
    recipe = json.loads((out / RECIPE).read_text())
    assert recipe["steps"] == 3 and recipe["start"] == "resumed from its checkpoint at step 2"
    assert np.isfinite(json.loads((work / "metrics.jsonl").read_text().splitlines()[-1])["loss"])
    # another run (other exits) may not continue this one's progress
    shutil.rmtree(work)
    err = cli_error(smollm2_draft.main, capsys,
                    ["2,3" if a == "1,3" else a for a in argv] + ["--overwrite"])
    assert "is the progress of a run made with draft.exits=[1, 3]" in err


def test_lr_is_the_plans_peak_and_a_bad_one_is_one_error_line(tmp_path, monkeypatch, capsys):
    from s2d_jax.train import loop
    for bad in ("nan", "-1"):
        err = cli_error(smollm2_draft.main, capsys, ["--target", TARGET, "--lr", bad,
                                                     "--out", str(tmp_path / "pack")])
        assert "--lr" in err and bad.lstrip("-") in err
    plans = []
    monkeypatch.setattr(loop, "train", lambda tc: plans.append(tc) or {"history": []})
    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    for flag, lr in (([], 2e-3), (["--lr", "3e-4"], 3e-4)):  # 0 (absent): the config's
        args = smollm2_draft.parse_args(["--target", TARGET, "--work", str(tmp_path / "w"),
                                         "--out", str(tmp_path / "pack"),
                                         "--head-vocab", "0", *flag])
        smollm2_draft.soft(args, str(rows), log=print)
        assert plans[-1].optimizer.lr == lr


def test_frozen_layers_plan_and_bad_values_are_one_error_line(tmp_path, monkeypatch, capsys):
    """--frozen-layers N trains only the layers past --init-from's first N, with the head
    the frozen exits were trained with; it needs --init-from, an exit past it and no more
    layers than --init-from has. --init-deeper too needs --init-from."""
    from s2d_jax.train import loop
    # target-s: the demo draft's shape (target-l's is wider, so --init-from is refused)
    small = os.path.join(ROOT, "models", "demo", "target-s")
    base = ["--target", small, "--out", str(tmp_path / "pack"), "--work", str(tmp_path / "w")]
    for extra, want in ((["--frozen-layers", "1"], "--init-from"),
                        (["--frozen-layers", "-1", "--init-from", DRAFT], "must be >= 0"),
                        (["--frozen-layers", "8", "--init-from", DRAFT], "freezes every exit"),
                        (["--frozen-layers", "4", "--init-from", DRAFT, "--train-exits", "1,5"],
                         "deeper than --init-from"),
                        (["--init-deeper", "identity"], "--init-from")):
        err = cli_error(smollm2_draft.main, capsys, base + extra)
        assert want in err and extra[0] in err, err
    plans = []
    monkeypatch.setattr(loop, "train", lambda tc: plans.append(tc) or {"history": []})
    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    args = smollm2_draft.parse_args(base + ["--frozen-layers", "2", "--init-from", DRAFT,
                                            "--train-exits", "1,2,4", "--init-deeper",
                                            "identity"])
    smollm2_draft.soft(args, str(rows), log=print)
    tc = plans[-1]
    assert tc.optimizer.frozen_layers == 2 and tc.model.init_from == DRAFT
    assert tc.model.init_deeper == "identity"
    # the demo draft scores the full vocabulary: no sub-vocabulary head is made for it
    assert tc.draft.head_vocab == ""
    assert "layers 1-2 and the final norm frozen" in capsys.readouterr().out
