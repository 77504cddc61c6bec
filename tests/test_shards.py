"""Data-engine stages as shards with a manifest: an interrupted stage (an exception, or
kill -9 in a subprocess) reruns to the output of an uninterrupted one, a complete stage
says so and skips, another plan is refused."""

import json
import os
import subprocess
import sys

import pytest

from s2d_jax.data import shards
from s2d_jax.errors import S2DError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITEMS = [f"prompt {i}" for i in range(10)]


def answer(batch, k):
    """Deterministic per shard (as seed + k makes a sampled one)."""
    return [{"prompt": p, "input_ids": [k, len(p)] * (1 + len(p) % 3)} for p in batch]


def run(out, work=answer, log=None):
    logged = [] if log is None else log
    return shards.run_stage(str(out), "answers", "target-fp", ITEMS, 3, work,
                            tokens=lambda r: len(r["input_ids"]), log=logged.append)


def files(d):
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


def test_an_interrupted_stage_reruns_to_the_uninterrupted_output(tmp_path):
    run(tmp_path / "clean")
    calls = []

    def interrupted(batch, k):
        calls.append(k)
        if k == 2 and calls.count(2) == 1:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the stage
        return answer(batch, k)

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", interrupted)
    assert len(json.loads((tmp_path / "cut" / shards.MANIFEST).read_text())["done"]) == 2
    log = []
    run(tmp_path / "cut", interrupted, log)
    assert calls == [0, 1, 2, 2, 3]  # resumed at shard 2, shards 0 and 1 not recomputed
    assert "2 of 4 shards complete; running 2" in log[0] and "ETA" in log[-1]
    assert files(tmp_path / "cut") == files(tmp_path / "clean")
    assert shards.read_rows(str(tmp_path / "cut"))[-1]["prompt"] == "prompt 9"


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import test_shards
def work(batch, k):
    if k == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return test_shards.answer(batch, k)
test_shards.run({out!r}, work)
"""


def test_a_stage_killed_with_sigkill_reruns_to_the_uninterrupted_output(tmp_path):
    run(tmp_path / "clean")
    out = tmp_path / "killed"
    code = KILLER.format(root=ROOT, tests=os.path.join(ROOT, "tests"), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    (out / shards.shard_name(2)).write_text("half a shard")  # as if killed mid-write
    run(out)
    assert files(out) == files(tmp_path / "clean")


def test_a_complete_stage_says_so_and_skips(tmp_path):
    run(tmp_path)
    log = []

    def never(batch, k):
        raise AssertionError("a complete stage ran work")

    manifest = run(tmp_path, never, log)
    assert log == [f"[answers] all 4 shards complete in {tmp_path}; skipping"]
    assert sum(r["tokens"] for r in manifest["done"].values()) == sum(
        len(r["input_ids"]) for r in shards.read_rows(str(tmp_path)))
    assert manifest["plan"]["items_sha256"] == shards.items_hash(ITEMS)


def test_a_changed_shard_is_recomputed_and_another_plan_refused(tmp_path):
    run(tmp_path)
    before = files(tmp_path)
    (tmp_path / shards.shard_name(1)).write_text("{}\n")
    with pytest.raises(S2DError, match="not a complete stage"):
        shards.read_rows(str(tmp_path))
    run(tmp_path)
    assert files(tmp_path) == before
    with pytest.raises(S2DError, match="another run"):
        shards.run_stage(str(tmp_path), "answers", "other-target", ITEMS, 3, answer)


def with_arrays(batch, k):
    """Rows plus one array per shard (as the teacher stage's states)."""
    import numpy as np
    return answer(batch, k), {"states": np.full((len(batch), 2), k, np.float16)}


def test_a_shards_arrays_are_recorded_verified_and_listed(tmp_path):
    import numpy as np
    manifest = run(tmp_path, with_arrays)
    assert manifest["done"]["1"]["arrays"]["states"]["file"] == shards.array_name(1, "states")
    paths = shards.array_paths(str(tmp_path), "states")
    assert [np.load(p)[0, 0] for p in paths] == [0, 1, 2, 3]
    before = files(tmp_path)
    (tmp_path / shards.array_name(2, "states")).write_bytes(b"half an array")
    with pytest.raises(S2DError, match="not a complete stage"):
        shards.array_paths(str(tmp_path), "states")
    log = []
    run(tmp_path, with_arrays, log)  # only shard 2 is recomputed
    assert "3 of 4 shards complete; running 1" in log[0] and files(tmp_path) == before
