"""`python -m infer.insertion`: both sides of the insertion inequality on hand-computed
numbers (explicit flags and a bench report), the verdicts, and one-line errors."""

import json
import re

import pytest

from infer.insertion import main
from tiny_models import cli_error

BASE = ["--costs", "10,1", "--accept", "2", "--beta", "4"]


def _run(capsys, argv) -> str:
    assert main(argv) == 0
    return capsys.readouterr().out


def _totals(out: str) -> list[float]:
    """The s/token totals printed for the before and after sides, in order."""
    return [float(x) for x in re.findall(r"= ([0-9.e+-]+) s/token", out)]


def test_explicit_candidate_that_helps(capsys):
    # before: 10/2 + 4*1/2 = 7; after: 10/4 + 3/2 + 4*1/2 = 6 -> helps, gain 7/6
    out = _run(capsys, BASE + ["--candidate-cost", "3", "--new-accept", "4,2",
                               "--measured-gain", "1.1"])
    assert _totals(out) == pytest.approx([7.0, 6.0])
    assert "T/N = T_1/L_1 + beta T_2/L_1" in out
    assert "T'/N = T_1'/L_1' + T_2'/L_2' + beta' T_3'/L_2'" in out
    assert "inserting helps" in out and f"{7 / 6:.3f}x" in out
    assert "faster: agrees" in out


def test_explicit_candidate_that_hurts(capsys):
    # a slow candidate that barely helps acceptance: 10/2.2 + 8/1.5 + 4/1.5 > 7
    out = _run(capsys, BASE + ["--candidate-cost", "8", "--new-accept", "2.2,1.5",
                               "--measured-gain", "1.2"])
    assert _totals(out) == pytest.approx([7.0, 10 / 2.2 + 8 / 1.5 + 4 / 1.5], rel=1e-4)
    assert "inserting hurts" in out and "DISAGREES" in out


def test_explicit_new_costs_and_deeper_position(capsys):
    # the helping candidate hurts once the target's longer verification costs 16:
    # 16/4 + 3/2 + 4/2 = 7.5 > 7
    out = _run(capsys, BASE + ["--candidate-cost", "3", "--new-accept", "4,2",
                               "--new-costs", "16,1"])
    assert _totals(out) == pytest.approx([7.0, 7.5]) and "inserting hurts" in out
    # between M_2 and M_3 of a 3-model chain: 6.0 -> 10/4 + 4/3 + 2/2.5 + 2*1/2.5
    out = _run(capsys, ["--costs", "10,4,1", "--accept", "4,2", "--beta", "3",
                        "--position", "2", "--candidate-cost", "2", "--new-accept", "4,3,2.5",
                        "--new-beta", "2"])
    assert _totals(out) == pytest.approx([6.0, 2.5 + 4 / 3 + 1.6], rel=1e-4)
    assert "between M_2 (intermediate) and M_3 (drafter)" in out and "helps" in out


def _report(path, with_chains=True):
    """A report.json shaped like infer.bench's with two chains on target l."""
    def chain(after, measured):
        return {"mu": 4, "baseline": "s2d-0.5",
                "models": ["draft", "mid", "target"],
                "by_temperature": {"0.0": {"insertion": {
                    "position": 1,
                    "before": {"costs": [10.0, 1.0], "accept_lengths": [2.0], "beta": 4.0},
                    "after": after, "measured_gain": measured}}}}

    helps = chain({"costs": [12.0, 3.0, 1.0], "accept_lengths": [4.0, 2.0], "beta": 4.0}, 1.05)
    hurts = chain({"costs": [12.0, 8.0, 1.0], "accept_lengths": [2.2, 1.5], "beta": 4.0}, 1.2)
    chains = {"chain-int8": helps, "chain-m": hurts} if with_chains else {}
    path.write_text(json.dumps({"targets": {"l": {"results": {}, "chains": chains},
                                            "s": {"results": {}}}}))
    return path


def test_report_mode_prints_every_chain_with_the_measurement(capsys, tmp_path):
    rep = _report(tmp_path / "report.json")
    out = _run(capsys, ["--bench-report", str(rep)])
    blocks = out.split("\n\n")
    assert len(blocks) == 2
    # chain-int8: 7 -> 12/4 + 3/2 + 4/2 = 6.5, helps, measured 1.05x faster: agrees
    assert "chain-int8" in blocks[0] and _totals(blocks[0]) == pytest.approx([7.0, 6.5])
    assert "inserting helps" in blocks[0] and "faster: agrees" in blocks[0]
    assert "two-level s2d-0.5" in blocks[0]
    # chain-m: 12/2.2 + 8/1.5 + 4/1.5 > 7, hurts, yet measured faster: disagrees
    assert _totals(blocks[1]) == pytest.approx([7.0, 12 / 2.2 + 8 / 1.5 + 4 / 1.5], rel=1e-4)
    assert "inserting hurts" in blocks[1] and "DISAGREES" in blocks[1]
    assert _run(capsys, ["--bench-report", str(rep), "--only-target", "l",
                         "--only-temperature", "0"]) == out


def test_bad_input_is_one_line_exit_2(capsys, tmp_path):
    def err(argv):
        return cli_error(main, capsys, argv)

    assert "missing --beta" in err(["--costs", "10,1", "--accept", "2"])
    assert "not comma-separated numbers" in err(BASE[:1] + ["10,x"] + BASE[2:] + [
        "--candidate-cost", "3", "--new-accept", "4,2"])
    assert "not a number" in err(BASE[:-1] + ["four", "--candidate-cost", "3",
                                              "--new-accept", "4,2"])
    assert "needs 2 values" in err(BASE + ["--candidate-cost", "3", "--new-accept", "4"])
    assert "positive" in err(BASE + ["--candidate-cost", "-3", "--new-accept", "4,2"])
    assert "position" in err(BASE + ["--candidate-cost", "3", "--new-accept", "4,2",
                                     "--position", "2"])
    assert "integer" in err(BASE + ["--candidate-cost", "3", "--new-accept", "4,2",
                                    "--position", "1.5"])
    assert "accept lengths" in err(["--costs", "10,1", "--accept", "2,3", "--beta", "4",
                                    "--candidate-cost", "3", "--new-accept", "4,2"])
    rep = _report(tmp_path / "report.json")
    assert "not both" in err(["--bench-report", str(rep), "--beta", "4"])
    assert "does not exist" in err(["--bench-report", str(tmp_path / "missing.json")])
    (tmp_path / "junk.json").write_text("not json")
    assert "not a report.json" in err(["--bench-report", str(tmp_path / "junk.json")])
    assert "unknown" not in err(["--bench-report", str(rep), "--only-target", "xl"])
    assert "has l, s" in err(["--bench-report", str(rep), "--only-target", "xl"])
    assert "no chain results" in err(["--bench-report", str(rep), "--only-target", "s"])
    assert "no chain results at T=1" in err(["--bench-report", str(rep),
                                              "--only-temperature", "1"])
    assert "select results of a --bench-report" in err(BASE + ["--only-target", "l"])


def test_report_with_a_broken_chain_entry_is_one_line(capsys, tmp_path):
    rep = _report(tmp_path / "report.json")
    data = json.loads(rep.read_text())
    del data["targets"]["l"]["chains"]["chain-m"]["by_temperature"]["0.0"]["insertion"]["after"]
    rep.write_text(json.dumps(data))
    assert "lacks the insertion fields" in cli_error(main, capsys, ["--bench-report", str(rep)])
