"""python -m train.data_engine on a tiny random target with the demo tokenizer: the stages
end to end, a stage killed with SIGKILL resumes to the uninterrupted output, a complete
engine skips every stage, training from the cache logs held-out agreement and resumes."""

import json
import os
import subprocess
import sys

import pytest

from s2d_jax.data import shards
from tiny_models import cli_error, tiny_target
from train import data_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("prompts", "answers", "teacher")


def argv(tmp, work):
    return ["--target", str(tmp / "target"), "--work", str(work),
            "--prompts", str(tmp / "prompts.jsonl"), "--answers", "4", "--batch-size", "4",
            "--max-new-tokens", "6", "--references", "2", "--documents", str(tmp / "docs.txt"),
            "--max-tokens", "256", "--teacher-shard", "4", "--heldout", os.path.join(ROOT, "data",
                                                            "demo_calibration.jsonl")]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """A tiny target (demo tokenizer, no chat template), prompts (three GSM8K-train
    questions, so their reference solutions are used too) and a small document file."""
    d = tmp_path_factory.mktemp("engine")
    tiny_target(str(d / "target"))
    with open(os.path.join(ROOT, "data", "gsm8k_train.jsonl")) as f:
        questions = [json.loads(next(f))["question"] for _ in range(3)]
    questions += ["Name a prime number.", "Write a haiku about snow on a quiet mountain."]
    (d / "prompts.jsonl").write_text("".join(json.dumps({"question": q}) + "\n"
                                             for q in questions))
    (d / "docs.txt").write_text("First Citizen: we are accounted poor citizens.\n\n"
                                "Second Citizen: would you proceed especially against Caius "
                                "Marcius, chief enemy to the people of the city?\n")
    return d


def files(d):
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d)) if os.path.isfile(d / n)}


@pytest.fixture(scope="module")
def built(tmp):
    work = tmp / "clean"
    data_engine.main(argv(tmp, work))
    return work


def test_the_engine_writes_every_stage_with_its_manifest(tmp, built):
    plans = {s: json.loads((built / s / shards.MANIFEST).read_text())["plan"] for s in STAGES}
    assert len({p["target"] for p in plans.values()}) == 1  # one target fingerprint
    assert plans["answers"]["items"] == 4 and plans["teacher"]["shards"] == 3
    answers = shards.read_rows(str(built / "answers"))
    assert sorted(r["temperature"] for r in answers) == [0.0] * 4 + [1.0] * 4
    rows = [json.loads(line) for line in (built / "train" / "rows.jsonl").open()]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("answer") == 8 and kinds.count("reference") == 2
    assert kinds.count("document") == 2 and all(len(r["input_ids"]) <= 256 for r in rows)
    from s2d_jax.data.teacher import TeacherStates
    states = TeacherStates(str(built / "train" / "teacher"), str(built / "train" / "rows.jsonl"))
    assert states.states.shape == (sum(len(r["input_ids"]) - 1 for r in rows), 32)


KILLER = """
import os, signal, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, {root!r}); os.chdir({root!r})
import jax
jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
from s2d_jax.data import teacher
real, calls = teacher.rows_states, []
def rows_states(*a, **k):
    calls.append(1)
    if len(calls) == 2:  # in teacher shard 1: shard 0 is written
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
teacher.rows_states = rows_states
from train import data_engine
data_engine.main({argv!r})
"""


@pytest.mark.slow  # CI time: a subprocess engine run, then its resumed run
def test_a_stage_killed_with_sigkill_resumes_to_the_uninterrupted_output(tmp, built, capsys):
    work = tmp / "killed"
    code = KILLER.format(root=ROOT, argv=argv(tmp, work))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=ROOT)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert len(json.loads((work / "teacher" / shards.MANIFEST).read_text())["done"]) == 1
    assert not (work / "train").exists()
    capsys.readouterr()
    data_engine.main(argv(tmp, work))
    out = capsys.readouterr().out
    assert "[answers] all 1 shards complete" in out
    assert "[teacher] 1 of 3 shards complete; running 2" in out and "ETA" in out
    for stage in (*STAGES, "train", "train/teacher"):
        assert files(work / stage) == files(built / stage), stage


def test_a_complete_engine_skips_every_stage(tmp, built, capsys, monkeypatch):
    from s2d_jax.data import distill, teacher

    def never(*a, **k):
        raise AssertionError("a complete stage ran the target")

    monkeypatch.setattr(distill, "answer_rows", never)
    monkeypatch.setattr(teacher, "rows_states", never)
    before = {s: files(built / s) for s in (*STAGES, "train", "train/teacher")}
    capsys.readouterr()
    data_engine.main(argv(tmp, built))
    out = capsys.readouterr().out
    for stage in STAGES:
        assert f"[{stage}] all " in out and f"{built / stage}; skipping" in out
    assert "train/teacher is up to date" in out
    assert before == {s: files(built / s) for s in before}


@pytest.mark.slow  # CI time: two short training runs with held-out measurements (~60 s)
def test_training_from_the_cache_logs_heldout_agreement_and_resumes(tmp, built):
    train = ["--train", os.path.join(ROOT, "configs", "train", "engine_h100.yaml"),
             "--heldout-prompts", "3", "--heldout-every", "2", "data.seq_len=48",
             "data.batch_size=8", "mesh.data=8", "optimizer.grad_accum_steps=1", "optimizer.warmup_steps=1", "draft.exits=[1,2]",
             "model.dtype=float32", "log_every=1", "checkpoint.save_every=2"]
    data_engine.main(argv(tmp, built) + train + ["optimizer.total_steps=2"])
    data_engine.main(argv(tmp, built) + train + ["optimizer.total_steps=4"])  # resumes at 2
    lines = [json.loads(x) for x in (built / "train" / "heldout.jsonl").open()]
    assert [x["step"] for x in lines] == [2, 4] and all(x["prompts"] == 3 for x in lines)
    for x in lines:
        assert [r["exit"] for r in x["exits"]] == [1, 2]
        assert all(0 <= r["agreement"] <= 1 and 0 <= r["accept_t1"] <= 1 for r in x["exits"])
    steps = [json.loads(x)["step"] for x in (built / "train" / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4]
    assert (built / "train" / "draft_hf" / "config.json").is_file()


@pytest.mark.parametrize("flags, needle", [
    (["--answers", "-1"], "--answers must be >= 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["optimizer.lr=1"], "need --train"),
    (["--documents", "nope.txt"], "nope.txt does not exist"),
    (["--train", os.path.join(ROOT, "configs", "train", "engine_h100.yaml"),
      "checkpoint.dir=/tmp/x"], "the engine sets"),
])
def test_bad_flags_are_one_error_line_and_write_nothing(tmp, capsys, flags, needle):
    work = tmp / "bad"
    err = cli_error(data_engine.main, capsys, argv(tmp, work) + flags)
    assert needle in err and not work.exists()


def test_answer_batches_are_of_similar_lengths_in_a_seeded_random_order():
    from s2d_jax.data.engine import chosen_prompts
    pool = ["x" * n for n in range(1, 41)]
    out = chosen_prompts(pool, 0, 4, seed=0)
    batches = [out[k:k + 4] for k in range(0, 40, 4)]
    assert sorted(out) == sorted(pool) and out == chosen_prompts(pool, 0, 4, seed=0)
    assert all(max(map(len, b)) - min(map(len, b)) == 3 for b in batches)  # neighbours
    assert [len(b[0]) for b in batches] != sorted(len(b[0]) for b in batches)  # shuffled
    assert len(chosen_prompts(pool, 10, 4, seed=1)) == 10
