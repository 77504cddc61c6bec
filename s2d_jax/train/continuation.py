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
