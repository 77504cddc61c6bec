"""Threshold calibration: the round replay by hand, the serving config, and the CLI."""

import json
import os

import jax
import numpy as np
import pytest

from infer.calibrate import main
from s2d_jax.calibration import calibrate
from s2d_jax.decode import serving_config
from s2d_jax.config import ModelConfig
from s2d_jax.errors import S2DError
from s2d_jax.io.hf import export_hf
from s2d_jax.model import transformer as model
from tiny_models import cli_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "assets", "llama2_tokenizer")


def _stats():
    # 6 positions, 2 exits. exit 0 is right at positions 0, 1, 3; exit 1 everywhere but 4.
    correct = np.array([[1, 1], [1, 1], [0, 1], [1, 1], [0, 0], [1, 1]], bool)
    conf = np.array([[0.9, 0.5], [0.8, 0.5], [0.3, 0.5], [0.7, 0.5], [0.9, 0.5],
                     [0.2, 0.5]], np.float32)
    return calibrate.ExitStats((2, 4), [correct], [conf])


def test_simulate_replays_rounds_by_hand():
    st = _stats()
    # 6 drafted positions: the trajectory's tokens 1..6 (token 0 is the prefill's), so the
    # rounds add exactly 6 tokens; the last round is cut where the trajectory ends.
    # threshold 0.5 at exit 0: exits used 0,0,1,0,0,1; ok = T,T,T,T,F,T.
    # gamma 2: round@0 drafts 0,1 both ok -> +3 (k=3); round@3 drafts 3,4: 3 ok, 4 bad
    # -> +2 (k=5); round@5 drafts 5 only (end) ok -> +1 (the bonus is past the end).
    # MAT = 6/3, usage [4, 1] (drafted 0,1,3,4 at exit 0; 5 at exit 1; 2 was the target's).
    sim = calibrate.simulate(st, [0.5, 0.0], 2)
    assert sim["mean_accepted_tokens"] == pytest.approx(2.0)
    assert sim["rounds"] == 3 and sim["tokens"] == 6
    assert sim["exit_usage"] == [4, 1]
    assert sim["draft_steps_per_round"] == pytest.approx(5 / 3)
    # threshold 1 = never stop at exit 0: exit 1 everywhere, ok except position 4.
    # gamma 3: round@0 drafts 0,1,2 all ok -> +4 (k=4); round@4 drafts 4,5: 4 bad -> +1
    # (k=5); round@5 drafts 5 ok -> +1. MAT 6/3, usage [0, 6].
    sim = calibrate.simulate(st, [1.0, 0.0], 3)
    assert sim["mean_accepted_tokens"] == pytest.approx(2.0)
    assert sim["exit_usage"] == [0, 6]


def test_simulate_with_a_draft_stop_by_hand():
    st = _stats()
    # threshold 0.5 at exit 0: exits 0,0,1,0,0,1 with kept confidence .9,.8,.5,.7,.9,.5 and
    # ok = T,T,T,T,F,T. Draft stop 0.6 (drafting ends after a token below it), gamma 3:
    # round@0 drafts 0 (.9), 1 (.8), 2 (.5): all ok -> +4 (k=4); round@4 drafts 4 (.9),
    # 5 (.5, then the window ends): 4 bad -> +1 (k=5); round@5 drafts 5 ok -> +1.
    sim = calibrate.simulate(st, [0.5, 0.0], 3, stop=0.6)
    assert sim["mean_accepted_tokens"] == pytest.approx(2.0)
    # drafted: 0, 1, 2 | 4, 5 | 5 at exits 0, 0, 1 | 0, 1 | 1
    assert sim["exit_usage"] == [3, 3] and sim["draft_steps_per_round"] == pytest.approx(2)
    # stop 0.85: round@0 drafts 0 (.9), 1 (.8 < .85: last) -> both ok,
    # +3 (k=3); round@3 drafts 3 (.7: last) ok -> +2 (k=5); round@5 drafts 5 -> +1:
    # drafted 0, 1 | 3 | 5 at exits 0, 0 | 0 | 1.
    sim = calibrate.simulate(st, [0.5, 0.0], 3, stop=0.85)
    assert sim["mean_accepted_tokens"] == pytest.approx(2.0)
    assert sim["exit_usage"] == [3, 1] and sim["draft_steps_per_round"] == pytest.approx(4 / 3)
    # stop 0 never stops: the plain replay
    assert calibrate.simulate(st, [0.5, 0.0], 3, stop=0.0) == calibrate.simulate(
        st, [0.5, 0.0], 3)


def test_pick_stop_prefers_no_stop_on_ties():
    rows = [{"stop_threshold": 0.0, "measured_speedup": 1.3},
            {"stop_threshold": 0.3, "measured_speedup": 1.3},
            {"stop_threshold": 0.5, "measured_speedup": 1.2}]
    assert calibrate.pick_stop(rows)["stop_threshold"] == 0.0
    rows[2]["measured_speedup"] = 1.4
    assert calibrate.pick_stop(rows)["stop_threshold"] == 0.5
    # a stop must beat no stop by the factor 1 + min_gain, as escalation must
    assert calibrate.pick_stop(rows, min_gain=0.1)["stop_threshold"] == 0.0
    assert calibrate.pick_stop(rows, min_gain=0.07)["stop_threshold"] == 0.5


def _loop(prefill, verify, steps, gamma):
    """A LoopProbe result: a round forced to exit j = gamma draft steps at steps[j] + verify."""
    return {"prefill_s": prefill, "round_s": [verify + gamma * c for c in steps]}


def test_rank_configs_prefers_the_cheaper_exit_when_it_is_as_good():
    correct = np.ones((40, 2), bool)
    conf = np.full((40, 2), 0.9, np.float32)
    st = calibrate.ExitStats((2, 4), [correct], [conf])
    assert calibrate.exit_subsets((2, 4)) == [(4,), (2,), (2, 4)]
    verify, steps = {2: 1.2, 4: 1.4}, {(2, 4): [0.05, 0.2], (2,): [0.04], (4,): [0.15]}
    costs = {"ar": {"prefill_s": 2.0, "round_s": [1.0]},
             "settings": {calibrate.setting_key(e, g): _loop(2.5, verify[g], c, g)
                          for e, c in steps.items() for g in (2, 4)}}
    ranked = calibrate.rank_configs(st, costs, values=[0.5, 1.0])
    assert len(ranked) == 2 * (2 + 1 + 1)
    best = ranked[0]
    # exit 2 alone is always right and cheapest: vanilla SD at exit 2 with gamma 4 wins
    assert best["exits"] == [2] and best["thresholds"] == [0.0] and best["gamma"] == 4
    assert best["rounds"] == 8 and best["mean_accepted_tokens"] == 5  # 40 tokens, 5 a round
    # the benchmark's formula: (P_AR + 41 R_AR) / (P + 8 rounds x (1.4 + 4 x 0.04))
    assert best["predicted_speedup"] == pytest.approx((2.0 + 41 * 1.0) / (2.5 + 8 * 1.56))
    s2d = next(r for r in ranked if r["exits"] == [2, 4])
    assert s2d["thresholds"] == [0.5, 0.0] and s2d["exit_usage"][1] == 0
    assert ranked[-1]["predicted_speedup"] < s2d["predicted_speedup"] < best["predicted_speedup"]
    sub = st.select((4,))
    assert sub.exits == (4,) and sub.correct[0].shape == (40, 1)
    with pytest.raises(S2DError, match="one-step round costs"):
        calibrate.predict_config(st, costs, [0.0], 4, (2,), stop=0.5)
    with pytest.raises(S2DError, match="no round costs measured"):
        calibrate.predict_config(st, costs, [0.0], 3, (2,))


def test_the_oracle_ceiling_at_measured_costs_by_hand():
    """An oracle drafting each token at the shallowest right exit, priced by the whole set's
    probe, over the fastest single exit: above 1 where the exits are right on different
    tokens, below 1 where one exit is always right (the escalating decoder's checks cost)."""
    verify, steps = 1.2, {(2,): [0.1], (4,): [0.3], (2, 4): [0.12, 0.35]}
    costs = {"ar": {"prefill_s": 2.0, "round_s": [1.0]},
             "settings": {calibrate.setting_key(e, 1): _loop(2.5, verify, c, 1)
                          for e, c in steps.items()}}
    # gamma 1, 6 drafted positions, T_AR = 2 + 7 x 1 = 9. Exit 2 ok at T,T,F,T,T,F: rounds
    # +2,+1,+2,+1 = 4 (1.3 each); exit 4 ok at F,F,T,F,F,T: 5 rounds (1.5 each). The oracle
    # is right everywhere: 3 rounds drafting 0, 2, 4 at exits 2, 4, 2 (1.32, 1.55, 1.32).
    e2 = np.array([1, 1, 0, 1, 1, 0], bool)
    st = calibrate.ExitStats((2, 4), [np.stack([e2, ~e2], 1)], [np.full((6, 2), 0.5)])
    assert [x.tolist() for x in calibrate.oracle_exits(st)] == [[0, 0, 1, 0, 0, 1]]
    out = calibrate.oracle_ceiling(st, costs)
    assert out["best_single"]["exits"] == [2]
    assert out["best_single"]["predicted_speedup"] == pytest.approx(9 / (2.5 + 4 * 1.3))
    (oracle,) = out["oracle"]
    assert oracle["exit_usage"] == [2, 1] and oracle["mean_accepted_tokens"] == 2
    assert oracle["predicted_speedup"] == pytest.approx(9 / (2.5 + 3 * (2 * 1.32 + 1.55) / 3))
    assert out["ceiling_over_best_single"] == pytest.approx(
        (2.5 + 4 * 1.3) / (2.5 + 2 * 1.32 + 1.55))
    # exit 4 always right, exit 2 never: the oracle is exit 4 with the checks' price
    st = calibrate.ExitStats((2, 4), [np.stack([np.zeros(4, bool), np.ones(4, bool)], 1)],
                             [np.full((4, 2), 0.5)])
    out = calibrate.oracle_ceiling(st, costs)
    assert out["best_single"]["exits"] == [4]
    assert out["ceiling_over_best_single"] == pytest.approx((2.5 + 2 * 1.5) / (2.5 + 2 * 1.55))
    assert out["ceiling_over_best_single"] < 1
    # no whole-set probe, or a single exit: nothing to bound
    assert calibrate.oracle_ceiling(st, {**costs, "settings": {
        k: v for k, v in costs["settings"].items() if "," not in k}}) is None
    assert calibrate.oracle_ceiling(st.select((4,)), costs) is None


def test_accuracy_by_confidence_by_hand():
    # exit 1: confident tokens 0 and 1 (one right); exit 2: only token 3, right
    correct = np.array([[True, False], [False, False], [True, True], [False, True]])
    conf = np.array([[0.95, 0.1], [0.6, 0.2], [0.2, 0.4], [0.1, 0.8]])
    got = calibrate.accuracy_by_confidence((1, 2), correct, conf, levels=(0.5, 0.9))
    assert got["1"]["0.5"] == {"share": 0.5, "accuracy": 0.5}
    assert got["1"]["0.9"] == {"share": 0.25, "accuracy": 1.0}
    assert got["2"]["0.5"] == {"share": 0.25, "accuracy": 1.0}
    assert got["2"]["0.9"] == {"share": 0.0, "accuracy": None}


def test_serving_config_roundtrip_and_refusals(tmp_path):
    assert serving_config.load_serving_config(str(tmp_path)) is None
    serving_config.write_serving_config(str(tmp_path), {"thresholds": [0.4, 0.0], "gamma": 3})
    assert serving_config.load_serving_config(str(tmp_path))["thresholds"] == [0.4, 0.0]
    assert [p.name for p in tmp_path.iterdir()] == [serving_config.SERVING_CONFIG]  # no temp left
    assert serving_config.load_serving_config(str(tmp_path))["stop_threshold"] == 0.0  # default
    (tmp_path / serving_config.SERVING_CONFIG).write_text('{"thresholds": [2.0], "gamma": 3}')
    with pytest.raises(S2DError, match=r"thresholds(\[0\])? must lie in \[0, 1\]"):
        serving_config.load_serving_config(str(tmp_path))
    (tmp_path / serving_config.SERVING_CONFIG).write_text(
        '{"thresholds": [0.0], "gamma": 3, "stop_threshold": 1.5}')
    with pytest.raises(S2DError, match=r"stop threshold must lie in \[0, 1\]"):
        serving_config.load_serving_config(str(tmp_path))
    (tmp_path / serving_config.SERVING_CONFIG).write_text("not json")
    with pytest.raises(S2DError, match="not a valid serving config"):
        serving_config.load_serving_config(str(tmp_path))


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("cal")
    cfg = ModelConfig(vocab_size=32000, hidden_size=16, intermediate_size=32, num_layers=3,
                      num_heads=2, num_kv_heads=1, max_position_embeddings=128)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: np.ones(x.shape, np.float32) if "norm" in jax.tree_util.keystr(p)
        else (0.5 * rng.standard_normal(x.shape)).astype(np.float32), model.abstract_params(cfg))
    export_hf(params, cfg, str(root / "target"), tokenizer_dir=TOKENIZER)
    dcfg = ModelConfig(**{**cfg.__dict__, "num_layers": 2})
    export_hf(dict(params, layers=jax.tree.map(lambda x: x[:2], params["layers"])), dcfg,
              str(root / "draft"), extra={"s2d_exits": [1, 2]}, tokenizer_dir=TOKENIZER)
    export_hf(dict(params, layers=jax.tree.map(lambda x: x[:2], params["layers"])), dcfg,
              str(root / "single"), tokenizer_dir=TOKENIZER)
    (root / "q.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "c", "turns": [t]}) + "\n"
        for i, t in enumerate(["What is 2+2?", "Say hi."])))
    return root


@pytest.mark.slow  # ~45 s on the shared 2-core machine: a dozen engine compilations
def test_calibrate_cli_writes_a_valid_config(family, capsys):
    rc = main(["--target", f"t={family / 'target'}", "--draft", str(family / "draft"),
               "--questions", str(family / "q.jsonl"), "--max-new-tokens", "8",
               "--gammas", "2", "--check", "1", "--stops", "0.5", "--probe-rounds", "8",
               "--cost-every", "2", "--report", str(family / "cal.json")])
    assert rc == 0
    cfg = serving_config.load_serving_config(str(family / "target"))
    rep = json.loads((family / "cal.json").read_text())
    # every measured setting with its prediction from its own probe and the run's prefills
    assert {r["label"] for r in rep["measured"]} >= {"paper"}
    assert all(r["predicted_speedup"] > 0 and r["measured_speedup"] > 0
               for r in rep["measured"])
    assert {r["gamma"] for r in rep["best_predicted_per_setting"]} == {2}
    assert set(rep["exit_accuracy"]) == {"1", "2"}
    assert all(0.0 <= a <= 1.0 for a in rep["exit_accuracy"].values())
    by_conf = rep["exit_accuracy_by_confidence"]
    assert set(by_conf) == {"1", "2"}
    for levels in by_conf.values():  # a higher confidence bar keeps fewer tokens
        shares = [levels[t]["share"] for t in ("0.3", "0.5", "0.7", "0.9")]
        assert all(a >= b for a, b in zip(shares, shares[1:])) and 0.0 <= shares[0] <= 1.0
    assert rep["costs"]["settings"]["1,2@2"]["rounds"] == 8  # --probe-rounds
    ceiling = rep["oracle_ceiling"]  # the whole set's probe at gamma 2, both single exits
    assert [r["gamma"] for r in ceiling["oracle"]] == [2]
    assert ceiling["best_single"]["exits"] in ([1], [2]) and ceiling["ceiling_over_best_single"] > 0
    assert cfg["thresholds"][-1] == 0.0 and cfg["gamma"] == 2
    assert cfg["stop_threshold"] in (0.0, 0.5)
    cap = capsys.readouterr()
    assert "draft stop 0.5:" in cap.err and "x the speedup of 0.5" in cap.out
    assert "x the fastest single exit" in cap.err
    assert set(cfg["exits"]) <= {1, 2} and len(cfg["thresholds"]) == len(cfg["exits"])
    assert cfg["measured_speedup"] > 0
    assert cfg["paper_thresholds_measured_speedup"] > 0
    assert cfg["calibrated_on"]["prompts"] == 2
    # paths relative to the target dir, where the config lives
    assert cfg["draft"] == os.path.join("..", "draft")
    assert cfg["calibrated_on"]["questions"] == os.path.join("..", "q.jsonl")
    # and the methods ranked side by side: the choice --method auto decodes with
    ranked = {r["label"] for r in cfg["default"]["ranking"]}
    assert {"ar", "sd@1", "sd@2", "lookup", "ladder"} <= ranked and "auto decodes with" in cap.out


def _error(capsys, argv):
    return cli_error(main, capsys, argv)


def test_calibrate_bad_input_is_one_line_exit_2(family, capsys, tmp_path):
    # an explicit template: auto would note its fallback (no template) on stderr first
    base = ["--target", str(family / "target"), "--questions", str(family / "q.jsonl"),
            "--chat-template", "none"]
    assert "does not exist" in _error(capsys, base + ["--draft", str(tmp_path / "nope")])
    assert "gammas" in _error(capsys, base + ["--draft", str(family / "draft"), "--gammas", "0"])
    assert "single exit" in _error(capsys, base + ["--draft", str(family / "single")])
    assert "--repeats" in _error(capsys, base + ["--draft", str(family / "draft"),
                                                 "--repeats", "0"])
    assert "--finalists" in _error(capsys, base + ["--draft", str(family / "draft"),
                                                   "--finalists", "0"])
    assert "--min-gain" in _error(capsys, base + ["--draft", str(family / "draft"),
                                                  "--min-gain", "-0.1"])
    for bad in ("1.5", "0.2,x", "0"):
        assert "--stops" in _error(capsys, base + ["--draft", str(family / "draft"),
                                                   "--stops", bad])
    assert "does not exist" in _error(capsys, ["--target", str(family / "target"), "--draft",
                                               str(family / "draft"), "--questions",
                                               str(tmp_path / "q.jsonl")])


def _setting(label, exits, speed, gamma=4):
    return {"label": label, "exits": exits, "measured_speedup": speed, "gamma": gamma}


def test_finalists_add_the_fastest_single_exit():
    rows = [_setting("a", [1, 2], 2.3), _setting("b", [1, 3], 2.2), _setting("c", [1], 2.1),
            _setting("d", [2], 2.15), _setting("e", [1, 2, 3], 2.0)]
    assert [r["label"] for r in calibrate.finalists(rows, 2)] == ["a", "b", "d"]
    assert [r["label"] for r in calibrate.finalists(rows, 3)] == ["a", "b", "d"]
    assert [r["label"] for r in calibrate.finalists(rows[:2], 1)] == ["a"]  # no single exit


def test_pick_setting_keeps_escalation_only_when_it_pays():
    single, multi = _setting("sd", [1], 2.00), _setting("s2d", [1, 2], 2.05)
    assert calibrate.pick_setting([single, multi], 0.03) is single  # 2.5% < 3%: noise
    assert calibrate.pick_setting([single, multi], 0.02) is multi
    assert calibrate.pick_setting([_setting("s2d", [1, 2], 2.3), single], 0.03)["label"] == "s2d"
    faster_single = _setting("sd2", [2], 2.1)
    assert calibrate.pick_setting([single, multi, faster_single], 0.0) is faster_single
    assert calibrate.pick_setting([multi], 0.5) is multi  # nothing to fall back to


def test_pick_setting_keeps_the_default_gamma_within_noise():
    g4, g5, g6 = (_setting(f"g{g}", [1], s, g) for g, s in ((4, 1.88), (5, 1.89), (6, 1.86)))
    assert calibrate.pick_setting([g6, g5, g4], 0.03) is g4  # all within 3% of 1.89x
    assert calibrate.pick_setting([g6, g5, g4], 0.0) is g5  # no margin: the fastest
    assert calibrate.pick_setting([g6, g5], 0.03) is g5  # nearest the default gamma
    g3 = _setting("g3", [1], 1.89, 3)
    assert calibrate.pick_setting([g6, g5, g3], 0.03) is g3  # a tie in distance: smaller
    assert calibrate.pick_setting([g6, g5, g3], 0.03, default_gamma=6) is g6
    slow4 = _setting("g4", [1], 1.80, 4)  # 5% slower: out of the margin
    assert calibrate.pick_setting([slow4, g5, g6], 0.03) is g5
    multi = _setting("m3", [1, 2], 1.95, 3)  # 3.2% faster than g5: escalation pays
    assert calibrate.pick_setting([g4, g5, multi], 0.03) is multi


def _engine_vs_simulator(gamma, settings):
    """(engine, simulator) per prompt and setting: rounds, MAT and exit usage."""
    from s2d_jax.decode.serving import Decoder
    from test_engine import CFG, NEW, PROMPTS, draft, target_params

    dcfg, dparams = draft()
    exits = (1, 2, 3)
    ar = Decoder(CFG, target_params(), method="ar").generate(PROMPTS, max_new_tokens=NEW,
                                                             eos_id=-1)
    conts = [o["token_ids"] for o in ar]
    stats = calibrate.exit_stats(dcfg, dparams, exits, PROMPTS, conts, 48)
    dec = Decoder(CFG, target_params(), method="s2d", draft_cfg=dcfg, draft_params=dparams,
                  exits=exits, gamma=gamma, kv_fill="full")  # exact draft keys/values
    out = []
    for th, stop in settings:
        runs = dec.generate(PROMPTS, thresholds=th, stop_threshold=stop, max_new_tokens=NEW,
                            eos_id=-1)
        for i, (run, cont) in enumerate(zip(runs, conts)):
            assert run["token_ids"] == cont  # greedy S2D is the target's own output
            sim = calibrate.simulate(calibrate.ExitStats(exits, stats.correct[i:i + 1],
                                                         stats.conf[i:i + 1]), th, gamma, stop)
            s = run["stats"]
            out.append(((s["rounds"], s["mean_accepted_tokens"], s["exit_usage"]),
                        (sim["rounds"], sim["mean_accepted_tokens"], sim["exit_usage"])))
    return out


@pytest.mark.slow
def test_simulator_predicts_the_engines_greedy_rounds():
    """calibrate.simulate on the draft's pass over AR trajectories = the engine's measured
    greedy rounds and MAT with exact draft keys/values (kv_fill="full"), per prompt, for
    escalating thresholds with and without a draft stop; with gamma 1 (every drafted
    token's input is the target's) the exit usage too."""
    settings = [([0.3, 0.3, 0.0], 0.0), ([0.6, 0.2, 0.0], 0.0), ([1.0, 0.5, 0.0], 0.0),
                ([0.3, 0.3, 0.0], 0.5)]
    pairs = _engine_vs_simulator(3, settings)
    for (rounds, mat, _), (sim_rounds, sim_mat, _) in pairs:
        assert rounds == sim_rounds and mat == pytest.approx(sim_mat)
    mats = [p[0][1] for p in pairs]
    assert max(mats) > 1.5 and min(mats) < max(mats)  # acceptance is partial, not trivial
    one = _engine_vs_simulator(1, settings[:3])
    for (rounds, _, usage), (sim_rounds, _, sim_usage) in one:
        assert rounds == sim_rounds and usage == sim_usage
    used = np.sum([p[0][2] for p in one], axis=0)
    assert np.count_nonzero(used) >= 2  # the thresholds really escalate


def test_derive_subset_costs_from_single_exits_and_the_whole_set():
    # rounds forced to exit e of the whole set (1, 2, 3) check every exit below e: each
    # check costs (whole at 3 - exit 3 alone) / 2 = (10 - 8) / 2 = 1 per round
    probed = {"1@2": {"prefill_s": 0.5, "round_s": [4.0]},
              "2@2": {"prefill_s": 0.6, "round_s": [6.0]},
              "3@2": {"prefill_s": 0.7, "round_s": [8.0]},
              "1,2,3@2": {"prefill_s": 0.7, "round_s": [4.0, 7.0, 10.0]}}
    out = calibrate.derive_subset_costs(probed, (1, 2, 3), [2])
    assert set(out) == {calibrate.setting_key(s, 2) for s in calibrate.exit_subsets((1, 2, 3))}
    for key, v in probed.items():  # probed settings keep their own costs
        assert out[key] == v
    assert out["1,3@2"]["round_s"] == [4.0, 9.0]  # exit 2's check is skipped
    assert out["2,3@2"]["round_s"] == [6.0, 9.0]  # at 2: 7 - 1, never below exit 2 alone
    assert out["1,2@2"]["round_s"] == [4.0, 7.0]
    # the draft's prefill runs up to the subset's deepest exit
    assert out["1,2@2"]["prefill_s"] == 0.6 and out["1,2@2"]["derived"]
    assert calibrate.probed_subsets((1, 2, 3)) == [(1,), (2,), (3,), (1, 2, 3)]


def test_exit_stats_do_not_depend_on_the_padded_width():
    """exit_stats pads each trajectory to a 64 bucket (at most `width`): causal attention
    leaves every prediction as it is at the tightest width."""
    from s2d_jax.decode.serving import Decoder
    from test_engine import CFG, NEW, PROMPTS, draft, target_params

    dcfg, dparams = draft()
    conts = [o["token_ids"] for o in Decoder(CFG, target_params(), method="ar").generate(
        PROMPTS, max_new_tokens=NEW, eos_id=-1)]
    tight = calibrate.exit_stats(dcfg, dparams, (1, 2, 3), PROMPTS, conts, 48)
    wide = calibrate.exit_stats(dcfg, dparams, (1, 2, 3), PROMPTS, conts, 512)
    for a, b in zip(tight.correct + tight.conf, wide.correct + wide.conf):
        np.testing.assert_allclose(a, b, atol=1e-5)
