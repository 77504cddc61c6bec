"""The data state in training checkpoints: one file per process, and a resume with another
process count is refused for per-process data (real files) but not for global synthetic
batches."""

import json

import jax
import numpy as np
import pytest

from s2d_jax.errors import S2DError
from s2d_jax.train import checkpoint as ckpt

STATE = {"w": np.arange(3, dtype=np.float32)}
ABSTRACT = {"w": jax.ShapeDtypeStruct((3,), np.float32)}


def _saved(tmp_path, data_state):
    manager = ckpt.make_manager(str(tmp_path / "ck"), keep_last=2)
    ckpt.save(manager, 4, STATE, data_state)
    manager.wait_until_finished()
    return manager, tmp_path / "ck" / "4" / "data"


def test_each_process_saves_and_restores_its_own_data_state(tmp_path):
    manager, data = _saved(tmp_path, {"next_index": 66})
    assert [p.name for p in data.glob("*.json")] == ["process_0-of-1.json"]
    state, data_state, step = ckpt.restore_latest(manager, ABSTRACT)
    assert step == 4 and data_state == {"next_index": 66}
    assert np.array_equal(state["w"], STATE["w"])


def _as_two_process_checkpoint(data):
    """What two hosts at different places in their shares leave behind."""
    (data / "process_0-of-1.json").rename(data / "process_0-of-2.json")
    (data / "process_1-of-2.json").write_text(json.dumps({"next_index": 65}))


def test_another_process_count_is_refused_for_per_process_data(tmp_path):
    manager, data = _saved(tmp_path, {"next_index": 66})
    _as_two_process_checkpoint(data)
    with pytest.raises(S2DError, match=r"step 4 .* written by 2 process\(es\), this run has 1"):
        ckpt.restore_latest(manager, ABSTRACT, data_per_process=True)


def test_global_data_state_resumes_with_any_process_count(tmp_path):
    manager, data = _saved(tmp_path, {"batch_index": 4})
    _as_two_process_checkpoint(data)
    (data / "process_1-of-2.json").write_text(json.dumps({"batch_index": 4}))
    _, data_state, _ = ckpt.restore_latest(manager, ABSTRACT, data_per_process=False)
    assert data_state == {"batch_index": 4}


def test_checkpoint_of_the_single_json_file_format_still_resumes(tmp_path):
    """Older checkpoints kept host 0's data state in orbax's JSON file only."""
    manager, data = _saved(tmp_path, {"next_index": 7})
    (data / "process_0-of-1.json").rename(data / "metadata")
    assert ckpt.restore_latest(manager, ABSTRACT)[1] == {"next_index": 7}
