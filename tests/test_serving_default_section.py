"""--method auto's choice (the "default" section of s2d_serving.json, issue 69) is written
wherever a calibrated setting is: train.smollm2_draft's calibration (the target's config and
the pack's copy, as infer.calibrate writes it) and infer.fetch_smollm2's copies (a sidecar
copied before the committed setting had the section gets it; a user's own stays)."""

import json
import os
import shutil

from infer import fetch_smollm2
from s2d_jax.calibration import calibration_search, method_ranking
from s2d_jax.decode.auto_method import SECTION
from train import smollm2_draft

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                    "demo", "target-l")
S2D = {"draft": "models/smollm2-draft", "exits": [2], "thresholds": [0.0], "gamma": 1,
       "calibrated_on": {"questions": "data/q.jsonl", "prompts": 12}}
DEFAULT = {"method": "lookup", "label": "lookup", "measured_speedup": 1.4,
           "ranking": [{"label": "lookup", "method": "lookup", "measured_speedup": 1.4}]}


def _write(path, value):
    path.write_text(json.dumps(value, indent=2) + "\n")
    return str(path)


def test_fetch_adds_the_section_to_a_copy_of_the_committed_setting_only(tmp_path):
    source = _write(tmp_path / "committed.json", {**S2D, SECTION: DEFAULT})
    old_copy = tmp_path / "model.gguf"  # its sidecar: model.gguf.s2d_serving.json
    old_copy.write_bytes(b"GGUF")
    _write(tmp_path / "model.gguf.s2d_serving.json", S2D)
    own = tmp_path / "own"  # a dir calibrated by its user: another setting
    own.mkdir()
    _write(own / "s2d_serving.json", {**S2D, "gamma": 4})
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    fetch_smollm2.install_serving_config(str(old_copy), str(own), str(fresh), source=source)
    got = json.loads((tmp_path / "model.gguf.s2d_serving.json").read_text())
    assert got == {**S2D, SECTION: DEFAULT}
    assert json.loads((own / "s2d_serving.json").read_text()) == {**S2D, "gamma": 4}
    assert json.loads((fresh / "s2d_serving.json").read_text()) == {**S2D, SECTION: DEFAULT}


def test_smollm2_draft_writes_the_section_in_both_configs(tmp_path, monkeypatch):
    target, out = tmp_path / "target", tmp_path / "pack"
    target.mkdir()
    out.mkdir()
    shutil.copy(os.path.join(DEMO, "config.json"), target)  # a model dir, for the flags
    ranked = []

    def fake_calibrate(opts, name, path, log=None):
        best = {"exits": [2], "thresholds": [0.0], "gamma": 1, "measured_speedup": 1.1}
        return calibration_search.CalibrationResult(best, {"measured_speedup": 1.0}, [],
                                                    json.loads(json.dumps(S2D)), "cal")

    def fake_rank(cal, served):
        ranked.append((cal, served))
        return DEFAULT

    monkeypatch.setattr(calibration_search, "calibrate_target", fake_calibrate)
    monkeypatch.setattr(method_ranking, "rank_methods", fake_rank)
    args = smollm2_draft.parse_args(["--target", str(target), "--work", str(tmp_path / "w"),
                                     "--out", str(out), "--overwrite", "--head-vocab", "0"])
    smollm2_draft.calibrate(args, lambda line: None)
    assert ranked == [("cal", S2D)]  # ranked on the calibration's own runs and setting
    for config in (target / "s2d_serving.json", out / "s2d_serving.json"):
        assert json.loads(config.read_text())[SECTION] == DEFAULT, config
