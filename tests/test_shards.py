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


# --- a manifest or shard that is not what the stage wrote (issue 68) -------------------

def _record(out, change):
    path = out / shards.MANIFEST
    m = json.loads(path.read_text())
    change(m["done"]["1"])
    path.write_text(json.dumps(m))


def _outside_array(how):
    """Shard 1's array record names a byte-identical copy outside the stage folder."""
    def damage(out, outside):
        import shutil
        shutil.copy(out / shards.array_name(1, "states"), outside / "x.npy")
        name = {"absolute": str(outside / "x.npy"), "dot-dot": "../outside/x.npy"}.get(how)
        if name:
            _record(out, lambda r: r["arrays"]["states"].__setitem__("file", name))
        else:  # a symlink in the stage folder leading out
            os.unlink(out / shards.array_name(1, "states"))
            os.symlink(outside / "x.npy", out / shards.array_name(1, "states"))
    return damage


@pytest.mark.parametrize("how", ["absolute", "dot-dot", "symlink"])
def test_a_record_naming_a_file_outside_the_stage_is_never_opened(tmp_path, monkeypatch, how):
    import builtins
    out, outside = tmp_path / "s", tmp_path / "outside"
    outside.mkdir()
    run(out, with_arrays)
    _outside_array(how)(out, outside)
    seen, real_open = [], builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **kw: (
        seen.append(os.path.realpath(f)), real_open(f, *a, **kw))[1])
    with pytest.raises(S2DError, match="not a complete stage"):
        shards.array_paths(str(out), "states")
    log = []
    run(out, with_arrays, log)  # the record is not trusted: shard 1 is recomputed
    assert "3 of 4 shards complete; running 1" in log[0]
    assert not any(p.startswith(str(outside)) for p in seen), seen
    assert os.path.realpath(shards.array_paths(str(out), "states")[1]) == \
        str(out / shards.array_name(1, "states"))


@pytest.mark.parametrize("data,says", [
    (b"not json\n", "line 1 is not valid JSON"), (b"[1, 2]\n", "line 1 is not a JSON object"),
    (b'{"a": 1}\n\xff\xfe\n', "is not UTF-8 text")], ids=["not-json", "not-object", "bytes"])
def test_a_malformed_shard_with_its_checksum_is_one_error_line(tmp_path, data, says):
    import hashlib
    run(tmp_path)
    (tmp_path / shards.shard_name(1)).write_bytes(data)
    _record(tmp_path, lambda r: r.__setitem__("sha256", hashlib.sha256(data).hexdigest()))
    for read in (shards.read_rows, lambda d: list(shards.prefix_rows(d))):
        with pytest.raises(S2DError, match=f"shard-00001.jsonl {says}.*rerun") as e:
            read(str(tmp_path))
        assert "\n" not in str(e.value)
