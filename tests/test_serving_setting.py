"""One decode setting per target, whoever asks: the API (s2d_jax.generate / load_decoder),
python -m infer.generate, the benchmark's method runs and the calibration resolve the same
exits, thresholds, gamma and draft stop (serving_config.resolve) on one draft + target,
given as a .gguf file and as the HF dir converted from it."""

import json
import shutil

import pytest

import s2d_jax
from s2d_jax.decode import serving_config
from s2d_jax.decode.serving_config import DecodeSetting, resolve
from s2d_jax.io.checkpoint import load_model
from s2d_jax.io.hf import export_hf
from tiny_gguf import hf_weights, write_gguf

# calibrated on exit 2 alone, as SmolLM2's draft: not the draft's exits (1, 2) nor gamma 4
SERVED = {"exits": [2], "thresholds": [0.0], "gamma": 2, "stop_threshold": 0.25,
          "measured_speedup": 1.5}
CALIBRATED = DecodeSetting("s2d", (2,), (0.0,), 2, 0.25)
PAPER = DecodeSetting("s2d", (1, 2), (0.5, 0.0), 4, 0.0)


def _pair(root) -> dict:
    """{"gguf": FILE.gguf, "hf": the HF dir python -m infer.convert makes of it}, the
    .gguf calibrated (FILE.gguf.s2d_serving.json, which the conversion carries along)."""
    from infer import convert

    root.mkdir()
    gguf = str(root / "t.gguf")
    write_gguf(gguf, hf_weights())
    serving_config.write_serving_config(gguf, SERVED)
    assert convert.main(["gguf-to-hf", "--src", gguf, "--out", str(root / "hf")]) == 0
    return {"gguf": gguf, "hf": str(root / "hf")}


def _bare_copy(pair: dict, root) -> dict:
    """The same .gguf and HF dir without their calibration."""
    root.mkdir()
    shutil.copy(pair["gguf"], root / "t.gguf")
    shutil.copytree(pair["hf"], root / "hf",
                    ignore=shutil.ignore_patterns(serving_config.SERVING_CONFIG))
    return {"gguf": str(root / "t.gguf"), "hf": str(root / "hf")}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("setting")
    calibrated = _pair(root / "cal")
    targets = {"calibrated": calibrated, "bare": _bare_copy(calibrated, root / "bare")}
    cfg, params, _ = load_model(targets["bare"]["hf"])  # 2 layers: a draft exiting at 1, 2
    export_hf(params, cfg, str(root / "draft"), extra={"s2d_exits": [1, 2]},
              tokenizer_dir=targets["bare"]["hf"])
    questions = root / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x",
                                     "turns": ["the tis"]}) + "\n")
    return targets, str(root / "draft"), str(questions)


def _of_decoder(dec) -> DecodeSetting:
    spec = dec.spec_base
    return DecodeSetting(spec.method, tuple(spec.exits), tuple(dec.thresholds), spec.gamma,
                         dec.stop_threshold)


def _plain(s: DecodeSetting) -> DecodeSetting:
    return DecodeSetting(s.method, s.exits, s.thresholds, s.gamma, s.stop_threshold)


def api_setting(target, draft):
    from s2d_jax.decode.chat import load_decoder
    return _of_decoder(load_decoder(target, draft, method="s2d")[0])


def generate_cli_setting(target, draft):
    from infer.generate import build_engine, check_args, parse_args
    args = parse_args(["--target", f"t={target}", "--draft", draft, "--prompt", "x"])
    check_args(args)
    return _of_decoder(build_engine(args, {"t": target})[0].decoder("t"))


def bench_settings(target, draft) -> dict:
    """label -> the setting of the benchmark's s2d (paper) and s2d-cal runs."""
    from s2d_jax.bench import target_bench
    from s2d_jax.decode.defaults import draft_exits
    from s2d_jax.io.checkpoint import load_draft
    from s2d_jax.io.tokenizer import load_tokenizer

    opts = target_bench.BenchOptions()
    d_cfg, d_params, extra = load_draft(draft, None)
    t = target_bench._load("t", target, opts, load_tokenizer(target),
                           (d_cfg, d_params, draft_exits(extra, d_cfg)))
    target_bench._method_specs(t, opts, ["s2d", "s2d-cal"])
    return {s.label: DecodeSetting(s.method, s.exits, s.thresholds, s.gamma, s.stop)
            for s in t.specs}


def calibration_paper_setting(target, draft, questions):
    from s2d_jax.calibration.calibration import CalibrateOptions, Calibration
    opts = CalibrateOptions(draft=draft, questions=questions, max_new_tokens=8)
    return _plain(Calibration(opts, "t", target, log=lambda msg: None).paper)


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_every_entry_point_resolves_the_calibrated_setting(family, fmt):
    targets, draft, questions = family
    target = targets["calibrated"][fmt]
    assert api_setting(target, draft) == CALIBRATED
    assert generate_cli_setting(target, draft) == CALIBRATED
    bench = bench_settings(target, draft)
    assert bench["s2d-cal"] == CALIBRATED and bench["s2d-0.5"] == PAPER
    # the calibration compares with the paper's setting, as the benchmark's s2d run
    assert calibration_paper_setting(target, draft, questions) == PAPER


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_without_a_calibration_every_entry_point_resolves_the_papers(family, fmt):
    targets, draft, questions = family
    target = targets["bare"][fmt]
    assert api_setting(target, draft) == PAPER
    assert generate_cli_setting(target, draft) == PAPER
    assert bench_settings(target, draft) == {"s2d-0.5": PAPER}  # s2d-cal skipped
    assert calibration_paper_setting(target, draft, questions) == PAPER


@pytest.mark.slow  # compiles two generations (~30 s here)
def test_the_api_generates_with_the_resolved_setting(family):
    targets, draft, _ = family
    for target in targets["calibrated"].values():
        out = s2d_jax.generate("the", target=target, draft=draft, max_new_tokens=4)
        assert out["stats"]["exits"] == [2] and out["stats"]["gamma"] == 2


def test_the_fit_rule_is_a_subset_of_the_drafts_exits_with_a_threshold_each():
    served = {"exits": [2], "thresholds": [0.0], "gamma": 1, "stop_threshold": 0.0}
    assert resolve("s2d", (2, 4), served) == DecodeSetting("s2d", (2,), (0.0,), 1, 0.0,
                                                           calibrated=True)
    # an exit the draft lacks, or a threshold count that is not the exits': not used
    for bad in ({**served, "exits": [3]}, {**served, "thresholds": [0.5, 0.0]}):
        s = resolve("s2d", (2, 4), bad, target="T")
        assert _plain(s) == DecodeSetting("s2d", (2, 4), (0.5, 0.0), 4, 0.0)
        assert not s.calibrated and "T's calibrated setting" in s.note
    # other exits asked for, or thresholds given: the calibration is for another setting
    assert _plain(resolve("s2d", (2, 4), served, exits=[2, 4])) == DecodeSetting(
        "s2d", (2, 4), (0.5, 0.0), 4, 0.0)
    assert resolve("s2d", (2, 4), served, thresholds=[0.3]).exits == (2,)
    assert resolve("s2d", (2, 4), served, gamma=3, stop_threshold=0.0).gamma == 3
    # without 'exits' the calibration is for the draft's
    assert resolve("s2d", (2, 4), {**served, "exits": None, "thresholds": [0.3, 0.0]}
                   ).thresholds == (0.3, 0.0)
    assert resolve("sd", (2, 4), served, draft_layers=4).exits == (4,)
    assert resolve("self", (), None, exit=3).thresholds == (0.0,)
    assert resolve("ar").exits == () and resolve("ar").thresholds is None
