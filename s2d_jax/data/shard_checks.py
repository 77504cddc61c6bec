"""Checks of a committed corpus (s2d_jax/data/corpus.py) that trust nothing it holds
(issue 68): its manifest's values get the checks a flag's value gets (s2d_jax/validate.py),
every file it names must be a plain name inside the corpus folder (refused before it is
opened), and a shard's arrays are checked for their names, dtypes, ranks and agreement
whenever one is read, so that a file whose checksum matches but whose contents do not is
one error line, never a KeyError / ValueError traceback in a reader or in training.
"""

from __future__ import annotations

import lzma
import os
import re
import zipfile
import zlib

import numpy as np

from s2d_jax import validate
from s2d_jax.errors import S2DError

FORMAT = "s2d-corpus/1"
ARRAYS = ("ids", "lengths", "learn_from", "temperature", "prompt")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RUN = re.compile(r"[A-Za-z0-9_]+")
_COUNTS = ("rows", "prompt_tokens", "answer_tokens", "bytes")
# what a shard that is no zip of .npy files raises (a checksum recorded for the wrong
# bytes, or a file made elsewhere): each becomes one error line naming the shard
_UNREADABLE = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, lzma.LZMAError,
               zlib.error, NotImplementedError, RuntimeError)


def shard_file(run: str, k: int) -> str:
    return f"{run}-{k:05d}.npz"


def prompts_file(run: str) -> str:
    return f"{run}.prompts.jsonl.xz"


def ids_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.int32


def check_run_name(run, flag: str = "--run") -> str:
    """A run name is part of file names: letters, digits and _ keep them in the folder."""
    if not isinstance(run, str) or not _RUN.fullmatch(run):
        raise S2DError(f"{flag} {run!r} must be letters, digits and _ (it names the run's "
                       f"files); e.g. --run magpie0")
    return run


# --- the manifest ----------------------------------------------------------------------

class _Manifest:
    """Checks of one manifest's values, each error naming the manifest and the value."""

    def __init__(self, path: str):
        self.path = path

    def bad(self, where: str, problem: str) -> S2DError:
        return S2DError(f"{self.path}: {where} {problem}; restore it from git (git checkout "
                        f"-- {self.path})")

    def value(self, check, value, where: str, **kw):
        if value is None:
            raise self.bad(where, "is missing")
        try:
            return check(value, where, **kw)
        except S2DError as e:  # the flag's wording of the problem, this file's fix
            raise S2DError(f"{self.path}: {str(e).split('; ')[0]}; restore it from git "
                           f"(git checkout -- {self.path})") from None

    def dict(self, value, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.bad(where, f"must be a JSON object, got {type(value).__name__}")
        return value

    def sha256(self, value, where: str) -> None:
        if value is None:
            raise self.bad(where, "is missing")
        if not (isinstance(value, str) and _SHA256.fullmatch(value)):
            raise self.bad(where, f"is {str(value)[:20]!r}, not a sha256 (64 hex digits)")

    def file(self, value, where: str, expected: str) -> None:
        """A file's name: a plain name inside the corpus folder, the one its role gives."""
        self.value(validate.text, value, where)
        if os.path.isabs(value) or os.sep in value or "/" in value or value in (".", ".."):
            raise self.bad(where, f"{value[:80]!r} leads outside the corpus folder (a "
                                  f"corpus's files are plain names in its folder)")
        if value != expected:
            raise self.bad(where, f"is {value[:80]!r}, not {expected}")


def check_manifest(m, path: str) -> dict:
    """A corpus manifest read from `path`, every value checked; -> it."""
    c = _Manifest(path)
    if not (isinstance(m, dict) and m.get("format") == FORMAT):
        raise S2DError(f"{path} is not an {FORMAT} manifest; restore it from git "
                       f"(git checkout -- {path})")
    target = c.dict(m.get("target"), "target")
    c.value(validate.integer, target.get("vocab_size"), "target.vocab_size", lo=1)
    runs = c.dict(m.get("runs"), "runs")
    for run, plan in runs.items():
        if not _RUN.fullmatch(run):
            raise c.bad("runs", f"holds run name {run[:80]!r}: not letters, digits and _")
        prompts = c.dict(c.dict(plan, f"runs.{run}").get("prompts"), f"runs.{run}.prompts")
        c.file(prompts.get("file"), f"runs.{run}.prompts.file", prompts_file(run))
        c.sha256(prompts.get("sha256"), f"runs.{run}.prompts.sha256")
        c.value(validate.integer, prompts.get("count"), f"runs.{run}.prompts.count", lo=0)
    shards = m.get("shards")
    if not isinstance(shards, list):
        raise c.bad("shards", f"must be a list, got {type(shards).__name__}")
    seen = set()
    for i, r in enumerate(shards):
        where = f"shards[{i}]"
        c.dict(r, where)
        run = c.value(validate.text, r.get("run"), f"{where}.run")
        if run not in runs:
            raise c.bad(f"{where}.run", f"{run[:80]!r} is not a run of the corpus")
        k = c.value(validate.integer, r.get("index"), f"{where}.index", lo=0)
        for key in _COUNTS:
            c.value(validate.integer, r.get(key), f"{where}.{key}", lo=0)
        c.sha256(r.get("sha256"), f"{where}.sha256")
        c.file(r.get("file"), f"{where}.file", shard_file(run, k))
        if r["file"] in seen:
            raise c.bad(where, f"repeats {r['file']} (a shard is recorded once)")
        seen.add(r["file"])
    return m


# --- the files --------------------------------------------------------------------------

def inside(corpus: str, name: str) -> str:
    """The path of file `name` of the corpus (a plain name: check_manifest), refused when
    it is a symlink leading outside the corpus folder; nothing is opened."""
    path = os.path.join(corpus, name)
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(corpus):
        raise S2DError(f"corpus file {path} is a symlink leading outside the corpus folder "
                       f"(to {real}); restore the file itself with git checkout -- {path}")
    return path


def _unreadable(path: str, why: str) -> S2DError:
    return S2DError(f"corpus shard {path} is not a readable shard ({why}); restore it with "
                    f"git checkout -- {path}")


def _malformed(path: str, problem: str) -> S2DError:
    return S2DError(f"corpus shard {path}: {problem}; restore it with git checkout -- {path}")


def load_shard(path: str) -> dict:
    """A shard's arrays {name: ndarray}: exactly the ARRAYS, each an .npy member read
    without unpickling (allow_pickle=False: a shard holds numbers, never objects)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            want = [f"{n}.npy" for n in ARRAYS]
            missing = [n for n in ARRAYS if f"{n}.npy" not in names]
            if missing:
                raise _malformed(path, f"it lacks array {', '.join(missing)} (a shard holds "
                                       f"{', '.join(ARRAYS)})")
            if sorted(names) != sorted(want):
                extra = sorted(set(names) - set(want)) or ["a repeated member"]
                raise _malformed(path, f"it holds {', '.join(extra)[:80]} besides "
                                       f"{', '.join(ARRAYS)}")
            arrays = {}
            for name in ARRAYS:
                with z.open(f"{name}.npy") as f:
                    try:
                        arrays[name] = np.lib.format.read_array(f, allow_pickle=False)
                    except ValueError as e:
                        if "allow_pickle" not in str(e):
                            raise
                        raise _malformed(path, f"array {name} holds Python objects (a "
                                               f"pickle), which are never loaded") from None
    except _UNREADABLE as e:
        raise _unreadable(path, f"{type(e).__name__}: {str(e)[:80]}") from None
    return arrays


def check_arrays(path: str, a: dict, record: dict, vocab_size: int,
                 prompts: int | None = None) -> None:
    """A shard's arrays against the format and its manifest record (one-line error):
    names, dtypes, ranks, one entry per row in each row array, lengths that sum to the
    ids, answers that start inside their rows, ids inside the vocabulary, finite
    temperatures, prompt lines the run has, and the record's counts."""
    dtypes = {"ids": np.dtype(ids_dtype(vocab_size)), "lengths": np.dtype(np.int32),
              "learn_from": np.dtype(np.int32), "temperature": np.dtype(np.float32),
              "prompt": np.dtype(np.int32)}
    for name, dtype in dtypes.items():
        if a[name].dtype != dtype:  # dtype ==: byte order counts (">i4" is not int32)
            raise _malformed(path, f"array {name} is {a[name].dtype}, not {dtype}")
        if a[name].ndim != 1:
            raise _malformed(path, f"array {name} has {a[name].ndim} dimensions, not 1")
    rows = len(a["lengths"])
    for name in ("learn_from", "temperature", "prompt"):
        if len(a[name]) != rows:
            raise _malformed(path, f"array {name} has {len(a[name])} rows, lengths {rows}")
    if rows != record["rows"]:
        raise _malformed(path, f"it holds {rows} rows, its manifest record {record['rows']}")
    lengths = a["lengths"].astype(np.int64)
    learn = a["learn_from"].astype(np.int64)
    if rows and lengths.min() < 0:
        raise _malformed(path, f"array lengths holds {lengths.min()}, a negative length")
    if int(lengths.sum()) != len(a["ids"]):
        raise _malformed(path, f"its lengths sum to {int(lengths.sum())} tokens, ids holds "
                               f"{len(a['ids'])}")
    if rows and (learn.min() < 0 or np.any(learn > lengths)):
        raise _malformed(path, "array learn_from holds an answer start outside its row")
    ids = a["ids"]
    if len(ids) and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise _malformed(path, f"it holds token id {bad}, outside the vocabulary of "
                               f"{vocab_size}")
    t = a["temperature"]
    if rows and not (np.all(np.isfinite(t)) and t.min() >= 0):
        raise _malformed(path, "array temperature holds a value that is not a finite "
                               "number >= 0")
    p = a["prompt"]
    if rows and (p.min() < 0 or (prompts is not None and p.max() >= prompts)):
        raise _malformed(path, f"array prompt holds line {p.min() if p.min() < 0 else p.max()}"
                               f", not a line of the run's {prompts} prompts")
    counts = {"prompt_tokens": int(learn.sum()), "answer_tokens": int((lengths - learn).sum())}
    for key, n in counts.items():
        if n != record[key]:
            raise _malformed(path, f"its rows hold {n} {key.replace('_', ' ')}, its manifest "
                                   f"record {record[key]}")
