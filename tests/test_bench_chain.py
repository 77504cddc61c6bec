"""Polybasic chains in the benchmark (s2d_jax/bench/chains.py, `infer.bench --chain`): chain
parsing, level statistics recovered from the per-row summaries, the Lemma 3.1 inputs and
insertion verdict on hand-computed numbers, the batch-4 and quantized-agreement checks with
stub decoders, bad --chain input, and (slow) the whole bench on tiny random models."""

import json

import numpy as np
import pytest

from infer.bench import main
from s2d_jax.bench import chains as bench_chain
from s2d_jax.bench import theory
from s2d_jax.bench.runner import MethodSpec
from s2d_jax.errors import S2DError
from tiny_models import cli_error


def test_parse_chain_forms_and_labels():
    c = bench_chain.parse_chain("l=int8", mu=3)
    assert (c.target, c.intermediate, c.quantize, c.mu, c.gamma) == ("l", "", "int8", 3, None)
    assert c.label == "chain-int8-mu3" and c.describe == "l int8"
    assert bench_chain.parse_chain("l=int8").label == "chain-int8"
    c = bench_chain.parse_chain("l=w8a8,gamma=1,mu=16", mu=3)  # the chain's own mu wins
    assert (c.quantize, c.gamma, c.mu, c.label) == ("w8a8", 1, 16, "chain-w8a8-g1-mu16")
    c = bench_chain.parse_chain("l=some/dir:int4,gamma=2")
    assert (c.intermediate, c.quantize, c.gamma, c.mu) == ("some/dir", "int4", 2, None)
    for bad in ("l=int8,gamma=0", "l=int8,mu=x", "l=int8,beta=2", "l=int8,gamma"):
        with pytest.raises(S2DError, match="gamma=G or mu=M"):
            bench_chain.parse_chain(bad)
    c = bench_chain.parse_chain("l=models/demo/target-m/")
    assert (c.intermediate, c.quantize, c.label) == ("models/demo/target-m/", None,
                                                     "chain-target-m")
    c = bench_chain.parse_chain("xl=some/dir:int4")
    assert (c.target, c.intermediate, c.quantize) == ("xl", "some/dir", "int4")
    assert c.label == "chain-dir-int4" and c.describe == "dir int4"
    assert bench_chain.parse_chain("l=C:/x").intermediate == "C:/x"  # not a quant suffix
    for bad in ("int8", "=int8", "l="):
        with pytest.raises(S2DError, match="NAME=MID"):
            bench_chain.parse_chain(bad)


def test_pick_baseline_prefers_calibrated():
    s05, cal = MethodSpec("s2d-0.5", "s2d", (1, 2)), MethodSpec("s2d-cal", "s2d", (2,))
    assert bench_chain.pick_baseline([MethodSpec("ar", "ar"), s05, cal]) is cal
    assert bench_chain.pick_baseline([s05]) is s05
    with pytest.raises(S2DError, match="include s2d"):
        bench_chain.pick_baseline([MethodSpec("ar", "ar")])


def test_chain_baseline_is_the_same_setting_at_the_chains_gamma():
    cal = MethodSpec("s2d-cal", "s2d", (1,), (0.0,), 4)
    same = bench_chain.parse_chain("l=int8,gamma=4")
    assert bench_chain.chain_baseline(same, cal) is cal
    assert bench_chain.chain_mu(same, cal) == 4
    c = bench_chain.parse_chain("l=int8,gamma=1")
    base = bench_chain.chain_baseline(c, cal)
    assert (base.label, base.method, base.exits, base.thresholds, base.gamma) == (
        "s2d-cal-g1", "s2d", (1,), (0.0,), 1)
    assert bench_chain.chain_mu(c, cal) == 1  # mu defaults to the chain's gamma
    spec = bench_chain.chain_method_spec(c, cal)
    assert (spec.label, spec.method, spec.gamma) == ("chain-int8-g1", "chain", 1)


def _row(mat, rounds, usage, rates, forwards, tokens=None):
    return {"token_ids": tokens or [], "stats": {
        "mean_accepted_tokens": mat, "rounds": rounds, "exit_usage": usage,
        "level_acceptance_rate": rates, "level_forwards": forwards}}


def test_level_counts_follow_the_chain_bookkeeping():
    # row 1: 8 drafted tokens, the intermediate accepts 4 in 6 calls and passes up 4 + 6 = 10,
    # the target accepts 8 of them in 4 rounds; row 2: 5 drafted, 5 accepted in 2 calls,
    # 7 passed up, target accepts 7 (rate 1) in 2 rounds.
    rows = [_row(2.5, 4, [3, 5], [0.5, 0.8], [6, 4]),
            _row(4.0, 2, [0, 5], [1.0, 1.0], [2, 2])]
    c = bench_chain.level_counts(rows)
    assert c["tokens"] == pytest.approx(10 + 8) and c["draft_steps"] == 13
    assert c["calls"] == [8, 6]
    assert c["proposed"] == [13, 17] and c["accepted"] == [9, 15]
    table = bench_chain._level_table(c, ["draft", "mid", "target"])
    assert [t["level"] for t in table] == ["mid", "target"]
    assert table[0]["verifies"] == "draft" and table[1]["verifies"] == "mid"
    assert table[0]["accept_length_per_call"] == pytest.approx((9 + 8) / 8)
    assert table[1]["tokens_per_call"] == pytest.approx(18 / 6)
    assert table[0]["acceptance_rate"] == pytest.approx(9 / 13)


def _res(tps, usage, mat=2.0):
    return {"tokens_per_second": tps, "exit_usage": usage, "seconds": 20 / tps,
            "new_tokens": 20, "speedup_vs_ar": tps / 50, "exact_match_vs_ar": 1.0,
            "mean_accepted_tokens": mat}


def test_chain_temperature_lemma_and_verdict_by_hand():
    # two-level: N = 20 in 10 rounds (L_1 = 2), 40 draft steps (beta 4), T_1 = 10, step 1:
    #   T/N = 10/2 + 4*1/2 = 7
    # chain: N = 20, target 5 calls (L_1' = 4), mid 10 calls (L_2' = 2), 40 steps (beta' 4),
    #   T_1' = 12, T_2' = 3: T'/N = 12/4 + 3/2 + 4*1/2 = 6.5 -> helps, gain 7/6.5
    base_rows = [_row(2.0, 10, [40], [0.25], [10])]
    chain_rows = [_row(4.0, 5, [40], [0.5, 0.6], [10, 5])]
    costs = {"target_ar": 5.0, "target_verify_2level": 10.0, "target_verify_chain": 12.0,
             "intermediate": 3.0, "draft_step_per_exit": [1.0]}
    e = bench_chain.chain_temperature(chain_rows, base_rows, _res(110, [40], 4.0),
                                      _res(100, [40]), costs, ["draft", "mid", "target"])
    ins = e["insertion"]
    assert ins["before"]["time_per_token_s"] == pytest.approx(7.0)
    assert ins["after"]["time_per_token_s"] == pytest.approx(6.5)
    assert ins["after"]["accept_lengths"] == pytest.approx([4.0, 2.0])
    assert ins["after"]["beta"] == pytest.approx(4.0)
    assert ins["predicted"] == "helps" and ins["predicted_gain"] == pytest.approx(7 / 6.5)
    assert ins["measured"] == "faster" and ins["agrees"] is True
    assert e["speedup_vs_2level"] == pytest.approx(1.1)
    assert e["predicted_speedup"] == pytest.approx(5.0 / 6.5)
    assert e["baseline_predicted_speedup"] == pytest.approx(5.0 / 7.0)
    assert e["measured_over_predicted"] == pytest.approx((110 / 50) / (5.0 / 6.5))
    # slower than the two-level run: the same prediction now disagrees
    e = bench_chain.chain_temperature(chain_rows, base_rows, _res(90, [40], 4.0),
                                      _res(100, [40]), costs, ["draft", "mid", "target"])
    assert e["insertion"]["measured"] == "slower" and e["insertion"]["agrees"] is False
    # the inputs stored for infer.insertion give the same answer through theory
    b, a = ins["before"], ins["after"]
    again = theory.insertion_gain(b["costs"], b["accept_lengths"], b["beta"], 1, a["costs"][1],
                                  a["accept_lengths"], a["beta"],
                                  new_costs=[a["costs"][0], a["costs"][2]])
    assert again["gain"] == pytest.approx(ins["predicted_gain"])


class StubDecoder:
    """Returns fixed outputs per prompt and records the batches it was given."""

    def __init__(self, outputs: dict):
        self.outputs, self.batches = outputs, []

    def generate(self, prompts, **kw):
        assert kw["temperature"] == 0.0
        self.batches.append([tuple(p) for p in prompts])
        return [{"token_ids": self.outputs[tuple(p)]} for p in prompts]


def test_batch_exact_groups_pads_and_compares():
    prompts = [[1], [2], [3], [4], [5]]
    ref = [[10], [20], [30], [40], [50]]
    outs = {(i,): [10 * i] for i in range(1, 6)}
    outs[(3,)] = [31]
    dec = StubDecoder(outs)
    r = bench_chain.batch_exact(dec, prompts, ref, batch=4, max_new_tokens=4)
    assert dec.batches == [[(1,), (2,), (3,), (4,)], [(5,)] * 4]
    assert r["exact_match_per_prompt"] == [True, True, False, True, True]
    assert r["exact_match_vs_ar"] == pytest.approx(0.8) and r["prompts"] == 5


def test_quantized_agreement_prefix_fractions():
    dec = StubDecoder({(1,): [5, 6, 7, 8], (2,): [1, 2, 3], (3,): [9, 9]})
    r = bench_chain.quantized_agreement(dec, [[1], [2], [3]],
                                        [[5, 6, 0, 8], [1, 2, 3], [8, 9]])
    assert r["prefix_match_per_prompt"] == pytest.approx([0.5, 1.0, 0.0])
    assert r["identical_fraction"] == pytest.approx(1 / 3)
    assert r["mean_prefix_match"] == pytest.approx(0.5)


def test_bench_chain_bad_input_is_one_line_exit_2(capsys, tmp_path):
    for d in ("target", "draft"):
        (tmp_path / d).mkdir()
    base = ["--target", f"t={tmp_path / 'target'}", "--draft", str(tmp_path / "draft"),
            "--methods", "ar,s2d", "--temperatures", "0", "--out", str(tmp_path / "o")]

    def err(argv):
        return cli_error(main, capsys, argv)

    assert "NAME=MID" in err(base + ["--chain", "int8"])
    assert "unknown target 'x'" in err(base + ["--chain", "x=int8"])
    assert "does not exist" in err(base + ["--chain", f"t={tmp_path / 'nope'}"])
    assert "repeats chain chain-int8" in err(base + ["--chain", "t=int8", "--chain", "t=int8"])
    assert "include ar and s2d" in err(base[:4] + ["--methods", "ar,sd", "--chain", "t=int8"])
    assert "include 0" in err(base + ["--temperatures", "1", "--chain", "t=int8"])
    assert "needs --draft" in err(base[:2] + ["--methods", "ar", "--chain", "t=int8"])
    assert "--mu needs a chain" in err(base + ["--mu", "2"])
    assert "--mu must be >= 1" in err(base + ["--chain", "t=int8", "--mu", "0"])
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # ~15 compilations of tiny 32k-vocab models (~2 min on a loaded CPU)
def test_bench_with_chains_end_to_end(tmp_path, capsys):
    from infer.insertion import main as insertion_main
    from test_bench import export_tiny_family

    family = export_tiny_family(tmp_path)
    out = family / "out"
    rc = main(["--target", f"t={family / 'target'}", "--draft", str(family / "draft"),
               "--questions", str(family / "q.jsonl"), "--max-prompts", "3",
               "--methods", "ar,s2d", "--temperatures", "0,1", "--max-new-tokens", "6",
               "--gamma", "2", "--chain", "t=int8,mu=2",
               "--chain", f"t={family / 'draft'},gamma=1", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    tgt = rep["targets"]["t"]
    res = tgt["results"]["0.0"]
    assert set(tgt["chains"]) == {"chain-int8-mu2", "chain-draft-g1"}
    # the chain at gamma 1 is compared with the same two-level setting run at gamma 1
    assert res["s2d-0.5-g1"]["gamma"] == 1 and res["s2d-0.5"]["gamma"] == 2
    assert res["s2d-0.5-g1"]["exits"] == res["s2d-0.5"]["exits"]
    expect = {"chain-int8-mu2": (2, "s2d-0.5", 2), "chain-draft-g1": (1, "s2d-0.5-g1", 1)}
    for label, c in tgt["chains"].items():
        assert res[label]["method"] == "chain" and res[label]["exact_match_vs_ar"] == 1.0
        assert (c["mu"], c["baseline"], c["gamma"]) == expect[label]
        assert c["batch4"]["exact_match_vs_ar"] == 1.0 and c["batch4"]["prompts"] == 3
        assert c["batch4"]["exact_match_per_prompt"] == [True] * 3
        assert set(c["by_temperature"]) == {"0.0", "1.0"}
        for temp, e in c["by_temperature"].items():
            base = tgt["results"][temp][c["baseline"]]
            costs = e["costs_s"]
            assert len(costs["draft_step_per_exit"]) == 2 and min(costs["draft_step_per_exit"]) > 0
            assert all(v > 0 for k, v in costs.items() if k != "draft_step_per_exit")
            assert e["insertion"]["after"]["costs"][:2] == [costs["target_verify_chain"],
                                                           costs["intermediate"]]
            assert e["speedup_vs_2level"] == pytest.approx(
                e["tokens_per_second"] / base["tokens_per_second"])
            mid, top = e["levels"]
            assert (mid["verifies"], top["level"]) == ("draft", "target")
            for lv in e["levels"]:
                assert 0 <= lv["accepted"] <= lv["proposed"] and lv["calls"] > 0
            # the intermediate passes up what it accepted plus one token per call
            assert top["proposed"] == mid["accepted"] + mid["calls"]
            assert top["tokens_per_call"] == pytest.approx(e["mean_accepted_tokens"])
            ins = e["insertion"]
            assert ins["predicted_gain"] == pytest.approx(
                ins["before"]["time_per_token_s"] / ins["after"]["time_per_token_s"])
            helps, faster = ins["predicted"] == "helps", ins["measured"] == "faster"
            assert ins["agrees"] == (helps == faster)
            assert tgt["results"][temp][label]["predicted_speedup"] == e["predicted_speedup"] > 0
        assert c["by_temperature"]["0.0"]["exact_match_per_prompt"] == [True] * 3
    q = tgt["chains"]["chain-int8-mu2"]["quantized"]
    assert q["mode"] == "int8" and 0 < q["params_bytes"] < q["full_precision_params_bytes"]
    assert q["bytes_saved"] == q["full_precision_params_bytes"] - q["params_bytes"]
    assert 0 <= q["identical_fraction"] <= 1 and 0 <= q["mean_prefix_match"] <= 1
    assert len(q["prefix_match_per_prompt"]) == 3
    assert "quantized" not in tgt["chains"]["chain-draft-g1"]
    checks = [c["check"] for c in rep["acceptance"]]
    assert any("chain-int8-mu2: greedy exact match vs AR at batch 4" in c for c in checks)
    assert any("chain-draft-g1: insertion predicted" in c for c in checks)
    table = (out / "report.md").read_text()
    assert "Polybasic chains" in table and "| t | 0.0 | chain-int8-mu2 | 2 | 2 |" in table
    assert "Quantized intermediates" in table
    capsys.readouterr()
    assert insertion_main(["--bench-report", str(out / "report.json"), "--only-temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("inserting") == 2 and printed.count("measured:") == 2


@pytest.mark.slow  # one 3-level chain compilation (~35 s)
def test_level_counts_equal_the_engines_raw_counters():
    import jax
    import jax.numpy as jnp

    from s2d_jax.decode import engine
    from s2d_jax.decode.chain import Chain
    from s2d_jax.decode.state import DecodeParams, SpecConfig
    from s2d_jax.decode.serving import summarize
    from test_chain import other_model
    from test_engine import CFG, PROMPTS, draft, target_params

    spec = SpecConfig(method="s2d", exits=(1, 2, 3), gamma=2, max_len=48, mus=(2,))
    dcfg, dparams = draft()
    mcfg, mparams = other_model()
    dp = DecodeParams.make(spec, [0.4] * 3, temperature=1.0, max_new_tokens=12, eos_id=-1)
    arr = np.zeros((len(PROMPTS), 8), np.int32)
    for i, p in enumerate(PROMPTS):
        arr[i, :len(p)] = p
    state = engine.generate(dparams, target_params(), jnp.asarray(arr),
                            jnp.asarray([len(p) for p in PROMPTS], jnp.int32), dp,
                            jax.random.key(3), (mparams,), chain=Chain(dcfg, (mcfg,), CFG, spec))
    c = bench_chain.level_counts(summarize(state, 1.0, spec))
    s = jax.device_get(state)
    assert c["calls"] == s.stats.level_calls.sum(0).tolist()
    assert c["proposed"] == s.stats.level_proposed.sum(0).tolist()
    assert c["accepted"] == s.stats.level_accepted.sum(0).tolist()
    assert c["tokens"] == pytest.approx(float(s.stats.round_tokens.sum()))
    assert 0 < c["accepted"][0] < c["proposed"][0]  # rejections really happened
