"""Damaged corpora (issue 68): a manifest naming a file outside the corpus folder, a shard
whose checksum matches but whose contents are malformed, manifest values of the wrong
type. Each case must be one S2DError line naming the file and the problem, from
`corpus.verify` and from the readers training uses (corpus.read_rows, the pipeline's
data.format=corpus reader), with no file outside the corpus opened and nothing unpickled.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import shutil
import zipfile
from types import SimpleNamespace

import numpy as np
import pytest

from s2d_jax.data import corpus
from s2d_jax.errors import S2DError

TARGET = {"name": "tiny", "fingerprint": "f" * 64, "vocab_size": 2048}
SHARD = corpus.shard_file("r0", 1)  # the shard every shard case damages


def rows_of(seed: int, n: int = 4) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(0, 2048, int(rng.integers(8, 30))).tolist(),
             "learn_from": 3, "temperature": float(i % 2), "prompt_index": i // 2}
            for i in range(n)]


def arrays_of(rows: list[dict]) -> dict:
    with np.load(io.BytesIO(corpus.shard_bytes(rows, 2048))) as z:
        return {name: z[name] for name in corpus.ARRAYS}


def npz_bytes(arrays: dict) -> bytes:
    """A shard's zip of .npy members, pickled object arrays allowed (as an attacker's)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, a in arrays.items():
            npy = io.BytesIO()
            np.save(npy, a, allow_pickle=True)
            z.writestr(f"{name}.npy", npy.getvalue())
    return buf.getvalue()


def manifest_of(c):
    return json.loads((c / corpus.MANIFEST).read_text())


def put_manifest(c, m):
    """Write a manifest as is (damaged values and all), its totals kept consistent."""
    try:
        m["totals"] = corpus.totals(m["shards"])
    except (TypeError, KeyError, AttributeError, ValueError, OverflowError):
        pass
    (c / corpus.MANIFEST).write_text(json.dumps(m))


def replace_shard(c, data: bytes):
    """Shard 1 becomes `data`, its manifest record updated to match (sha256, bytes): the
    checksum passes, only the contents can tell."""
    (c / SHARD).write_bytes(data)
    m = manifest_of(c)
    m["shards"][1].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    put_manifest(c, m)


def with_arrays(**change):
    """A damage: shard 1's arrays with some replaced (None drops one)."""
    def damage(c, outside):
        a = arrays_of(rows_of(1))
        for name, value in change.items():
            if value is None:
                del a[name]
            else:
                a[name] = value(a) if callable(value) else value
        replace_shard(c, npz_bytes(a))
    return damage


def with_bytes(fn):
    return lambda c, outside: replace_shard(c, fn((c / SHARD).read_bytes()))


def truncated_member() -> bytes:
    """A whole zip whose ids.npy member ends mid-array."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, a in arrays_of(rows_of(1)).items():
            npy = io.BytesIO()
            np.save(npy, a)
            z.writestr(f"{name}.npy", npy.getvalue()[:-10] if name == "ids" else
                       npy.getvalue())
    return buf.getvalue()


def flip_member_byte(data: bytes) -> bytes:
    """A byte of the first member's compressed data changed (the zip's index intact)."""
    data = bytearray(data)
    data[60] ^= 0xFF
    return bytes(data)


def outside_shard(name_of):
    """Shard 1's record names a byte-identical copy outside the corpus (sha256 matches)."""
    def damage(c, outside):
        outside.mkdir(exist_ok=True)
        shutil.copy(c / SHARD, outside / "x.npz")
        m = manifest_of(c)
        m["shards"][1]["file"] = name_of(c, outside)
        put_manifest(c, m)
    return damage


def symlink_out(c, outside):
    outside.mkdir(exist_ok=True)
    shutil.copy(c / SHARD, outside / "x.npz")
    (c / SHARD).unlink()
    os.symlink(outside / "x.npz", c / SHARD)


def in_manifest(fn):
    def damage(c, outside):
        m = manifest_of(c)
        fn(m)
        put_manifest(c, m)
    return damage


def set_record(key, value):
    return in_manifest(lambda m: m["shards"][1].__setitem__(key, value))


class Pwn:
    """Unpickling this creates a file: proof that an object array was loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def pickled(c, outside):
    a = arrays_of(rows_of(1))
    a["temperature"] = np.array([Pwn(str(outside / "pwned"))] * 4, dtype=object)
    replace_shard(c, npz_bytes(a))


def prompts_outside(c, outside):
    outside.mkdir(exist_ok=True)
    shutil.copy(c / corpus.prompts_file("r0"), outside / "p.xz")
    m = manifest_of(c)
    m["runs"]["r0"]["prompts"]["file"] = "../outside/p.xz"
    put_manifest(c, m)


def prompts_not_xz(c, outside):
    data = b'"a"\n"b"\n'
    (c / corpus.prompts_file("r0")).write_bytes(data)
    m = manifest_of(c)
    m["runs"]["r0"]["prompts"]["sha256"] = hashlib.sha256(data).hexdigest()
    put_manifest(c, m)


S = r"r0-00001\.npz"
M = r"manifest\.json"
CASES = [  # (id, damage, what the one error line says)
    # paths leading out of the corpus folder: refused before the file is opened
    ("absolute-path", outside_shard(lambda c, o: str(o / "x.npz")),
     M + r".*shards\[1\]\.file .*outside the corpus folder"),
    ("dot-dot-path", outside_shard(lambda c, o: "../outside/x.npz"),
     M + r".*shards\[1\]\.file .*outside the corpus folder"),
    ("symlink-out", symlink_out, S + r" is a symlink leading outside the corpus folder"),
    # a shard whose checksum matches but whose contents are malformed
    ("missing-array", with_arrays(prompt=None), S + r".*lacks array prompt"),
    ("extra-array", with_arrays(extra=np.zeros(3, np.int32)), S + r".*extra"),
    ("ids-dtype", with_arrays(ids=lambda a: a["ids"].astype(np.int64)),
     S + r".*array ids is int64, not uint16"),
    ("lengths-dtype", with_arrays(lengths=lambda a: a["lengths"].astype(np.float32)),
     S + r".*array lengths is float32, not int32"),
    ("big-endian", with_arrays(lengths=lambda a: a["lengths"].astype(">i4")),
     S + r".*array lengths is >i4, not int32"),
    ("ids-rank", with_arrays(ids=lambda a: a["ids"].reshape(1, -1)),
     S + r".*array ids has 2 dimensions, not 1"),
    ("scalar", with_arrays(prompt=np.int32(0)), S + r".*array prompt has 0 dimensions"),
    ("rows-mismatch", with_arrays(temperature=lambda a: a["temperature"][:-1]),
     S + r".*temperature has 3 rows, lengths 4"),
    ("record-rows", set_record("rows", 5), S + r".*4 rows, its manifest record 5"),
    ("lengths-sum", with_arrays(ids=lambda a: a["ids"][:-1]),
     S + r".*lengths sum to \d+ tokens, ids holds \d+"),
    ("learn-from", with_arrays(learn_from=lambda a: a["lengths"] + 1),
     S + r".*learn_from .*outside"),
    ("ids-vocab", with_arrays(ids=lambda a: np.full_like(a["ids"], 4000)),
     S + r".*token id 4000.*vocabulary of 2048"),
    ("nan-temperature", with_arrays(temperature=lambda a: a["temperature"] * np.nan),
     S + r".*temperature .*finite"),
    ("object-array", pickled, S + r".*array temperature holds Python objects"),
    ("truncated", with_bytes(lambda b: b[:len(b) // 2]), S + r" is not a readable shard"),
    ("not-a-zip", with_bytes(lambda b: b"plain text, not a shard\n"),
     S + r" is not a readable shard"),
    ("truncated-member", lambda c, o: replace_shard(c, truncated_member()),
     S + r" is not a readable shard"),
    ("corrupt-member", with_bytes(flip_member_byte), S + r" is not a readable shard"),
    ("prompt-line", with_arrays(prompt=lambda a: a["prompt"] + 7),
     S + r".*array prompt holds line 8, not a line of the run's 2 prompts"),
    ("bare-npy", with_bytes(lambda b: b"\x93NUMPY" + b[6:]), S + r" is not a readable shard"),
    # manifest values: the same checks as flags get
    ("rows-string", set_record("rows", "4"), M + r".*shards\[1\]\.rows must be an integer"),
    ("rows-nan", set_record("rows", float("nan")),
     M + r".*shards\[1\]\.rows must be an integer, got nan"),
    ("rows-bool", set_record("rows", True), M + r".*shards\[1\]\.rows must be an integer"),
    ("rows-negative", set_record("rows", -1), M + r".*shards\[1\]\.rows must be >= 0"),
    ("index-float", set_record("index", 1.0), M + r".*shards\[1\]\.index must be an integer"),
    ("bytes-inf", set_record("bytes", float("inf")), M + r".*shards\[1\]\.bytes must be an"),
    ("file-int", set_record("file", 7), M + r".*shards\[1\]\.file must be a string"),
    ("sha-short", set_record("sha256", "abc"), M + r".*shards\[1\]\.sha256 .*64 hex"),
    ("other-shard-name", set_record("file", corpus.shard_file("r0", 2)),
     M + r".*shards\[1\]\.file is 'r0-00002\.npz', not r0-00001\.npz"),
    ("unplanned-run", in_manifest(lambda m: m["shards"][1].__setitem__("run", "r9")),
     M + r".*shards\[1\]\.run 'r9' is not a run of the corpus"),
    ("repeated-shard", in_manifest(lambda m: m["shards"].append(dict(m["shards"][1]))),
     M + r".*shards\[3\] repeats r0-00001\.npz"),
    ("shards-dict", in_manifest(lambda m: m.__setitem__("shards", {})),
     M + r".*shards must be a list"),
    ("vocab-inf", in_manifest(lambda m: m["target"].__setitem__("vocab_size", float("inf"))),
     M + r".*target\.vocab_size must be an integer"),
    ("count-nan", in_manifest(lambda m: m["runs"]["r0"]["prompts"].__setitem__(
        "count", float("nan"))), M + r".*runs\.r0\.prompts\.count must be an integer"),
    ("run-name", in_manifest(lambda m: m["runs"].__setitem__("../r1", m["runs"]["r0"])),
     M + r".*run name '\.\./r1'"),
    ("prompts-outside", prompts_outside,
     M + r".*runs\.r0\.prompts\.file .*outside the corpus folder"),
    ("prompts-count", in_manifest(lambda m: m["runs"]["r0"]["prompts"].__setitem__(
        "count", 3)), r"r0\.prompts\.jsonl\.xz does not hold the 3 prompts"),
    ("prompts-not-xz", prompts_not_xz, r"r0\.prompts\.jsonl\.xz is not a readable"),
]


@pytest.fixture
def opened(monkeypatch):
    """Every path opened for reading (builtins.open: sha256, np.load; io.open: zipfile)."""
    seen = []
    real = builtins.open

    def spy(file, mode="r", *a, **kw):
        if isinstance(file, (str, bytes, os.PathLike)) and "r" in mode:
            seen.append(os.path.realpath(file))
        return real(file, mode, *a, **kw)
    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(io, "open", spy)
    return seen


def make_corpus(c):
    manifest = corpus.start_run(str(c), TARGET, "r0", {"seed": 0}, ["a", "b"])
    for k in range(3):
        corpus.add_shard(str(c), manifest, "r0", k, rows_of(k))


def readers(c):
    """What reads a corpus: verify, training's rows (smollm2_draft's head vocabulary, the
    pipeline) and a resumed run's prompts."""
    from s2d_jax.data.pipeline import _corpus_rows
    tok = SimpleNamespace(vocab_size=2048)
    return {"verify": lambda: corpus.verify(str(c)),
            "read_rows": lambda: corpus.read_rows(str(c)),
            "pipeline": lambda: _corpus_rows(str(c), tok, 0, {}),
            "read_prompts": lambda: corpus.read_prompts(str(c), "r0")}


SHARD_READERS = {"verify", "read_rows", "pipeline"}  # a shard's damage: these refuse


@pytest.mark.parametrize("damage,says", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_damaged_corpus_is_one_error_line(tmp_path, opened, damage, says):
    c, outside = tmp_path / "c", tmp_path / "outside"
    make_corpus(c)
    for read in readers(c).values():  # the undamaged corpus reads
        read()
    damage(c, outside)
    opened.clear()
    refusing = (set(readers(c)) if says.startswith(M) else
                {"verify", "read_prompts"} if r"prompts\.jsonl" in says else SHARD_READERS)
    for name, read in readers(c).items():
        if name not in refusing:
            read()  # what the damage does not touch still reads
            continue
        with pytest.raises(S2DError, match=says) as e:
            read()
        assert "\n" not in str(e.value), (name, str(e.value))
    inside = os.path.realpath(c) + os.sep
    assert all(p.startswith(inside) for p in opened), [p for p in opened
                                                       if not p.startswith(inside)]
    assert not (outside / "pwned").exists()  # nothing was unpickled


def test_the_committed_corpus_verifies_and_reads():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "data", "smollm2_corpus")
    m = corpus.verify(path)
    assert m["totals"]["shards"] == len(m["shards"]) > 0
    rows, records = corpus.read_rows(path, 3)
    assert len(rows) == sum(r["rows"] for r in records)
