"""train.bench_answers: the batched decoder and the slot engine beside the teacher pass."""

import re

import pytest


@pytest.mark.slow
def test_prints_each_run_beside_the_teacher_forced_rate(tmp_path, capsys):
    from tiny_models import tiny_target
    from train import bench_answers
    target = tiny_target(str(tmp_path / "t"))
    bench_answers.main(["--target", target, "--batch-sizes", "2", "--slot-counts", "2",
                        "--requests", "3", "--max-new-tokens", "4"])
    lines = capsys.readouterr().out.splitlines()
    # each prompt greedy and at T = 1 (the default --temperatures 0,1, the corpus's)
    assert [line.split(":")[0] for line in lines] == ["batch 2", "slots 2 (6 requests)"]
    for line in lines:
        m = re.search(r": ([\d.]+) answer tokens/s \((\d+) answers, (\d+) tokens\); "
                      r"teacher-forced ([\d.]+) tokens/s on the same rows; answer rate / "
                      r"teacher-forced ([\d.]+) \(at most ([\d.]+) for these rows\); cost "
                      r"ratio ([\d.]+)$", line)
        assert m, line
        rate, answers, tokens, tf, ratio, bound, cost = (float(x) for x in m.groups())
        assert answers in (4, 6) and rate > 0 and tf > 0 and 0 < tokens <= 4 * answers
        assert abs(ratio - rate / tf) < 0.01 + 0.01 * ratio
        # the answer-rate ratio is the cost ratio scaled by the answers' share of the rows
        assert abs(ratio - cost * bound) < 0.02 + 0.02 * ratio


def test_refuses_bad_counts(tmp_path, capsys):
    from tiny_models import cli_error
    from train import bench_answers
    base = ["--target", str(tmp_path)]
    assert "--batch-sizes and --slot-counts" in cli_error(
        bench_answers.main, capsys, base + ["--batch-sizes", "", "--slot-counts", ""])
    assert "--requests must be >= 1" in cli_error(
        bench_answers.main, capsys, base + ["--requests", "0"])
    for bad in ("-1", "nan", ""):
        assert "--temperatures" in cli_error(
            bench_answers.main, capsys, base + ["--temperatures", bad])
