"""`--method auto` (issue 69, item 4): the calibration ranks every method it contains (AR,
lookup, SD at each exit, S2D, the ladder) on the same prompts and writes the fastest exact
one as the target's default; auto decodes with that stored winner in every entry point, and
with S2D where the target has no calibration. On the demo family's smallest target and its
draft (exits 1, 2, 3)."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(ROOT, "models", "demo", "target-s")
DRAFT = os.path.join(ROOT, "models", "demo", "draft")  # s2d_exits [1, 2, 3]
# values no default has, so a path that skipped the file (or the default section) fails
SERVED = {"exits": [1, 3], "thresholds": [0.3, 0.0], "gamma": 3, "stop_threshold": 0.0,
          "lookup": {"gamma": 5, "ngram": [2, 4], "lookup_len": 0},
          "ladder": {"gamma": 3, "ngram": [1, 2], "lookup_len": 2, "exits": [2],
                     "thresholds": [0.0], "stop_threshold": 0.0}}
SD_2 = {"exits": [2], "thresholds": [0.0], "gamma": 2, "stop_threshold": 0.0,
        "ngram": [1, 3], "lookup_len": 0}
LOOKUP = {"exits": [], "thresholds": None, "gamma": 5, "stop_threshold": 0.0,
          "ngram": [2, 4], "lookup_len": 0}
DEFAULT = {"method": "sd", "label": "sd@2", "ranking": [
    {"label": "sd@2", "method": "sd", "setting": SD_2, "measured_speedup": 1.5},
    {"label": "lookup", "method": "lookup", "setting": LOOKUP, "measured_speedup": 1.3},
    {"label": "ar", "method": "ar", "setting": {"exits": [], "gamma": 0},
     "measured_speedup": 1.0}]}


def _target(tmp_path, served: dict | None, name="t") -> str:
    """The demo target's files (links) in a dir of its own with `served` as its
    s2d_serving.json (None: uncalibrated)."""
    path = tmp_path / name
    path.mkdir()
    for f in os.listdir(DEMO_TARGET):
        if f != "s2d_serving.json":
            os.symlink(os.path.join(DEMO_TARGET, f), path / f)
    if served:
        (path / "s2d_serving.json").write_text(json.dumps(served))
    return str(path)


def _fields(s) -> tuple:
    return (s.method, s.exits, s.thresholds, s.gamma, s.stop_threshold, s.ngram, s.lookup_len)


def _entry_points(target, tmp_path) -> dict:
    """The setting --method auto (each command's default) decodes with, per entry point."""
    from infer import bench, chat, generate
    from s2d_jax.bench import target_bench
    from s2d_jax.cli.args import parse_targets
    from s2d_jax.decode.chat import load_decoder

    out = {"api": load_decoder(target, DRAFT)[0].setting}
    args = generate.parse_args(["--target", target, "--draft", DRAFT, "--prompt", "hi"])
    generate.check_args(args)
    out["infer.generate"] = next(iter(generate.build_engine(
        args, parse_targets(args.target))[0].decoders.values())).setting
    args = chat.parse_args(["--target", target, "--draft", DRAFT])
    chat.check_args(args)
    out["infer.chat"] = chat.open_chat(args).decoder.setting
    args = bench.parse_args(["--targets", f"t={target}", "--draft", DRAFT, "--methods", "auto",
                             "--out", str(tmp_path / "bench")])
    targets, temps, kinds, _ = bench._check_args(args)
    shared = bench._inputs(args, targets, temps, kinds)
    t = target_bench._load("t", target, bench._options(args), shared["tok"], shared["draft"])
    target_bench._method_specs(t, bench._options(args), kinds)
    (spec,) = t.specs
    assert spec.label == "auto"
    out["infer.bench"] = spec.setting
    return {k: _fields(s) for k, s in out.items()}


@pytest.mark.parametrize("served, expect", [
    # the stored winner with its ranked setting (SD at exit 2, gamma 2: not SD's default)
    ({**SERVED, "default": DEFAULT}, ("sd", (2,), (0.0,), 2, 0.0, (1, 3), 0)),
    # calibrated, not ranked: the calibrated S2D setting
    (SERVED, ("s2d", (1, 3), (0.3, 0.0), 3, 0.0, (1, 3), 0)),
    # no calibration: S2D with the paper's settings
    (None, ("s2d", (1, 2, 3), (0.5, 0.5, 0.0), 4, 0.0, (1, 3), 0)),
], ids=["ranked", "s2d-calibrated", "uncalibrated"])
def test_auto_decodes_with_the_stored_winner_in_every_entry_point(tmp_path, served, expect):
    found = _entry_points(_target(tmp_path, served), tmp_path)
    assert found == {k: expect for k in found}, found


def test_auto_without_a_draft_takes_the_fastest_ranked_method_without_one(tmp_path):
    from s2d_jax.decode.auto_method import choose
    from s2d_jax.decode.chat import load_decoder

    served = {**SERVED, "default": DEFAULT}
    assert choose(served, has_draft=True).method == "sd"
    pick = choose(served, has_draft=False)
    assert pick.method == "lookup" and "needs a draft" in pick.note
    decoder, _, notes = load_decoder(_target(tmp_path, served), None)
    assert _fields(decoder.setting) == ("lookup", (), None, 5, 0.0, (2, 4), 0)
    assert any("sd@2 needs a draft" in n for n in notes)


def test_given_settings_apply_to_the_chosen_method(tmp_path):
    from s2d_jax.decode.chat import load_decoder
    target = _target(tmp_path, {**SERVED, "default": DEFAULT})
    setting = load_decoder(target, DRAFT, gamma=5)[0].setting
    assert (setting.method, setting.exits, setting.gamma) == ("sd", (3,), 5)  # as --method sd


def test_auto_refusals_are_one_line(tmp_path, capsys):
    from infer.generate import main
    from tiny_models import cli_error
    plain = _target(tmp_path, None, "plain")
    err = cli_error(main, capsys, ["--target", plain, "--prompt", "hi"])
    assert "--method auto decodes with s2d here" in err and "--draft" in err
    bad = _target(tmp_path, {**SERVED, "default": {"method": "sd", "ranking": []}}, "bad")
    err = cli_error(main, capsys, ["--target", bad, "--draft", DRAFT, "--prompt", "hi"])
    assert "'default' section is not valid" in err and "infer.calibrate_lookup" in err


def test_the_ranked_runs_are_every_method_contained_once():
    from s2d_jax.calibration.method_ranking import candidates
    specs = candidates(SERVED, (1, 2, 3))
    assert [s.label for s in specs] == ["ar", "sd@1", "sd@2", "sd@3", "s2d", "lookup",
                                        "ladder"]
    by = {s.label: s for s in specs}
    assert by["sd@1"].gamma == 3 and by["s2d"].exits == (1, 3)  # S2D's calibrated gamma
    assert by["lookup"].ngram == (2, 4) and by["ladder"].lookup_len == 2
    # S2D calibrated to one exit drafts as SD there: run once, as SD
    one = {**SERVED, "exits": [2], "thresholds": [0.0]}
    assert [s.label for s in candidates(one, (1, 2, 3))] == [
        "ar", "sd@1", "sd@2", "sd@3", "lookup", "ladder"]
    assert "s2d" in [s.label for s in candidates(None, (1, 2, 3))]


def _rows(tokens, seconds, ids=None):
    return [{"token_ids": ids[i] if ids else [7] * n, "seconds": s,
             "stats": {"rounds": n, "mean_accepted_tokens": 1.0, "exit_usage": []}}
            for i, (n, s) in enumerate(zip(tokens, seconds))]


def test_rank_orders_by_speed_pairs_per_prompt_and_puts_inexact_runs_last():
    from s2d_jax.calibration.method_ranking import candidates, rank
    specs = [s for s in candidates(SERVED, (1, 2, 3)) if s.label in ("ar", "lookup", "sd@2")]
    per = {"ar": _rows([10, 10], [1.0, 1.0]),
           "lookup": _rows([10, 10], [0.5, 0.8]),  # 2.0x and 1.25x AR per prompt
           "sd@2": _rows([10, 10], [0.2, 0.2], ids=[[7] * 10, [8] * 10])}  # fast, not exact
    rows = rank(per, specs)
    assert [r["label"] for r in rows] == ["lookup", "ar", "sd@2"]
    assert [r["exact"] for r in rows] == [True, True, False]
    assert rows[0]["measured_speedup"] == pytest.approx(20 / 1.3 / 10)
    assert rows[1]["paired_over_best"] == pytest.approx((0.5 + 0.8) / 2)
    assert rows[1]["paired_se"] == pytest.approx(0.15)  # sd 0.212 over 2 prompts
    assert rows[0]["setting"] == LOOKUP


def _row(label, method, speed, ratio, se):
    return {"label": label, "method": method, "measured_speedup": speed,
            "paired_over_best": ratio, "paired_se": se}


def test_the_choice_is_the_fastest_unless_a_method_it_contains_ties_it_per_prompt():
    from s2d_jax.calibration.method_ranking import pick
    # SmolLM2's ranking run on a loaded machine: the ladder fastest in the aggregate, the
    # lookup it contains as fast per prompt within the noise -> the lookup
    ladder, lookup = _row("ladder", "ladder", 1.75, 1.0, 0.0), _row("lookup", "lookup", 1.49,
                                                                     1.05, 0.111)
    sd, ar = _row("sd@2", "sd", 1.07, 0.682, 0.077), _row("ar", "ar", 1.0, 0.658, 0.077)
    assert pick([ladder, lookup, sd, ar]) is lookup
    # measurably slower per prompt (0.92 +- 0.01): the ladder pays for its rung
    slower = _row("lookup", "lookup", 1.49, 0.92, 0.01)
    assert pick([ladder, slower, sd, ar]) is ladder
    # a tied method the fastest does not contain (SD is no part of the lookup) is no choice
    won = _row("lookup", "lookup", 1.5, 1.0, 0.0)
    assert pick([won, _row("sd@2", "sd", 1.49, 0.99, 0.05), ar]) is won
    # AR, which every method contains, is kept where speculation does not pay
    tied_ar = _row("ar", "ar", 0.99, 1.0, 0.02)
    assert pick([_row("s2d", "s2d", 1.01, 1.0, 0.0), sd, tied_ar]) is tied_ar


@pytest.mark.slow  # ~40 s: seven decoders compiled and run on the demo family
def test_calibration_ranks_the_contained_methods_and_auto_uses_the_winner(tmp_path):
    from s2d_jax.calibration.calibration import CalibrateOptions, Calibration
    from s2d_jax.calibration.method_ranking import rank_methods
    from s2d_jax.decode.auto_method import SECTION
    from s2d_jax.decode.chat import load_decoder

    target = _target(tmp_path, SERVED)
    opts = CalibrateOptions(draft=DRAFT, questions=os.path.join(ROOT, "data",
                                                                "demo_calibration.jsonl"),
                            max_prompts=2, max_new_tokens=16, repeats=1, chat_template="none")
    section = rank_methods(Calibration(opts, "t", target), SERVED)
    labels = [r["label"] for r in section["ranking"]]
    assert sorted(labels) == sorted(["ar", "sd@1", "sd@2", "sd@3", "s2d", "lookup", "ladder"])
    speeds = [r["measured_speedup"] for r in section["ranking"][1:]]
    assert speeds == sorted(speeds, reverse=True) and not section["not_exact"]
    assert section["label"] == labels[0]
    from s2d_jax.calibration.method_ranking import pick
    assert pick(sorted(section["ranking"], key=lambda r: -r["measured_speedup"]))[
        "label"] == labels[0]
    with open(os.path.join(target, "s2d_serving.json"), "w") as f:
        json.dump({**SERVED, SECTION: section}, f)
    setting = load_decoder(target, DRAFT)[0].setting
    won = section["ranking"][0]
    assert setting.method == won["method"] and setting.gamma == won["setting"]["gamma"]
    assert list(setting.exits) == won["setting"]["exits"] and setting.calibrated
