"""python -m train.scaling_study on a tiny engine work dir (tests/test_data_engine.py's
tiny target): points end to end into points.jsonl and the report, a rerun skips finished
points, a budget beyond the engine's data waits with a message, a point killed with
SIGKILL mid-training resumes, bad input is one error line that writes nothing."""

import json
import os
import subprocess
import sys

import pytest

from test_data_engine import ROOT, argv as engine_argv, tmp  # noqa: F401 (fixture)
from tiny_models import cli_error
from train import data_engine, scaling_study

OVERRIDES = ["data.seq_len=48", "data.batch_size=8", "mesh.data=8", "optimizer.warmup_steps=1",
             "model.dtype=float32", "log_every=1", "checkpoint.save_every=2"]


@pytest.fixture(scope="module")
def engine(tmp):  # noqa: F811
    """A tiny engine: 4 prompts answered in 2 shards (greedy and T = 1)."""
    work = tmp / "study-engine"
    data_engine.main(engine_argv(tmp, work) + ["--batch-size", "2"])
    return work


@pytest.fixture(scope="module")
def bare_engine(tmp):  # noqa: F811
    """An engine dir with its stage manifests and no shards: enough for the input checks."""
    from s2d_jax.data.engine import target_fingerprint
    work = tmp / "bare-engine"
    plan = {"plan": {"target": target_fingerprint(str(tmp / "target"))}, "done": {}}
    for stage in ("prompts", "answers"):
        (work / stage).mkdir(parents=True)
        (work / stage / "manifest.json").write_text(json.dumps(plan))
    return work


def argv(tmp, engine, out, budgets="10,20", steps=2):  # noqa: F811
    return ["--engine", str(engine), "--target", str(tmp / "target"), "--out", str(out),
            "--budgets", budgets, "--shapes", "2", "--exit-step", "1",
            "--heldout", os.path.join(ROOT, "data", "demo_calibration.jsonl"),
            "--heldout-prompts", "2", "--documents", str(tmp / "docs.txt"),
            "--head-vocab", "64", "--min-steps", str(steps), "--max-steps", str(steps),
            *OVERRIDES]


@pytest.fixture(scope="module")
def study(tmp, engine):  # noqa: F811
    out = tmp / "study"
    scaling_study.main(argv(tmp, engine, out))
    return out


def rows(path):
    return [json.loads(x) for x in path.open()]


@pytest.mark.slow  # CI time: four tiny training runs, each measured (~40 s)
def test_two_budgets_and_both_kinds_write_points_and_the_report(study):
    got = rows(study / "points.jsonl")
    assert sorted({(r["kind"], r["tokens"]) for r in got}) == [
        ("on_policy", 10), ("on_policy", 20), ("teacher_forced", 10), ("teacher_forced", 20)]
    assert [r["exit"] for r in got] == [1, 2] * 4 and all(r["shape"] == "2 layers" for r in got)
    assert all(0 <= r["agreement"] <= 1 and r["se"] > 0 for r in got)
    for r in got:  # per-prompt hits on the same answers: the report's paired fits
        assert len(r["prompt_hits"]) == len(r["prompt_tokens"]) == 2
        assert sum(r["prompt_hits"]) / sum(r["prompt_tokens"]) == pytest.approx(r["agreement"])
    assert len({tuple(r["prompt_tokens"]) for r in got}) == 1
    assert {"table.md", "fits.json", "scaling.png"} <= set(os.listdir(study / "report"))
    for kind, budget in (("on_policy", 10), ("teacher_forced", 20)):  # exactly the budget
        data = rows(study / "data" / f"{kind}-{budget}" / "rows.jsonl")
        assert sum(len(r["input_ids"]) - max(r["learn_from"], 1) for r in data) == budget
        assert all(len(r["input_ids"]) <= 49 for r in data)  # what seq_len=48 trains on
    kinds = {r["kind"] for r in rows(study / "data" / "teacher_forced-20" / "rows.jsonl")}
    assert kinds <= {"reference", "document"} and kinds
    small = rows(study / "data" / "on_policy-10" / "rows.jsonl")
    big = rows(study / "data" / "on_policy-20" / "rows.jsonl")
    assert [r["input_ids"] for r in small[:-1]] == [r["input_ids"] for r in big[:len(small) - 1]]


@pytest.mark.slow  # needs the study fixture
def test_a_rerun_skips_finished_points_and_adds_no_rows(tmp, engine, study, capsys,  # noqa: F811
                                                        monkeypatch):
    from s2d_jax.train import loop

    def never(*a, **k):
        raise AssertionError("a finished point trained again")

    monkeypatch.setattr(loop, "train", never)
    before = (study / "points.jsonl").read_bytes()
    capsys.readouterr()
    scaling_study.main(argv(tmp, engine, study))
    out = capsys.readouterr().out
    assert out.count("finished") >= 4 and "4 of 4 points finished" in out
    assert (study / "points.jsonl").read_bytes() == before


@pytest.mark.slow  # needs the study fixture
def test_a_point_without_per_prompt_hits_is_measured_again_not_retrained(  # noqa: F811
        tmp, engine, study, capsys, monkeypatch):
    from s2d_jax.train import loop
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("retrained"))
    result = study / "points" / "2L-on_policy-10" / "result.json"
    want = json.loads(result.read_text())
    old = {**want, "exits": [{k: v for k, v in e.items() if not k.startswith("prompt_")}
                             for e in want["exits"]]}
    result.write_text(json.dumps(old))
    points = rows(study / "points.jsonl")
    (study / "points.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if not k.startswith("prompt_")}
                   if r["point"] == "2L-on_policy-10" else r) + "\n" for r in points))
    capsys.readouterr()
    scaling_study.main(argv(tmp, engine, study))
    assert "2L-on_policy-10: measured again for its per-prompt hits" in capsys.readouterr().out
    assert json.loads(result.read_text())["exits"] == want["exits"]
    assert sorted(rows(study / "points.jsonl"), key=json.dumps) == sorted(points, key=json.dumps)


@pytest.mark.slow  # needs the study fixture
def test_a_budget_beyond_the_data_waits_with_a_message(tmp, engine, study, capsys):  # noqa: F811
    capsys.readouterr()
    scaling_study.main(argv(tmp, engine, study, budgets="10,100000") + ["--kinds", "on_policy"])
    out = capsys.readouterr().out
    assert "on_policy 100000 tokens: skipped, the engine holds" in out
    assert "waiting for data: 2L-on_policy-100000" in out
    assert not (study / "data" / "on_policy-100000").exists()
    assert len(rows(study / "points.jsonl")) == 8
    capsys.readouterr()
    scaling_study.main(argv(tmp, engine, study, budgets="10,100000") + ["--kinds",
                                                                       "teacher_forced"])
    out = capsys.readouterr().out
    assert "teacher_forced 100000 tokens: skipped, the text sources hold" in out
    assert "waiting for data" not in out  # the text does not grow: nothing to wait for


class Slept(Exception):
    pass


@pytest.mark.slow  # needs the study fixture
def test_with_wait_minutes_a_waiting_point_is_looked_for_again(tmp, engine, study,  # noqa: F811
                                                               capsys, monkeypatch):
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        if len(slept) == 2:
            raise Slept

    monkeypatch.setattr(scaling_study.time, "sleep", sleep)
    with pytest.raises(Slept):
        scaling_study.main(argv(tmp, engine, study, budgets="10,100000")
                           + ["--kinds", "on_policy", "--wait-minutes", "0.5"])
    assert slept == [30, 30]
    assert capsys.readouterr().out.count("the engine holds") == 2


KILLER = """
import os, signal, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r}); os.chdir({root!r})
import jax
jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
from s2d_jax.train import loop
real = loop.train
def kill_at_3(step, state, record):
    if step == 3:  # the checkpoint of step 2 is written
        os.kill(os.getpid(), signal.SIGKILL)
loop.train = lambda tc, **k: real(tc, **{{**k, "hooks": [kill_at_3]}})
from train import scaling_study
scaling_study.main({argv!r})
"""


@pytest.mark.slow  # CI time: a subprocess study killed mid-training, then its resumed run
def test_a_point_killed_mid_training_resumes_and_finishes(tmp, engine, capsys):  # noqa: F811
    out = tmp / "killed"
    args = argv(tmp, engine, out, budgets="10", steps=4) + ["--kinds", "on_policy"]
    code = KILLER.format(root=ROOT, tests=os.path.join(ROOT, "tests"), argv=args)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=ROOT)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (out / "points.jsonl").exists()
    capsys.readouterr()
    scaling_study.main(args)
    assert "trained from step 2 to 4" in capsys.readouterr().out
    assert [r["exit"] for r in rows(out / "points.jsonl")] == [1, 2]


@pytest.mark.parametrize("flags, needle", [
    (["--kinds", "on_policy,greedy"], "'greedy' is not one of"),
    (["--budgets", "0"], "not a positive token count"),
    (["--budgets=-5k"], "not a positive token count"),
    (["--budgets", "nan"], "not a positive token count"),
    (["--shapes", "9"], "the target has 3"),
    (["--min-steps", "5", "--max-steps", "2"], "--max-steps must be >= 5"),
    (["draft.exits=[1]"], "the study sets"),
])
def test_bad_input_is_one_error_line_and_writes_nothing(tmp, bare_engine, capsys, flags,  # noqa: F811
                                                       needle):
    out = tmp / "bad"
    err = cli_error(scaling_study.main, capsys, argv(tmp, bare_engine, out) + flags)
    assert needle in err and not out.exists()


def test_a_dir_that_is_not_an_engine_dir_is_refused(tmp, capsys):  # noqa: F811
    out = tmp / "bad"
    err = cli_error(scaling_study.main, capsys, argv(tmp, tmp / "target", out))
    assert "is not a data-engine work dir" in err and not out.exists()


def test_a_cut_points_file_is_refused_before_any_point_trains(tmp, bare_engine,  # noqa: F811
                                                              capsys):
    """points.jsonl is read again after each point trains (a JSONDecodeError traceback, after
    the point's training): a cut or hand-edited file is refused up front (issue 68)."""
    from s2d_jax.cli.args import ArgumentParser
    from s2d_jax.io.outputs import DIR, MARKER, mark_output
    out = tmp / "cut-points"
    out.mkdir()
    mark_output(str(out), DIR, ArgumentParser(prog="python -m train.scaling_study").prog)
    (out / "points.jsonl").write_text('{"shape": "2 layers", "kind": "on_pol')
    err = cli_error(scaling_study.main, capsys, argv(tmp, bare_engine, out))
    assert "points.jsonl:1 is not valid JSON" in err and "fix or re-create it" in err, err
    assert sorted(os.listdir(out)) == sorted([MARKER, "points.jsonl"])  # nothing was made
