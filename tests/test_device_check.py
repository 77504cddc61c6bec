"""python -m infer.device_check: refuses a CPU without --allow-cpu and bad flags with one
error line; with --allow-cpu it runs the tiny version (and 3 s of draft training) and writes
the report (~40-60 s on a 2-core CPU, most of it XLA compiles: not marked slow, as the
only end-to-end run of the accelerator check)."""

import json
import os

import pytest

from infer.device_check import main
from tiny_models import cli_error


def test_refuses_a_cpu_without_allow_cpu(tmp_path, capsys):
    out = tmp_path / "dc"
    err = cli_error(main, capsys, ["--out", str(out)])
    assert err.startswith("error: no accelerator: jax.devices() shows only a CPU")
    assert not out.exists()


@pytest.mark.parametrize("value, message", [
    ("vicuna-7b=nan", "--paper-mat vicuna-7b=nan: need one of"),
    ("vicuna-7b=0.5", "--paper-mat vicuna-7b=0.5: need one of"),
    ("llama=3", "--paper-mat llama=3: need one of"),
])
def test_refuses_a_bad_paper_mat(tmp_path, capsys, value, message):
    err = cli_error(main, capsys, ["--out", str(tmp_path / "dc"), "--allow-cpu",
                                   "--paper-mat", value])
    assert err.startswith(f"error: {message}")
    assert not (tmp_path / "dc").exists()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_refuses_a_bad_train_minutes(tmp_path, capsys, value):
    err = cli_error(main, capsys, ["--out", str(tmp_path / "dc"), "--allow-cpu",
                                   "--train-minutes", value])
    assert err.startswith("error: ") and "--train-minutes" in err
    assert not (tmp_path / "dc").exists()


@pytest.mark.slow
def test_allow_cpu_runs_the_tiny_check_and_writes_the_report(tmp_path):
    out = tmp_path / "dc"
    assert main(["--out", str(out), "--allow-cpu", "--samples", "2", "--train-minutes",
                 "0.05"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["device"].startswith("cpu")
    greedy = data["smollm2"]["results"]["0.0"]
    assert greedy["ar"]["exact_match_vs_ar"] == 1.0
    assert all(r["exact_match_vs_ar"] == 1.0 for r in greedy.values())  # lossless, greedy
    tiny = data["shapes"]["tiny"]
    assert sorted(tiny["verify_s"]) == ["1", "2"] and len(tiny["draft_step_s"]) == 3
    assert len(tiny["predictions"]) == 3 and all(p["speedup"] > 0 for p in tiny["predictions"])
    report = (out / "report.md").read_text()
    assert "Device: **cpu" in report and "| target verify, window 2 |" in report
    assert os.path.exists(out / "smollm2" / "report.md")
    assert "(ii) with the paper's MAT not computed" in report
    train = data["train"]  # (c): SoFT on the clock, held-out agreement logged
    assert train["exits"] == [1, 2] and train["steps"] > 1 and train["seconds"] >= 3
    assert len(train["log"]) >= 2 and train["log"][-1]["loss"] is not None
    assert all(0 <= a <= 1 for r in train["log"] for a in r["agreement"].values())
    assert "## (c) SoFT of the sorted draft" in report


@pytest.mark.parametrize("flags, message", [
    (["--parts", "b,c"], "--parts must list a and/or b once each"),
    (["--parts", "a,a"], "--parts must list a and/or b once each"),
    (["--windows", "3"], "--windows must be >= 5"),
])
def test_refuses_bad_parts_and_windows(tmp_path, capsys, flags, message):
    err = cli_error(main, capsys, ["--out", str(tmp_path / "dc"), "--allow-cpu", *flags])
    assert err.startswith(f"error: {message}"), err
    assert not (tmp_path / "dc").exists()
