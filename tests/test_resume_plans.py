"""Every resumable stage records every argument that changes what it writes, and refuses a
resume that differs (issue 41): one test per stage and argument. The model passes are
stubbed (their output depends on the arguments as the real ones' does); what is tested is
the stage's plan: a first run, a resume with the same arguments (accepted, nothing redone)
and a resume with one argument changed (one S2DError naming that argument, nothing
written).
"""

from __future__ import annotations

import numpy as np
import pytest

from s2d_jax.data import engine
from s2d_jax.errors import S2DError
from test_cli_fuzz import snapshot

FP = "target-fingerprint"


def _quiet(msg):
    pass


def _magpie(work, batch_size=2, seed=0):
    return engine.magpie_stage(str(work), FP, None, None, 4, batch_size, seed, _quiet)


def _answers(work, max_new_tokens=8, seed=0):
    return engine.answers_stage(str(work), FP, None, None, ["a", "b", "c"], 2,
                                max_new_tokens, seed, _quiet)


def _teacher(work, max_tokens=16, template="none"):
    items = [{"kind": "answer", "input_ids": list(range(1, 30)), "learn_from": 3}] * 3
    return engine.teacher_stage(str(work), FP, items, None, template,
                                lambda rows: np.zeros((sum(map(len, rows)), 4), np.float32),
                                max_tokens, 2, _quiet)


def _distill(work, tok, max_new_tokens=8, temperatures=(0.0, 1.0), batch_size=2,
             max_batches=None, seed=0, prompts=("a", "b", "c")):
    from s2d_jax.data.distill import generate_answers
    return generate_answers(None, tok, list(prompts), str(work / "answers.jsonl"),
                            max_new_tokens=max_new_tokens, temperatures=temperatures,
                            batch_size=batch_size, max_batches=max_batches, seed=seed,
                            log=_quiet)


@pytest.fixture(autouse=True)
def stub_models(monkeypatch):
    """The target's passes, as functions of the arguments that change their output."""
    import s2d_jax.data.distill as distill
    import s2d_jax.data.magpie as magpie
    import s2d_jax.data.prompts as prompts

    def turns(decoder, tok, count, batch_size=16, seed=0, log=None):
        return [f"turn {seed}-{i}" for i in range(count)]

    def rows(decoder, tok, prompts, temperature, seed, max_new_tokens=192, template="auto"):
        return [{"input_ids": [1, 2] + [seed % 7 + 3] * max_new_tokens, "learn_from": 2,
                 "temperature": temperature, "prompt": p} for p in prompts]
    monkeypatch.setattr(magpie, "sample_user_turns", turns)
    monkeypatch.setattr(prompts, "prompt_ids", lambda tok, template, users: [1] * len(users[0]))
    monkeypatch.setattr(distill, "answer_rows", rows)


STAGES = {"magpie": _magpie, "answers": _answers, "teacher": _teacher, "distill": _distill}
CHANGES = [("magpie", "batch_size", 3, "--batch-size"), ("magpie", "seed", 1, "--seed"),
           ("answers", "max_new_tokens", 16, "--max-new-tokens"),
           ("answers", "seed", 1, "--seed"),
           ("teacher", "max_tokens", 8, "--max-tokens"),
           ("teacher", "template", "vicuna", "chat template"),
           ("distill", "max_new_tokens", 16, "--max-new-tokens"),
           ("distill", "temperatures", (0.0,), "temperatures"),
           ("distill", "batch_size", 3, "batch size"),
           ("distill", "max_batches", 1, "batches"),
           ("distill", "seed", 1, "seed"),
           ("distill", "prompts", ("a", "b", "d"), "prompts")]


@pytest.mark.parametrize("stage,arg,value,named", CHANGES,
                         ids=[f"{c[0]}-{c[1]}" for c in CHANGES])
def test_a_resume_with_another_argument_is_refused(tmp_path, stage, arg, value, named):
    run = STAGES[stage]
    extra = {"tok": None} if stage == "distill" else {}
    run(tmp_path, **extra)
    before = snapshot(tmp_path)
    run(tmp_path, **extra)  # the same arguments resume: all done, nothing rewritten
    assert snapshot(tmp_path) == before
    with pytest.raises(S2DError, match=named):
        run(tmp_path, **extra, **{arg: value})
    assert snapshot(tmp_path) == before


def test_the_engine_stages_record_their_arguments():
    """The stage functions' arguments that reach `work` are those the tests change (a new
    one must be added to the stage's settings and to CHANGES)."""
    import inspect
    recorded = {"magpie": {"batch_size", "seed"}, "answers": {"max_new_tokens", "seed"},
                "teacher": {"max_tokens", "template"}}
    plumbing = {"work", "fp", "decoder", "tok", "log", "states", "prompts", "items", "count",
                "shard_size", "batch_size"}
    for stage, fn in (("magpie", engine.magpie_stage), ("answers", engine.answers_stage),
                      ("teacher", engine.teacher_stage)):
        args = set(inspect.signature(fn).parameters) - plumbing
        assert args <= recorded[stage], (stage, args - recorded[stage])
        assert {c[1] for c in CHANGES if c[0] == stage} == recorded[stage]


@pytest.mark.parametrize("override", ["optimizer.lr=0.01", "seed=1", "data.seq_len=16",
                                      "draft.exits=[2,4]", "optimizer.total_steps=3"])
def test_training_resumes_only_with_the_settings_it_was_made_with(tmp_path, override):
    import jax

    from s2d_jax.train.loop import train
    from test_trainer import synthetic_config
    base = [f"checkpoint.dir={tmp_path / 'ckpt'}", "optimizer.total_steps=2",
            "optimizer.warmup_steps=1"]
    train(synthetic_config(tmp_path, *base), devices=jax.devices()[:1], progress=False)
    assert (tmp_path / "ckpt" / "run_plan.json").is_file()
    again = train(synthetic_config(tmp_path, *base), devices=jax.devices()[:1], progress=False)
    assert again["start_step"] == 2  # the same settings resume
    key = override.split("=")[0]
    before = snapshot(tmp_path / "ckpt")
    with pytest.raises(S2DError, match=key.replace("[", r"\[")):
        train(synthetic_config(tmp_path, *base, override), devices=jax.devices()[:1],
              progress=False)
    assert snapshot(tmp_path / "ckpt") == before


# --- train/corpus_generate.py: a corpus run's plan (issue 68) -------------------------

class ModelLoaded(Exception):
    """Raised by the stubbed model loader: the command got past its checks."""


@pytest.fixture
def corpus_cli(tmp_path, monkeypatch):
    """A corpus holding run r0 planned by `argv` (its prompts written); the model loader
    and the target's fingerprint stubbed, so a command that gets past its checks stops
    with ModelLoaded before any answer is generated."""
    import s2d_jax.io.checkpoint as checkpoint
    from s2d_jax.data import corpus
    from train import corpus_generate

    def load_model(*a, **kw):
        raise ModelLoaded
    monkeypatch.setattr(checkpoint, "load_model", load_model)
    monkeypatch.setattr(engine, "target_fingerprint", lambda target: FP)
    (tmp_path / "target").mkdir()
    for name in ("p1.jsonl", "p2.jsonl", "held.jsonl", "held2.jsonl"):
        (tmp_path / name).write_text('{"question": "Name a prime."}\n')
    argv = ["--target", str(tmp_path / "target"), "--corpus", str(tmp_path / "c"),
            "--work", str(tmp_path / "w"), "--run", "r0", "--prompts",
            str(tmp_path / "p1.jsonl"), "--heldout", str(tmp_path / "held.jsonl"),
            "--batch-size", "2", "--max-new-tokens", "5", "--magpie", "4", "--seed", "0"]
    counts = {"magpie_turns_kept": 3, "pool": {"read": 4, "kept": 4}, "chosen": 4}
    plan = corpus_generate.run_plan(corpus_generate.parse_args(argv), counts)
    corpus.start_run(str(tmp_path / "c"), corpus_generate.target_record(
        corpus_generate.parse_args(argv), FP, 64), "r0", plan, ["a", "b", "c", "d"])
    return argv


def _with(argv, flag, value):
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def test_a_corpus_run_resumes_with_its_own_arguments(corpus_cli):
    from train import corpus_generate
    with pytest.raises(ModelLoaded):  # the same command gets past the plan's checks
        corpus_generate.main(corpus_cli)


RUN_CHANGES = [("--prompts", "p2.jsonl"), ("--heldout", "held2.jsonl"), ("--magpie", "8"),
               ("--magpie-batch-size", "3"), ("--answers", "2"), ("--seed", "1"),
               ("--batch-size", "4"), ("--max-new-tokens", "7")]


@pytest.mark.parametrize("flag,value", RUN_CHANGES, ids=[c[0] for c in RUN_CHANGES])
def test_a_corpus_run_resumed_with_another_argument_is_refused(corpus_cli, tmp_path, capsys,
                                                               flag, value):
    """Every argument that changes the run's rows is compared with the stored plan, the
    prompt source's included, before the model loads and before anything is written."""
    from tiny_models import cli_error
    from train import corpus_generate
    value = str(tmp_path / value) if value.endswith(".jsonl") else value
    before = snapshot(tmp_path)
    err = cli_error(corpus_generate.main, capsys, _with(corpus_cli, flag, value))
    planned, _, now = err.partition("(this command: ")
    assert f"run r0 of {tmp_path / 'c'} was planned with " in planned, err
    assert f" {flag} " in planned and f"{flag} {value}" in now, err
    assert "--run" in err and "resume" in err  # the fix: its arguments, or a new run
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("run", ["../up", "a b", "", "r0/x", "r-1"])
def test_a_bad_corpus_run_name_is_refused_before_any_work(tmp_path, capsys, monkeypatch,
                                                          run):
    import s2d_jax.io.checkpoint as checkpoint
    from tiny_models import cli_error
    from train import corpus_generate

    def load_model(*a, **kw):
        raise ModelLoaded

    def fingerprint(target):
        raise ModelLoaded
    monkeypatch.setattr(checkpoint, "load_model", load_model)
    monkeypatch.setattr(engine, "target_fingerprint", fingerprint)
    (tmp_path / "target").mkdir()
    (tmp_path / "p.jsonl").write_text('{"question": "Name a prime."}\n')
    before = snapshot(tmp_path)
    err = cli_error(corpus_generate.main, capsys, [
        "--target", str(tmp_path / "target"), "--corpus", str(tmp_path / "c"),
        "--work", str(tmp_path / "w"), "--run", run, "--prompts", str(tmp_path / "p.jsonl"),
        "--heldout", str(tmp_path / "p.jsonl")])
    assert f"--run {run!r}" in err and "letters, digits and _" in err, err
    assert snapshot(tmp_path) == before  # no corpus, no --work, nothing written
