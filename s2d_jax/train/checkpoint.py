"""Training checkpoints: orbax CheckpointManager holding the train state and the data state.

Each step directory has two items: `state` (step, params, optimizer state; restored
straight onto the mesh from abstract arrays carrying shardings) and `data` (the batch
iterator's JSON state), so a resumed run continues with the next unseen batch.

With several processes every host reads its own share of the data, so each one writes
and reads its own iterator state, `data/process_<i>-of-<n>.json` (grain's file names);
orbax's JSON handler writes on the primary host only and would hand every host host 0's
place in the data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import orbax.checkpoint as ocp

from s2d_jax.errors import S2DError

_HOST_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")
# The single file of orbax's JSON handler, which held the data state before it was kept
# per process; read as a 1-process state, since it holds host 0's only.
_LEGACY_FILE = "metadata"


def host_file(index: int, count: int) -> str:
    return f"process_{index}-of-{count}.json"


@dataclasses.dataclass
class SavedDataState:
    process_count: int  # processes of the run that saved it
    state: dict  # this process's state, or process 0's when the counts differ


class HostDataHandler(ocp.CheckpointHandler):
    """Every process saves and restores its own iterator state."""

    def save(self, directory, args):
        name = host_file(jax.process_index(), jax.process_count())
        (directory / name).write_text(json.dumps(args.state))

    def restore(self, directory, args=None) -> SavedDataState:
        own = directory / host_file(jax.process_index(), jax.process_count())
        if own.exists():
            return SavedDataState(jax.process_count(), json.loads(own.read_text()))
        counts = {int(m.group(2)) for p in directory.iterdir()
                  if (m := _HOST_FILE.fullmatch(p.name))}
        if counts:
            count = min(counts)
            return SavedDataState(count, json.loads((directory / host_file(0, count)).read_text()))
        legacy = directory / _LEGACY_FILE
        if legacy.exists():
            return SavedDataState(1, json.loads(legacy.read_text()))
        raise S2DError(f"checkpoint item {directory} holds no data state; resume from another "
                       f"checkpoint.dir or remove this step's directory")

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(HostDataHandler, for_save=True)
@dataclasses.dataclass
class HostDataSave(ocp.args.CheckpointArgs):
    state: dict


@ocp.args.register_with_handler(HostDataHandler, for_restore=True)
@dataclasses.dataclass
class HostDataRestore(ocp.args.CheckpointArgs):
    pass


def make_manager(directory: str, keep_last: int, async_save: bool = False):
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise S2DError(f"checkpoint.dir {directory} exists and is not a directory; pick another")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep_last, create=True,
                                           enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "data"))


def save(manager, step: int, state, data_state: dict) -> None:
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               data=HostDataSave(data_state)))


def restore_latest(manager, abstract_state, data_per_process: bool = True):
    """(state, data_state, step) of the latest checkpoint, or None when there is none.

    `data_per_process`: the data state depends on which share of the data a process reads,
    so a checkpoint of another process count cannot continue it (refused, before the
    train state is read). Synthetic batches are global: any process count resumes them.
    """
    step = manager.latest_step()
    if step is None:
        return None
    data = manager.restore(step, args=ocp.args.Composite(data=HostDataRestore()))["data"]
    if data_per_process and data.process_count != jax.process_count():
        raise S2DError(
            f"checkpoint step {step} in {manager.directory} was written by "
            f"{data.process_count} process(es), this run has {jax.process_count()}: each "
            f"process reads its own share of data.paths, so the data order cannot continue; "
            f"resume with {data.process_count} process(es), or start a new checkpoint.dir")
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))
    return out["state"], data.state, step


PLAN = "run_plan.json"
# TrainConfig fields that do not change what the steps compute (where outputs go, how often
# they are written, the mesh the same numbers are sharded over)
_NOT_IN_PLAN = ("checkpoint", "metrics_path", "log_every", "export_dir", "export_overwrite",
                "stop_after_step", "stop_after_minutes", "mesh")


def run_plan(tc, data_slice=None) -> dict:
    """Every setting of a training run that changes its steps' results, as JSON; with the
    slice of a committed corpus it reads (pipeline's stats["data_slice"]) summarised as
    each corpus's shard count, token counts and one sha256 over its shards' sha256s (a
    grown or changed corpus is other data)."""
    import hashlib
    plan = {k: v for k, v in dataclasses.asdict(tc).items() if k not in _NOT_IN_PLAN}
    if not plan["model"]["init_from"]:  # off: the plans of runs made before it existed
        del plan["model"]["init_from"]
    del plan["model"]["continue_from"]  # where this run's progress is kept, not what it is
    if data_slice:
        plan["data_slice"] = [
            {**{k: v for k, v in s.items() if k != "shards"}, "shards": len(s["shards"]),
             "shards_sha256": hashlib.sha256("".join(
                 f"{x['file']}:{x['sha256']}\n" for x in s["shards"]).encode()).hexdigest()}
            for s in data_slice]
    return portable(json.loads(json.dumps(plan)))


def portable(value):
    """`value` (a plan or any JSON in it) with every path under this user's home written as
    ~/...: the target, tokenizer and work files live under ~/.cache, and a run continued on a
    machine whose home is another dir (a new session's, another user's) is the same run."""
    home = os.path.expanduser("~").rstrip("/")
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, str) and home and (value == home or value.startswith(home + "/")):
        return "~" + value[len(home):]
    return value


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def plan_difference(was: dict, now: dict) -> tuple[str, object, object] | None:
    """(setting, its value in `was`, in `now`) of the first setting (dotted, in sorted
    order) two run plans disagree on; None when they are the same plan."""
    # portable on both sides: plans written before paths were (absolute /root/...) still match
    was, now = _flat(portable(was)), _flat(portable(json.loads(json.dumps(now))))
    for key in sorted(set(was) | set(now)):
        if was.get(key) != now.get(key):
            return key, was.get(key), now.get(key)
    return None


def check_run_plan(directory: str, plan: dict, has_checkpoint: bool) -> None:
    """A run resumes only with the settings its checkpoints were made with (directory's
    run_plan.json, written when the first run starts): another lr, data or draft would
    silently continue one run as another. A checkpoint dir without a plan (made before
    plans were recorded) resumes as before."""
    from s2d_jax.io.atomic import write_atomic
    from s2d_jax.readers import read_json
    path = os.path.join(directory, PLAN)
    if has_checkpoint and os.path.exists(path):
        old = read_json(path, "training run plan")
        diff = plan_difference(old if isinstance(old, dict) else {}, plan)
        if diff:
            key, was, now = diff
            raise S2DError(f"checkpoint.dir {directory} holds a run made with {key}="
                           f"{was!r}, this config has {key}={now!r}; "
                           f"resume with the same settings, or use a new checkpoint.dir")
    elif not has_checkpoint and jax.process_index() == 0:
        write_atomic(path, json.dumps(plan, indent=1, sort_keys=True) + "\n")
