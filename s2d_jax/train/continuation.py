"""A long run spread over sessions on machines that may not last: its committed progress.

A run stopped at its time budget (`stop_after_minutes`) keeps a checkpoint in its
checkpoint.dir, which a later session on the same machine resumes exactly. A machine that
is gone takes that dir with it; what survives is what was committed: the draft pack the
pipeline writes at the stop (train/smollm2_draft.py --progress) with the recipe of its run
(s2d_recipe.json: the plan, the corpus slice it read, the step reached). With
`model.continue_from` naming that pack and no checkpoint to resume, the run continues as
the same run: the learning-rate schedule at the recorded step, the data from the batch
after it (the data order is seeded, so skipping that many batches finds it). Lost: Adam's
moments (restarted at zero, their bias correction with them; the updates ramp up again over
the warmup's length, step.moment_ramp) and the float32 weights, which the pack keeps as int8.

The recipe also keeps the run's legs, one per session that trained it: how each began
(initialised, warm-started, resumed from its checkpoint, continued from committed progress
with what that lost), the steps it trained and when it began; a checkpoint dir keeps the
legs of its steps beside them (LEGS), so a resumed run records the sessions before it too.

A pack whose recipe has another plan (other settings, another corpus slice) is another
run's progress and is refused: continuing it would silently train one run as another. Paths
under the home dir are kept as ~/... (checkpoint.portable), so a machine whose home is
another dir still continues the run.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax

from s2d_jax.errors import S2DError

RECIPE = "s2d_recipe.json"  # written beside an exported draft (train/loop.write_recipe)
LEGS = "run_legs.json"  # in checkpoint.dir: the legs its checkpointed steps came from
LOST = ("the optimizer moments (Adam m, v: restarted at zero, the updates ramped up again "
        "over the warmup) and the float32 weights (the pack keeps int8)")


def committed_progress(path: str, plan: dict) -> int | None:
    """The step this run's committed progress at `path` reached, or None when `path` does
    not exist yet (the run's first session). Refuses a dir without a recipe or with the
    recipe of another plan, naming the first setting that differs."""
    if not os.path.exists(path):
        return None
    recipe_path = os.path.join(path, RECIPE)
    if not os.path.isfile(recipe_path):
        raise S2DError(f"model.continue_from {path} has no {RECIPE}, so it is not a run's "
                       f"committed progress; give the dir a stopped run wrote, or another path")
    from s2d_jax.readers import read_json
    recipe = read_json(recipe_path, "training recipe")
    step = recipe.get("steps") if isinstance(recipe, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(
            recipe.get("plan"), dict):
        raise S2DError(f"{recipe_path} has no plan and step count (steps: {step!r}); give the "
                       f"progress dir a stopped run wrote, or another path")
    from s2d_jax.train.checkpoint import plan_difference
    diff = plan_difference(recipe["plan"], plan)
    if diff:
        key, was, now = diff
        raise S2DError(f"model.continue_from {path} is the progress of a run made with "
                       f"{key}={was!r}, this run has {key}={now!r}; continue it with the "
                       f"same settings, or give another path")
    return step


def at_step(state, step: int):
    """A freshly initialised train state moved to `step` of its run: the step count and
    the learning-rate schedule's count at `step`; Adam's own count stays 0 (its moments are
    new) and the moment ramp starts (age 0)."""
    from s2d_jax.train.step import MomentRampState

    def is_counted(x):
        return isinstance(x, (optax.ScaleByScheduleState, MomentRampState))

    def move(x):
        if isinstance(x, optax.ScaleByScheduleState):
            return x._replace(count=jnp.full_like(x.count, step))
        if isinstance(x, MomentRampState):
            return x._replace(age=jnp.zeros_like(x.age))
        return x

    opt_state = jax.tree.map(move, state.opt_state, is_leaf=is_counted)
    return state.replace(step=jnp.full_like(state.step, step), opt_state=opt_state)


def skip_batches(iterator, count: int) -> None:
    """Read past the `count` batches the committed steps trained on."""
    for done in range(count):
        try:
            next(iterator)
        except StopIteration:
            raise S2DError(f"the data ended after {done} batches, but the committed progress "
                           f"trained on {count}; it was made from other data") from None


def leg(start: str, from_step: int, lost: str | None = None) -> dict:
    """One session's part of a run, begun now at `from_step` (its end set when it stops)."""
    import datetime
    began = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"start": start, "from_step": int(from_step), "to_step": None, "began_utc": began,
            "lost": lost}


def then(legs: list[dict], new: dict) -> list[dict]:
    """`legs` with the last ended where `new` begins (steps past a crash's last checkpoint
    are redone, so they do not count), then `new`."""
    return [*legs[:-1], *[dict(x, to_step=new["from_step"]) for x in legs[-1:]], new]


def _checked_legs(legs, where: str) -> list[dict]:
    """Legs read from a file, checked as a flag would be."""
    def ok_step(v):
        return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    if not isinstance(legs, list) or not all(
            isinstance(x, dict) and isinstance(x.get("start"), str)
            and ok_step(x.get("from_step")) and ok_step(x.get("to_step")) for x in legs):
        raise S2DError(f"{where} has malformed run legs (each needs a start text and step "
                       f"counts); restore the file the run wrote, or remove its legs")
    return legs


def committed_legs(path: str) -> list[dict]:
    """The legs the recipe of committed progress `path` records (committed_progress checked
    it); a recipe written before legs were kept gives one leg: its start, up to its step."""
    from s2d_jax.readers import read_json
    recipe_path = os.path.join(path, RECIPE)
    recipe = read_json(recipe_path, "training recipe")
    if "legs" in recipe:
        return _checked_legs(recipe["legs"], recipe_path)
    return [{"start": str(recipe.get("start", "not recorded")), "from_step": None,
             "to_step": recipe["steps"], "began_utc": None, "lost": None}]


def checkpoint_legs(directory: str) -> list[dict]:
    """The legs kept beside the checkpoints of `directory`; [] for a dir made before legs
    were kept."""
    path = os.path.join(directory, LEGS)
    if not os.path.isfile(path):
        return []
    from s2d_jax.readers import read_json
    return _checked_legs(read_json(path, "training run legs"), path)


def keep_legs(directory: str, legs: list[dict]) -> None:
    """The legs of the run now training, beside its checkpoints (process 0)."""
    import json

    from s2d_jax.io.atomic import write_atomic
    from s2d_jax.train.checkpoint import portable
    if jax.process_index() == 0:
        write_atomic(os.path.join(directory, LEGS),
                     json.dumps(portable(legs), indent=1) + "\n")
