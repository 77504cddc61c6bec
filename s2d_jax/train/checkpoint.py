"""Training checkpoints: orbax CheckpointManager holding the train state and the data state.

Each step directory has two items: `state` (step, params, optimizer state; restored
straight onto the mesh from abstract arrays carrying shardings) and `data` (the batch
iterator's JSON state), so a resumed run continues with the next unseen batch.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp

from s2d_jax.errors import S2DError


def make_manager(directory: str, keep_last: int, async_save: bool = False):
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise S2DError(f"checkpoint.dir {directory} exists and is not a directory; pick another")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep_last, create=True,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))


def save(manager, step: int, state, data_state: dict) -> None:
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               data=ocp.args.JsonSave(data_state)))


def restore_latest(manager, abstract_state):
    """(state, data_state, step) of the latest checkpoint, or None when there is none."""
    step = manager.latest_step()
    if step is None:
        return None
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return out["state"], out["data"], step
