"""A long run spread over sessions (s2d_jax/train/continuation.py): it stops cleanly at
its time budget, and with its checkpoint gone it continues from its committed progress as
the same run: the same batches in order, the same learning rate at each step; only Adam's
moments restart (with a ramp, step.moment_ramp). Another run's progress is refused."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from s2d_jax.errors import S2DError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(ROOT, "models", "demo", "target-s")
STEPS = 4


def config(tmp_path, name, **extra):
    from s2d_jax.train.config import load_train_config
    over = [f"model.path={DEMO_TARGET}", f"data.tokenizer={DEMO_TARGET}",
            f"data.paths=[{os.path.join(ROOT, 'data', 'tinyshakespeare.txt')}]", "data.format=text",
            "data.seq_len=32", "data.batch_size=2", f"optimizer.total_steps={STEPS}",
            "optimizer.warmup_steps=2", "optimizer.lr=1e-3", "log_every=1",
            f"checkpoint.dir={tmp_path / name / 'ckpt'}", "checkpoint.save_every=100",
            f"export_dir={tmp_path / name / 'hf'}", "export_overwrite=true",
            *[f"{k}={v}" for k, v in extra.items()]]
    return load_train_config(os.path.join(ROOT, "configs", "train", "demo_draft.yaml"), over)


def run(tc):
    from s2d_jax.train.loop import train
    return train(tc, progress=False, devices=jax.devices()[:1])


def test_a_stopped_run_continues_from_its_committed_progress_as_the_same_run(tmp_path, capsys):
    from s2d_jax.train.loop import RECIPE
    whole = run(config(tmp_path, "whole"))
    assert not whole["stopped_early"] and len(whole["history"]) == STEPS
    # a budget already spent after the first step: the run stops there, saved and exported
    first = run(config(tmp_path, "split", stop_after_minutes=1e-9))
    assert first["stopped_early"] and int(first["state"].step) == 1
    recipe = json.loads((tmp_path / "split" / "hf" / RECIPE).read_text())
    assert recipe["steps"] == 1 and recipe["total_steps"] == STEPS
    assert "stop_after_minutes" not in recipe["plan"]
    # the session ends; what it committed is the exported draft; the machine is lost
    progress = tmp_path / "committed"
    shutil.copytree(tmp_path / "split" / "hf", progress)
    shutil.rmtree(tmp_path / "split")
    capsys.readouterr()
    rest = run(config(tmp_path, "split", **{"model.continue_from": progress}))
    said = capsys.readouterr().out
    assert "this run's progress at step 1" in said and "lost: the optimizer moments" in said
    assert int(rest["state"].step) == STEPS and not rest["stopped_early"]
    # steps 2..4 read the batches the whole run read at steps 2..4, at its learning rates
    # (the schedule's), the first of them halved by the ramp of the new moments (warmup 2)
    assert [r["step"] for r in rest["history"]] == [2, 3, 4]
    for got, want, ramp in zip(rest["history"], whole["history"][1:], (0.5, 1, 1)):
        assert got["batch_fingerprint"] == want["batch_fingerprint"]
        assert got["lr"] == pytest.approx(want["lr"] * ramp) and want["lr"] > 0
    assert np.isfinite(rest["history"][-1]["loss"])
    recipe = json.loads((tmp_path / "split" / "hf" / RECIPE).read_text())
    assert recipe["start"].startswith("continued at step 1") and recipe["steps"] == STEPS
    # another run's progress (another data seed) is refused before any step
    shutil.rmtree(tmp_path / "split" / "ckpt")
    with pytest.raises(S2DError, match=r"continue_from .* data\.seed=1, this run has "
                                       r"data\.seed=5"):
        run(config(tmp_path, "split", **{"model.continue_from": progress, "data.seed": 5}))


def test_the_recipe_keeps_every_leg_of_a_run_across_checkpoints_and_lost_machines(tmp_path):
    from s2d_jax.train.continuation import LEGS
    from s2d_jax.train.loop import RECIPE

    def legs(name):
        recipe = json.loads((tmp_path / name / "hf" / RECIPE).read_text())
        assert recipe["start"] == recipe["legs"][-1]["start"]
        return [(x["start"].split(" from ")[0].split(" at ")[0], x["from_step"], x["to_step"],
                 x["lost"] is not None) for x in recipe["legs"]]

    run(config(tmp_path, "legs", stop_after_minutes=1e-9))  # session 1: step 1, then stops
    assert legs("legs") == [("initialised", 0, 1, False)]
    run(config(tmp_path, "legs", stop_after_minutes=1e-9))  # session 2, same machine: step 2
    assert legs("legs") == [("initialised", 0, 1, False), ("resumed", 1, 2, False)]
    assert json.loads((tmp_path / "legs" / "ckpt" / LEGS).read_text())[-1]["from_step"] == 1
    # the machine is lost; session 3 continues from what was committed, to the end
    shutil.copytree(tmp_path / "legs" / "hf", tmp_path / "committed")
    shutil.rmtree(tmp_path / "legs")
    run(config(tmp_path, "legs", **{"model.continue_from": tmp_path / "committed"}))
    assert legs("legs") == [("initialised", 0, 1, False), ("resumed", 1, 2, False),
                            ("continued", 2, STEPS, True)]
    # legs read back get the checks of a flag: a malformed file is refused, naming it
    (tmp_path / "legs" / "ckpt" / LEGS).write_text('[{"start": 3}]')
    with pytest.raises(S2DError, match=f"{LEGS} has malformed run legs"):
        run(config(tmp_path, "legs"))


def test_progress_without_a_recipe_or_step_is_refused_and_a_new_path_starts_fresh(tmp_path):
    from s2d_jax.train.continuation import committed_progress
    assert committed_progress(str(tmp_path / "not-yet"), {}) is None
    with pytest.raises(S2DError, match="has no s2d_recipe.json"):
        committed_progress(str(tmp_path), {})
    for steps in ("3", -1, True, None):
        (tmp_path / "s2d_recipe.json").write_text(json.dumps({"plan": {}, "steps": steps}))
        with pytest.raises(S2DError, match="no plan and step count"):
            committed_progress(str(tmp_path), {})
    (tmp_path / "s2d_recipe.json").write_text(json.dumps({"plan": {"a": {"b": 1}}, "steps": 7}))
    assert committed_progress(str(tmp_path), {"a": {"b": 1}}) == 7
    with pytest.raises(S2DError, match="made with a.b=1, this run has a.b=2"):
        committed_progress(str(tmp_path), {"a": {"b": 2}})


def test_progress_made_under_another_home_is_the_same_run(tmp_path, monkeypatch):
    """The target and the work files live under ~/.cache: a plan keeps them as ~/..., so a new
    machine whose home is another dir continues the run; a recipe written before (absolute
    paths under this home) still matches, and a path outside the home is still compared."""
    from s2d_jax.train.checkpoint import portable
    from s2d_jax.train.continuation import committed_progress

    def plan(home, other="/data/x"):
        return {"model": {"path": f"{home}/.cache/t"}, "data": {"paths": [f"{home}/c", other]}}
    monkeypatch.setenv("HOME", "/home/first")
    written = portable(plan("/home/first"))
    assert written == {"model": {"path": "~/.cache/t"}, "data": {"paths": ["~/c", "/data/x"]}}
    (tmp_path / "s2d_recipe.json").write_text(json.dumps({"plan": written, "steps": 3}))
    monkeypatch.setenv("HOME", "/root")
    assert committed_progress(str(tmp_path), plan("/root")) == 3
    with pytest.raises(S2DError, match=r"data\.paths=\['~/c', '/data/x'\], this run has "
                                       r"data\.paths=\['~/c', '/data/y'\]"):
        committed_progress(str(tmp_path), plan("/root", "/data/y"))
    (tmp_path / "s2d_recipe.json").write_text(json.dumps({"plan": plan("/root"), "steps": 4}))
    assert committed_progress(str(tmp_path), plan("/root")) == 4


def test_a_continued_state_keeps_the_schedule_and_ramps_its_new_moments():
    from s2d_jax.train.config import OptimizerConfig
    from s2d_jax.train.continuation import at_step
    from s2d_jax.train.step import MomentRampState, TrainState, applied_lr, make_optimizer
    tx, schedule = make_optimizer(OptimizerConfig(lr=1.0, warmup_steps=4, total_steps=100,
                                                  clip_norm=0.0), 100)
    params = {"w": jnp.zeros(3)}
    grads = {"w": jnp.asarray([1.0, -2.0, 0.5])}
    fresh = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

    def first_update(state):
        updates, _ = tx.update(grads, state.opt_state, state.params)
        return np.asarray(updates["w"])

    # a run's own start: the schedule's warmup alone (lr(0) = 0), no ramp on top
    np.testing.assert_allclose(first_update(fresh), 0.0)
    moved = at_step(fresh, 50)
    assert int(moved.step) == 50
    counts = [x for x in jax.tree.leaves(moved.opt_state, is_leaf=lambda x: isinstance(
        x, (optax.ScaleByScheduleState, optax.ScaleByAdamState, MomentRampState)))
        if isinstance(x, (optax.ScaleByScheduleState, optax.ScaleByAdamState, MomentRampState))]
    kinds = {type(x).__name__: x for x in counts}
    assert int(kinds["ScaleByScheduleState"].count) == 50
    assert int(kinds["ScaleByAdamState"].count) == 0  # new moments: bias correction anew
    assert int(kinds["MomentRampState"].age) == 0
    # fresh moments give lr * sign(g); the ramp takes a quarter of it on the first update
    want = -float(schedule(50)) * np.sign(np.asarray(grads["w"])) / 4
    np.testing.assert_allclose(first_update(moved), want, rtol=1e-5)
    assert float(applied_lr(moved.opt_state, schedule, moved.step)) == pytest.approx(
        float(schedule(50)) / 4)
    assert float(applied_lr(fresh.opt_state, schedule, fresh.step)) == 0.0
    # without the ramp (age full) it would be the whole lr * sign(g)
    full = at_step(fresh, 50)
    full = full.replace(opt_state=jax.tree.map(
        lambda x: x._replace(age=jnp.asarray(4, jnp.int32)) if isinstance(x, MomentRampState)
        else x, full.opt_state, is_leaf=lambda x: isinstance(x, MomentRampState)))
    np.testing.assert_allclose(first_update(full), 4 * want, rtol=1e-5)


def test_the_time_budget_must_be_a_finite_number_of_minutes(tmp_path):
    for bad, why in (("-1", "must be >= 0"), ("nan", "not a finite number"),
                     ("inf", "not a finite number")):
        with pytest.raises(S2DError, match=f"stop_after_minutes.*{why}"):
            config(tmp_path, "x", stop_after_minutes=bad)
