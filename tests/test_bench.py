"""`python -m infer.bench` end to end on tiny random exported models (2 prompts, ar + s2d)."""

import json
import os

import jax
import numpy as np
import pytest

from infer.bench import main
from s2d_jax.bench import runner as bench
from s2d_jax.model import transformer as model
from s2d_jax.bench import theory
from s2d_jax.decode.serving_config import SERVING_CONFIG
from s2d_jax.errors import S2DError
from s2d_jax.config import ModelConfig
from s2d_jax.io.hf import export_hf
from tiny_models import cli_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "assets", "llama2_tokenizer")
CFG = ModelConfig(vocab_size=32000, hidden_size=16, intermediate_size=32, num_layers=3,
                  num_heads=2, num_kv_heads=1, max_position_embeddings=128)


def export_tiny_family(root):
    """target (3 layers) + sorted draft = its first 2 layers with exits [1, 2]."""
    rng = np.random.default_rng(0)

    def leaf(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(x.shape, np.float32)
        return (0.5 * rng.standard_normal(x.shape)).astype(np.float32)

    target = jax.tree_util.tree_map_with_path(leaf, model.abstract_params(CFG))
    export_hf(target, CFG, str(root / "target"), tokenizer_dir=TOKENIZER)
    draft_cfg = ModelConfig(**{**CFG.__dict__, "num_layers": 2})
    draft = dict(target, layers=jax.tree.map(lambda x: x[:2], target["layers"]))
    export_hf(draft, draft_cfg, str(root / "draft"), extra={"s2d_exits": [1, 2]},
              tokenizer_dir=TOKENIZER)
    q = root / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                         for i, (c, t) in enumerate([("math_reasoning", "What is 2+2?"),
                                                     ("writing", "Say hi."),
                                                     ("writing", "Unused third prompt.")])))
    return root


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return export_tiny_family(tmp_path_factory.mktemp("bench"))


def test_bench_end_to_end_report_is_consistent(family, capsys):
    out = family / "out"
    (family / "target" / SERVING_CONFIG).write_text(json.dumps({"thresholds": [0.2, 0.0],
                                                                 "gamma": 2}))
    rc = main(["--target", f"t={family / 'target'}", "--draft", str(family / "draft"),
               "--questions", str(family / "q.jsonl"), "--max-prompts", "2",
               "--methods", "ar,s2d,s2d-cal", "--temperatures", "0", "--max-new-tokens", "8",
               "--gamma", "2", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    res = rep["targets"]["t"]["results"]["0.0"]
    assert set(res) == {"ar", "s2d-0.5", "s2d-cal"}
    assert res["s2d-cal"]["thresholds"] == [0.2, 0.0] and res["s2d-cal"]["gamma"] == 2
    for label, m in res.items():
        for key in ("tokens_per_second", "speedup_vs_ar", "mean_accepted_tokens",
                    "exact_match_vs_ar", "predicted_speedup", "per_category", "exit_usage"):
            assert key in m, (label, key)
        assert m["exact_match_vs_ar"] == 1.0  # greedy decoding is lossless
        assert m["new_tokens"] == 16  # 2 prompts x 8 tokens (random weights: no EOS early)
        assert m["tokens_per_second"] == pytest.approx(m["new_tokens"] / m["seconds"])
        # grouped by Spec-Bench task: MT-bench's "writing" counts as mt_bench
        assert set(m["per_category"]) == {"math_reasoning", "mt_bench"}
        assert m["mean_accepted_tokens"] >= 1.0
    assert res["ar"]["speedup_vs_ar"] == 1.0 and res["ar"]["predicted_speedup"] == 1.0
    m = res["s2d-0.5"]
    # the prefills as this run timed them (per turn, split off the rounds), not the probe
    # prompt's: a prefill's cost follows each prompt's length
    assert 0 < m["prefill_seconds"] < m["seconds"]
    assert 0 < res["ar"]["prefill_seconds"] < res["ar"]["seconds"]
    assert m["draft_steps_per_round"] == pytest.approx(sum(m["exit_usage"]) / m["rounds"])
    answers = (out / "answers" / "t" / "s2d-cal-T0.jsonl").read_text().splitlines()
    row = json.loads(answers[0])
    assert row["model_id"] == "t-s2d-cal" and row["question_id"] == 0
    assert row["choices"][0]["new_tokens"] == [8] and len(row["choices"][0]["turns"]) == 1
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "report.md").read_text()
    assert "| t | 0.0 | s2d-cal |" in table and table in capsys.readouterr().out
    assert any("exact match" in c["check"] and c["pass"] for c in rep["acceptance"])
    costs = rep["targets"]["t"]["costs"]
    for label in ("s2d-0.5", "s2d-cal"):
        m = res[label]
        assert m["speedup_vs_ar"] == pytest.approx(
            m["tokens_per_second"] / res["ar"]["tokens_per_second"])
        assert m["exit_usage"] and sum(m["exit_usage"]) > 0
        assert m["mean_accepted_tokens"] <= m["gamma"] + 1
        if costs is not None:
            assert m["predicted_speedup"] > 0
            assert m["measured_over_predicted"] == pytest.approx(
                m["speedup_vs_ar"] / m["predicted_speedup"])
    if costs is None:  # a machine too loaded to time a round: said so, the runs still count
        assert any("predicted speedups omitted" in n for n in rep["notes"])
        assert res["s2d-0.5"]["predicted_speedup"] is None
        return
    assert set(costs) == {"loop"}  # one cost mechanism: the in-loop probes
    # the prediction is theory.loop_speedup on exactly these numbers: in-loop round costs
    # per forced exit (one per exit, positive), the prefill, this run's rounds and usage
    m = res["s2d-0.5"]
    loop = costs["loop"]["0.0"]
    assert set(loop) == {"ar", "s2d-0.5", "s2d-cal"}
    assert len(loop["s2d-0.5"]["round_s"]) == 2 and min(loop["s2d-0.5"]["round_s"]) > 0
    assert loop["s2d-0.5"]["prefill_s"] > 0
    # AR's side from its own probe, at the generation's buffer length
    assert loop["ar"]["max_len"] == loop["s2d-0.5"]["max_len"] and loop["ar"]["rounds"] >= 2
    # the probes were sampled once after each prompt, side by side with the runs
    assert loop["ar"]["trials"] == loop["s2d-0.5"]["trials"] == 2
    exp = theory.loop_speedup(loop["ar"]["round_s"][0], loop["ar"]["prefill_s"],
                              loop["s2d-0.5"]["round_s"], m["exit_usage"],
                              loop["s2d-0.5"]["prefill_s"], prompts=2, tokens=m["new_tokens"],
                              rounds=m["rounds"], prefill_total_s=m["prefill_seconds"],
                              ar_prefill_total_s=res["ar"]["prefill_seconds"]
                              )["predicted_speedup"]
    assert m["predicted_speedup"] == pytest.approx(exp)


def test_costs_too_noisy_to_time_leave_the_runs_and_a_note():
    """Under load a round probe can time nothing (LoopProbe.result refuses): the benchmark
    keeps its measured runs and omits only the predictions, saying so."""
    from s2d_jax.bench.target_bench import measured_costs as _measured_costs
    from s2d_jax.errors import S2DError

    class Untimed:
        def result(self):
            raise S2DError("the round probe measured no time: the machine was too noisy")

    notes, logged = [], []
    assert _measured_costs({"0.0": {"ar": Untimed()}}, "t", logged.append, notes) is None
    assert notes == logged and "predicted speedups omitted" in notes[0] and "noisy" in notes[0]
    entry = {"rounds": 4, "exit_usage": [1, 1], "draft_steps_per_round": 2.0, "gamma": 2,
             "new_tokens": 8, "speedup_vs_ar": 1.2}
    assert bench.predict(entry, None, "s2d-0.5")["predicted_speedup"] is None


def test_method_specs_expand_and_skip():
    specs, notes = bench.method_specs(["ar", "sd", "self", "s2d", "s2d-cal"], (2, 3, 4), 4,
                                      5, None)
    assert [s.label for s in specs] == ["ar", "sd@2", "sd@3", "sd@4", "self@4", "s2d-0.5"]
    assert specs[-1].thresholds == (0.5, 0.5, 0.0) and specs[-1].gamma == 5
    assert len(notes) == 1 and "s2d-cal skipped" in notes[0]


def test_s2d_setting_parses_and_refuses():
    spec = bench.parse_s2d_setting("2,4:0.3,0:1", (2, 4, 6, 8))
    assert spec == bench.MethodSpec("s2d_e2-4_t0.3-0_g1", "s2d", (2, 4), (0.3, 0.0), 1)
    for bad in ("2,4:0.3:1", "2,5:0.3,0:1", "4,2:0.3,0:1", "2,4:0.3,0:0", "2,4:1.5,0:1",
                "2,4", "a:b:c"):
        with pytest.raises(S2DError, match="--s2d-setting"):
            bench.parse_s2d_setting(bad, (2, 4, 6, 8))


def test_escalation_check_needs_two_exits_in_use_and_the_paired_ratio():
    from s2d_jax.bench.report import escalation_checks
    sd = {"method": "sd", "per_prompt_tokens_per_second": [10.0, 20.0, 30.0]}
    multi = {"method": "s2d", "exit_usage": [5, 3], "exit_usage_fraction": [0.625, 0.375],
             "per_prompt_tokens_per_second": [10.8, 21.6, 32.4]}
    one = {**multi, "exit_usage": [8, 0]}  # escalation never used: not S2D's claim
    slow = {**multi, "per_prompt_tokens_per_second": [10.2, 20.4, 30.6]}
    checks = escalation_checks("t", {"sd@2": sd, "a": multi, "b": one, "c": slow}, "sd@2")
    assert [c["check"].split(":")[0] for c in checks] == ["t a", "t c"]
    assert checks[0]["pass"] and "1.080" in checks[0]["value"]
    assert not checks[1]["pass"] and "0.62/0.38" in checks[1]["value"]


def _error(capsys, argv):
    return cli_error(main, capsys, argv)


def test_bench_bad_input_is_one_line_exit_2(family, capsys, tmp_path):
    base = ["--target", f"t={family / 'target'}", "--draft", str(family / "draft"),
            "--questions", str(family / "q.jsonl"), "--out", str(tmp_path / "o")]
    assert "does not exist" in _error(capsys, ["--target", f"t={tmp_path / 'nope'}"] + base[2:])
    assert "does not exist" in _error(capsys, base[:4] + ["--questions", str(tmp_path / "x")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": []}\n')
    assert "turns" in _error(capsys, base[:4] + ["--questions", str(bad)])
    assert "unknown method" in _error(capsys, base + ["--methods", "ar,medusa"])
    assert "category" in _error(capsys, base + ["--categories", "poetry"])
    assert "need --draft" in _error(capsys, base[:2] + base[4:] + ["--methods", "ar,sd"])
    assert "--s2d-setting" in _error(capsys, base + ["--methods", "ar", "--s2d-setting", "2,4:0.3:1"])
    assert not (tmp_path / "o").exists()


def test_bench_subprocess_error_exit_code(tmp_path):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "infer.bench", "--target",
                           f"x={tmp_path / 'missing'}", "--methods", "ar"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: model dir {tmp_path / 'missing'} (x) does not exist; pass an HF model dir "
        f"or a .gguf file"]


def test_calibrated_vs_sd_check_identity_and_strict_cases():
    from s2d_jax.bench.report import calibrated_vs_sd, paired_ratio

    def row(speed, exits, gamma, th, per_prompt):
        return {"speedup_vs_ar": speed, "exits": exits, "gamma": gamma, "thresholds": th,
                "per_prompt_tokens_per_second": per_prompt}

    sd = row(2.36, [1], 4, [0.0], [100.0, 200.0, 300.0])
    # the very setting of sd@1, measured 3% slower: equal by identity (noise), ratio shown
    same = row(2.30, [1], 4, [0.0], [95.0, 196.0, 291.0])
    c = calibrated_vs_sd("l", same, sd, "sd@1")
    assert c["pass"] and "the same program" in c["value"] and "2.30x vs 2.36x" in c["value"]
    mean, se = paired_ratio(same, sd)
    assert mean == pytest.approx((0.95 + 0.98 + 0.97) / 3) and se > 0
    # another gamma or a multi-exit setting is held to the measured numbers
    stopped = {**same, "stop_threshold": 0.3}  # a draft stop is another program
    for other in (row(2.30, [1], 5, [0.0], [1.0, 1.0]), row(2.30, [1, 2], 4, [0.5, 0.0], []),
                  stopped):
        c = calibrated_vs_sd("l", other, sd, "sd@1")
        assert not c["pass"] and "same program" not in c["value"]
    assert calibrated_vs_sd("l", row(2.40, [1], 5, [0.0], []), sd, "sd@1")["pass"]
    assert paired_ratio(row(1, [1], 4, [0.0], [1.0]), sd) is None  # one prompt: no spread


def test_run_target_repeats_are_passes_and_medians():
    class Stub:
        """Records calls; its k-th call takes `times[k]` seconds (3 prompts, 2 methods)."""
        calls = []

        def __init__(self, name, times):
            self.name, self.times = name, list(times)

        def generate(self, prompts, temperature, seed=0, **kw):
            Stub.calls.append((self.name, prompts[0][0]))
            secs = self.times.pop(0)
            return [{"token_ids": [prompts[0][0]] * 4,
                     "stats": {"batch_seconds": secs, "compile_seconds": 0.5}}]

    # calls per method: warm-up, then prompts 0,1,2 of pass 1, then of pass 2, then pass 3
    a = Stub("a", [9, 1, 2, 3, 1.5, 20, 3.5, 1.2, 2.5, 30])
    b = Stub("b", [9, 5, 6, 7, 5, 6, 7, 5, 6, 7])
    probes = []
    out = bench.run_target({"a": a, "b": b}, [[10], [11], [12]], temperatures=[0.0],
                           max_new_tokens=4, max_len=16, eos_id=-1, repeats=3,
                           between=lambda: probes.append(len(Stub.calls)))
    seq = [p for _, p in Stub.calls[2:]]
    assert seq == [10, 10, 11, 11, 12, 12] * 3  # whole passes over the prompts
    assert len(probes) == 9  # after every prompt of every pass
    # a's slow spells (20 s, 30 s) hit one pass each and the median drops them
    assert [r["seconds"] for r in out["runs"][0.0]["a"]] == [1.2, 2.5, 3.5]
    assert [r["seconds"] for r in out["runs"][0.0]["b"]] == [5, 6, 7]
    assert out["compile_seconds"] == {"a": 0.5, "b": 0.5}


def test_predict_with_a_draft_stop_uses_the_rounds_of_the_steps_run():
    """A dynamic draft length runs beta < gamma draft steps per round: the prediction
    interpolates between the rounds timed with gamma steps and with one."""
    loop = {"0.0": {"ar": {"round_s": [1.0], "prefill_s": 0.0},
                    "s2d-cal": {"round_s": [2.0], "one_step_round_s": [1.2],
                                "prefill_s": 0.0}}}
    entry = {"rounds": 10, "new_tokens": 30, "exit_usage": [25], "gamma": 4,
             "draft_steps_per_round": 2.5, "speedup_vs_ar": 1.5}
    got = bench.predict(entry, {"loop": loop}, "s2d-cal", "0.0", prompts=1)
    round_s = 1.2 + (2.5 - 1) / 3 * (2.0 - 1.2)
    assert got["predicted_round_s"] == pytest.approx(round_s)
    assert got["predicted_speedup"] == pytest.approx(30 * 1.0 / (10 * round_s))
    del loop["0.0"]["s2d-cal"]["one_step_round_s"]  # no stop: the full rounds
    assert bench.predict(entry, {"loop": loop}, "s2d-cal", "0.0")[
        "predicted_round_s"] == pytest.approx(2.0)
    # no AR probe (ar not benchmarked) or no round run: no prediction, not a guess
    assert bench.predict(entry, {"loop": {"0.0": {"s2d-cal": loop["0.0"]["s2d-cal"]}}},
                         "s2d-cal", "0.0")["predicted_speedup"] is None
    assert bench.predict({**entry, "rounds": 0}, {"loop": loop}, "s2d-cal", "0.0")[
        "predicted_speedup"] is None


def test_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    import sys

    from s2d_jax.bench import report
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert report.plot({"targets": {}}, str(tmp_path / "p.png")) is False
    assert not (tmp_path / "p.png").exists() and "[bench]" in report.PLOT_EXTRA


def test_hf_baseline_without_torch_is_a_one_line_error(family, capsys, monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    err = _error(capsys, ["--target", f"t={family / 'target'}", "--methods", "ar",
                          "--questions", str(family / "q.jsonl"), "--hf-baseline",
                          "--out", str(tmp_path / "o")])
    assert "torch" in err and "pip install -e '.[bench]'" in err


@pytest.mark.parametrize("ours,passes", [(52.0, True), (50.0, False)])
def test_hf_assisted_check_asks_three_times_its_speed(ours, passes):
    from s2d_jax.bench.report import acceptance_checks

    s2d = {"method": "s2d", "speedup_vs_ar": 1.2, "tokens_per_second": ours,
           "measured_over_predicted": 1.0, "exact_match_vs_ar": 1.0, "exit_usage": [8]}
    report = {"targets": {"t": {"num_params": 1, "results": {"0.0": {"s2d-0.5": s2d}},
                                "hf_baseline": {"assisted": {"tokens_per_second": 17.0}}}}}
    [check] = [c for c in acceptance_checks(report) if "HF assisted" in c["check"]]
    assert ">= 3x" in check["check"] and check["pass"] is passes
