"""The committed corpus: the target's on-policy answers as token ids, in compressed shards
with a manifest and checksums, kept in the repository (data/smollm2_corpus/) so that a
fresh clone trains from it with no regeneration.

    DIR/manifest.json              format, target (name, fingerprint, vocab size), runs,
                                   shards (file, run, index, rows, tokens, sha256), totals
    DIR/RUN.prompts.jsonl.xz       a run's prompts in the order its shards answer them
                                   (one JSON string a line, lzma): the run resumes on any
                                   machine from the repository alone
    DIR/RUN-KKKKK.npz              shard K of run RUN: a zip (LZMA, fixed timestamps, so the
                                   same rows give the same bytes) of .npy arrays
                                     ids          [tokens] uint16 (int32 past 65536 ids)
                                     lengths      [rows] int32: each row's prompt + answer
                                     learn_from   [rows] int32: where its answer starts
                                     temperature  [rows] float32: its sampling temperature
                                     prompt       [rows] int32: its line of RUN.prompts

np.load reads a shard (numpy + the standard library's lzma). A run is one plan (prompts,
engine settings, shard size): shard K answers prompts [K * size, (K + 1) * size) of it at
every temperature, seed + K; a rerun of the run writes only the shards the manifest lacks,
and a rerun with another plan under the same run name is refused. Teacher distributions
are never stored: a recipe that needs them recomputes them from the ids
(s2d_jax/data/teacher.py). Nothing the corpus holds is trusted (s2d_jax/data/shard_checks.py):
the manifest's values are checked as flags are, the files it names must be in the corpus
folder, and every shard read has its arrays checked, each problem one error line.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import zipfile

import numpy as np

from s2d_jax.data.shard_checks import (ARRAYS, FORMAT, check_arrays, check_manifest,
                                       check_run_name, ids_dtype, inside, load_shard,
                                       prompts_file, shard_file)
from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import write_atomic
from s2d_jax.readers import read_json, sha256_of

MANIFEST = "manifest.json"
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: shard bytes depend only on rows


def shard_bytes(rows: list[dict], vocab_size: int) -> bytes:
    """Rows {"input_ids", "learn_from", "temperature", "prompt_index"} as a shard's bytes."""
    ids = [i for r in rows for i in r["input_ids"]]
    if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise S2DError(f"a row holds token id {max(ids)} or {min(ids)}, outside the "
                       f"vocabulary of {vocab_size}; generate with the corpus's target")
    arrays = {"ids": np.asarray(ids, ids_dtype(vocab_size)),
              "lengths": np.asarray([len(r["input_ids"]) for r in rows], np.int32),
              "learn_from": np.asarray([r["learn_from"] for r in rows], np.int32),
              "temperature": np.asarray([r["temperature"] for r in rows], np.float32),
              "prompt": np.asarray([r["prompt_index"] for r in rows], np.int32)}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_LZMA) as z:
        for name in ARRAYS:
            npy = io.BytesIO()
            np.save(npy, arrays[name])
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_TIME)
            info.compress_type = zipfile.ZIP_LZMA
            z.writestr(info, npy.getvalue())
    return buf.getvalue()


def prompts_bytes(prompts: list[str]) -> bytes:
    text = "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts)
    return lzma.compress(text.encode(), preset=9)


def _counts(rows: list[dict]) -> dict:
    return {"rows": len(rows),
            "prompt_tokens": int(sum(r["learn_from"] for r in rows)),
            "answer_tokens": int(sum(len(r["input_ids"]) - r["learn_from"] for r in rows))}


def totals(shards: list[dict]) -> dict:
    return {"shards": len(shards), **{key: int(sum(s[key] for s in shards)) for key in
            ("rows", "prompt_tokens", "answer_tokens", "bytes")}}


# --- the manifest ---------------------------------------------------------------------

def new_manifest(target: dict) -> dict:
    """An empty corpus of `target` {"name", "fingerprint", "vocab_size"}."""
    return {"format": FORMAT, "target": target, "runs": {}, "shards": [],
            "totals": totals([])}


def read_manifest(corpus: str) -> dict:
    path = os.path.join(corpus, MANIFEST)
    if not os.path.isfile(path):
        raise S2DError(f"{corpus} is not a corpus (no {MANIFEST}); give the corpus folder, "
                       f"e.g. data/smollm2_corpus")
    # every value checked before any is used: the manifest names the files to open
    return check_manifest(read_json(path, "corpus manifest"), path)


def write_manifest(corpus: str, manifest: dict) -> None:
    manifest["shards"].sort(key=lambda s: (s["run"], s["index"]))
    manifest["totals"] = totals(manifest["shards"])
    write_atomic(os.path.join(corpus, MANIFEST), json.dumps(manifest, indent=1) + "\n")


def check_target(corpus: str, manifest: dict, target: dict) -> None:
    """A corpus holds one target's answers: another target's run is refused."""
    if manifest["target"] != target:
        raise S2DError(f"{corpus} holds answers of target {manifest['target'].get('name')} "
                       f"(fingerprint {str(manifest['target'].get('fingerprint'))[:12]}), "
                       f"this run's target differs; use another corpus folder")


def start_run(corpus: str, target: dict, run: str, plan: dict, prompts: list[str]) -> dict:
    """The manifest with run `run` planned (its prompts written once); -> the manifest.
    A run already there with another plan or target is refused."""
    check_run_name(run)
    os.makedirs(corpus, exist_ok=True)
    exists = os.path.isfile(os.path.join(corpus, MANIFEST))
    manifest = read_manifest(corpus) if exists else new_manifest(target)
    check_target(corpus, manifest, target)
    data = prompts_bytes(prompts)
    plan = {**plan, "prompts": {"file": prompts_file(run), "count": len(prompts),
                                "sha256": hashlib.sha256(data).hexdigest()}}
    old = manifest["runs"].get(run)
    if old is not None and old != plan:
        diff = next((k for k in sorted(set(old) | set(plan)) if old.get(k) != plan.get(k)))
        raise S2DError(f"run {run} of {corpus} was planned with another {diff} "
                       f"({json.dumps(old.get(diff))[:80]}); rerun with its settings to "
                       f"resume it, or name a new run (--run)")
    if old is None:
        write_atomic(os.path.join(corpus, prompts_file(run)), data)
        manifest["runs"][run] = plan
        write_manifest(corpus, manifest)
    else:
        verify_file(corpus, plan["prompts"])
    return manifest


def add_shard(corpus: str, manifest: dict, run: str, k: int, rows: list[dict],
              engine: str | None = None) -> dict:
    """Write shard k of `run` (its file first, then the manifest, each atomically: a kill
    at any point leaves whole shards); -> its record, which names the `engine` that
    answered it when given (a run's shards may come from different engines)."""
    data = shard_bytes(rows, manifest["target"]["vocab_size"])
    name = shard_file(run, k)
    write_atomic(os.path.join(corpus, name), data)
    record = {"file": name, "run": run, "index": k, **_counts(rows), "bytes": len(data),
              "sha256": hashlib.sha256(data).hexdigest(),
              **({"engine": engine} if engine else {})}
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] != name] + [record]
    write_manifest(corpus, manifest)
    return record


def done_shards(manifest: dict, run: str) -> set[int]:
    return {s["index"] for s in manifest["shards"] if s["run"] == run}


# --- reading ---------------------------------------------------------------------------

def verify_file(corpus: str, record: dict) -> str:
    """The path of a manifest record's file, after checking its sha256 (one-line error);
    a symlink leading out of the corpus folder is refused before it is opened."""
    path = inside(corpus, record["file"])
    if not os.path.isfile(path):
        raise S2DError(f"corpus file {path} is missing; restore it with git checkout -- "
                       f"{path} (or git lfs pull)")
    if sha256_of(path) != record["sha256"]:
        raise S2DError(f"corpus file {path} does not match its sha256 in {MANIFEST} "
                       f"(corrupt or changed); restore it with git checkout -- {path}")
    return path


def verify(corpus: str) -> dict:
    """Check every file of the corpus against the manifest (checksums, every shard's
    arrays, every run's prompts), and the totals; -> manifest."""
    manifest = read_manifest(corpus)
    for run in manifest["runs"]:
        _prompts(corpus, manifest, run)
    vocab = manifest["target"]["vocab_size"]
    for record in manifest["shards"]:
        shard_arrays(corpus, record, vocab, _prompt_count(manifest, record))
    if manifest.get("totals") != totals(manifest["shards"]):
        raise S2DError(f"{os.path.join(corpus, MANIFEST)}: its totals disagree with its "
                       f"shards; restore it from git")
    return manifest


def select(manifest: dict, shards: int = 0) -> list[dict]:
    """The first `shards` shard records (0 = all), in manifest order (run, index)."""
    records = manifest["shards"]
    if shards < 0 or shards > len(records):
        raise S2DError(f"the corpus has {len(records)} shards, {shards} asked for; use "
                       f"0 (all) to {len(records)}")
    return records[:shards or len(records)]


def _prompt_count(manifest: dict, record: dict) -> int:
    return manifest["runs"][record["run"]]["prompts"]["count"]


def shard_arrays(corpus: str, record: dict, vocab_size: int,
                 prompts: int | None = None) -> dict:
    """One shard's arrays {name: ndarray}, its checksum and contents checked (one-line
    error naming the shard and the problem: shard_checks.check_arrays)."""
    path = verify_file(corpus, record)
    arrays = load_shard(path)
    check_arrays(path, arrays, record, vocab_size, prompts)
    return arrays


def shard_rows(corpus: str, record: dict, vocab_size: int,
               prompts: int | None = None) -> list[dict]:
    """The token rows {"input_ids", "learn_from", "temperature", "prompt"} of one shard,
    its checksum and contents checked."""
    a = shard_arrays(corpus, record, vocab_size, prompts)
    ends = np.cumsum(a["lengths"], dtype=np.int64)
    starts = ends - a["lengths"]
    return [{"input_ids": a["ids"][s:e].astype(np.int64).tolist(),
             "learn_from": int(lf), "temperature": float(t), "prompt": int(p)}
            for s, e, lf, t, p in zip(starts, ends, a["learn_from"], a["temperature"],
                                      a["prompt"])]


def read_rows(corpus: str, shards: int = 0) -> tuple[list[dict], list[dict]]:
    """(token rows of the first `shards` shards (0 = all), their records): every file
    verified against the manifest."""
    manifest = read_manifest(corpus)
    records = select(manifest, shards)
    vocab = manifest["target"]["vocab_size"]
    return [r for rec in records
            for r in shard_rows(corpus, rec, vocab, _prompt_count(manifest, rec))], records


def read_prompts(corpus: str, run: str) -> list[str]:
    manifest = read_manifest(corpus)
    if run not in manifest["runs"]:
        raise S2DError(f"{corpus} has no run {run}; its runs: {', '.join(manifest['runs'])}")
    return _prompts(corpus, manifest, run)


def _prompts(corpus: str, manifest: dict, run: str) -> list[str]:
    """Run `run`'s prompts, its file's checksum and contents checked (one-line error)."""
    record = manifest["runs"][run]["prompts"]
    path = verify_file(corpus, record)
    try:
        with open(path, "rb") as f:
            text = lzma.decompress(f.read()).decode()
        # "\n" only: json escapes it inside a prompt, but not U+2028 and the other
        # separators str.splitlines would also cut at
        prompts = [json.loads(line) for line in text.split("\n") if line]
    except (lzma.LZMAError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise S2DError(f"corpus file {path} is not a readable prompts file ("
                       f"{type(e).__name__}); restore it with git checkout -- {path}") from None
    if not all(isinstance(p, str) for p in prompts) or len(prompts) != record["count"]:
        raise S2DError(f"corpus file {path} does not hold the {record['count']} prompts "
                       f"(JSON strings) its manifest records; restore it with git checkout "
                       f"-- {path}")
    return prompts


def data_slice(corpus: str, records: list[dict]) -> dict:
    """What a training run read: the corpus, its shards (file, sha256) and token counts."""
    return {"corpus": corpus, "shards": [{"file": r["file"], "sha256": r["sha256"]}
                                         for r in records],
            **{k: v for k, v in totals(records).items() if k not in ("bytes", "shards")}}
