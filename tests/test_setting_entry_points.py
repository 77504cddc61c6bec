"""Every entry point resolves the SAME decode setting for the same target and draft: the API
(`s2d_jax.Chat`, which `s2d_jax.generate` runs, and `load_decoder`), `infer.generate`,
`infer.chat`, `infer.bench`, the calibration (`infer.calibrate`) and AOT (`infer.aot`), each
through its own code path up to the DecodeSetting it would decode (or compile) with.

On the demo family's smallest target with a serving config of our own (values no default
has, so a path that skipped it, or used other exits, another gamma or other thresholds,
fails), and on the same target without one (the defaults: the draft's stored exits, the
paper's thresholds, DEFAULT_GAMMA)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(ROOT, "models", "demo", "target-s")
DRAFT = os.path.join(ROOT, "models", "demo", "draft")  # s2d_exits [1, 2, 3]
SERVED = {"exits": [1, 3], "thresholds": [0.3, 0.0], "gamma": 3, "stop_threshold": 0.2,
          "measured_speedup": 1.2, "predicted_speedup": 1.3,
          "lookup": {"gamma": 5, "ngram": [2, 4], "lookup_len": 0},
          "ladder": {"gamma": 3, "ngram": [1, 2], "lookup_len": 2, "exits": [2],
                     "thresholds": [0.0], "stop_threshold": 0.0}}


def _target(tmp_path, served: dict | None) -> str:
    """The demo target's files (links) in a dir of its own, with `served` as its
    s2d_serving.json (none: uncalibrated)."""
    path = tmp_path / ("calibrated" if served else "plain")
    path.mkdir()
    for name in os.listdir(DEMO_TARGET):
        if name != "s2d_serving.json":
            os.symlink(os.path.join(DEMO_TARGET, name), path / name)
    if served:
        (path / "s2d_serving.json").write_text(json.dumps(served))
    return str(path)


def _engine_fields(s) -> tuple:
    """What a decode runs with (the `calibrated` flag and the note are for the user)."""
    return (s.method, s.exits, s.thresholds, s.gamma, s.stop_threshold, s.ngram, s.lookup_len)


def _api(target, method):
    import s2d_jax
    from s2d_jax.decode.chat import load_decoder
    chat = s2d_jax.Chat(target, DRAFT, method=method)
    assert chat.decoder.setting == load_decoder(target, DRAFT, method=method)[0].setting
    return chat.decoder.setting


def _generate(target, method):
    from infer import generate
    from s2d_jax.cli.args import parse_targets
    args = generate.parse_args(["--target", target, "--draft", DRAFT, "--method", method,
                                "--prompt", "hi"])
    generate.check_args(args)
    engine, _ = generate.build_engine(args, parse_targets(args.target))
    (decoder,) = engine.decoders.values()
    return decoder.setting


def _chat(target, method):
    from infer import chat
    args = chat.parse_args(["--target", target, "--draft", DRAFT, "--method", method])
    chat.check_args(args)
    return chat.open_chat(args).decoder.setting


def _bench(target, method, calibrated, tmp_path):
    """infer.bench's path: its flags, its shared inputs (the draft and its exits), the
    target's load and its runs; the run of `method` (its calibrated kind on a calibrated
    target; a single-exit method at the draft's deepest exit, as the API's default)."""
    from infer import bench
    from s2d_jax.bench import target_bench
    from s2d_jax.decode.methods import CALIBRATED, proposer
    kind = method + CALIBRATED if calibrated and proposer(method).calibrated else method
    args = bench.parse_args(["--targets", f"t={target}", "--draft", DRAFT, "--methods", kind,
                             "--out", str(tmp_path / "bench")])
    targets, temps, kinds, _ = bench._check_args(args)
    shared = bench._inputs(args, targets, temps, kinds)
    opts = bench._options(args)
    t = target_bench._load("t", target, opts, shared["tok"], shared["draft"])
    target_bench._method_specs(t, opts, kinds)
    specs = [s for s in t.specs if not proposer(method).single_exit or s.exits == (3,)]
    assert len(specs) == 1, t.specs
    return specs[0].setting


def _calibrate(target):
    """infer.calibrate's path up to the setting it starts from and compares with (the
    uncalibrated one at its paper gamma, DEFAULT_GAMMA among the default --gammas)."""
    from infer import calibrate
    args = calibrate.parse_args(["--target", target, "--draft", DRAFT, "--dry-run"])
    gammas, stops = calibrate._validate(args)
    from s2d_jax.calibration.calibration import Calibration
    return Calibration(calibrate.options(args, gammas, stops), "t", target).paper


def _aot(target, method):
    from infer import aot
    args = aot._parse(["--target-config", target, "--draft-config", DRAFT, "--method", method,
                       "--context", "1024", "--batch-sizes", "1", "--mesh", "tensor=1"])
    target_cfg, draft_cfg, exits = aot._models(args, None)
    return aot._setting(args, target_cfg, draft_cfg, exits, None)


def _all(target, method, calibrated, tmp_path) -> dict:
    return {"api": _api(target, method), "infer.generate": _generate(target, method),
            "infer.chat": _chat(target, method),
            "infer.bench": _bench(target, method, calibrated, tmp_path),
            "infer.aot": _aot(target, method)}


@pytest.mark.parametrize("method, expect", [
    ("s2d", ("s2d", (1, 3), (0.3, 0.0), 3, 0.2, (1, 3), 0)),
    ("lookup", ("lookup", (), None, 5, 0.0, (2, 4), 0)),
    ("ladder", ("ladder", (2,), (0.0,), 3, 0.0, (1, 2), 2)),
])
def test_every_entry_point_takes_the_calibrated_setting(tmp_path, method, expect):
    target = _target(tmp_path, SERVED)
    found = {k: _engine_fields(s) for k, s in _all(target, method, True, tmp_path).items()}
    assert found == {k: expect for k in found}, found


@pytest.mark.parametrize("method, expect", [
    ("ar", ("ar", (), None, 0, 0.0, (1, 3), 0)),
    ("sd", ("sd", (3,), (0.0,), 4, 0.0, (1, 3), 0)),
    ("s2d", ("s2d", (1, 2, 3), (0.5, 0.5, 0.0), 4, 0.0, (1, 3), 0)),
    ("ladder", ("ladder", (1, 2, 3), (0.5, 0.5, 0.0), 4, 0.0, (1, 3), 0)),
])
def test_every_entry_point_takes_the_same_defaults(tmp_path, method, expect):
    target = _target(tmp_path, None)
    found = {k: _engine_fields(s) for k, s in _all(target, method, False, tmp_path).items()}
    if method == "s2d":  # what the calibration starts from and compares with
        found["infer.calibrate"] = _engine_fields(_calibrate(target))
    assert found == {k: expect for k in found}, found


def test_a_setting_is_checked_when_made():
    """The one setting object refuses what no decode could run, whoever builds it."""
    from s2d_jax.decode.serving_config import DecodeSetting
    from s2d_jax.errors import S2DError
    ok = DecodeSetting("s2d", (1, 3), (0.5, 0.0), 4)
    assert dataclasses.replace(ok, gamma=2).gamma == 2
    for bad, match in [(dict(method="medusa"), "unknown method"),
                       (dict(exits=(3, 1)), "exits must be increasing"),
                       (dict(thresholds=(0.5,)), "1 threshold"),
                       (dict(thresholds=(0.5, float("nan"))), "thresholds"),
                       (dict(gamma=0), "gamma"),
                       (dict(stop_threshold=1.5), "stop threshold"),
                       (dict(ngram=(3, 1)), "n range"),
                       (dict(lookup_len=5), "lookup length"),
                       (dict(method="sd"), "exactly one exit"),
                       (dict(method="lookup"), "no exits")]:
        with pytest.raises(S2DError, match=match):
            dataclasses.replace(ok, **bad)
    assert DecodeSetting("ar", (), None, 4).gamma == 0  # AR drafts nothing
