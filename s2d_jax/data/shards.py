"""A data-engine stage's output as JSON-lines shards with a manifest: resumable after any
interruption, idempotent, and skipped once complete.

A stage maps a fixed list of items (prompts, documents) to rows, `shard_size` items per
shard; shard k's rows may depend only on its items and k (seed + k for sampling), so a
shard computed twice is the same shard. DIR/manifest.json holds the plan ("what", the
target's fingerprint, the items' hash, shard size and count: a rerun with another plan is
refused, not mixed in) and one record per finished shard (file, rows, tokens, sha256).
A shard may carry numpy arrays beside its rows (the target's states of its rows):
`work` then returns (rows, {name: array}), each array is written as its own .npy file
and recorded with its hash in the shard's record. Each file is written atomically and
only then recorded, so a kill at any point leaves whole shards; a rerun verifies the recorded ones, recomputes the rest and, when
every shard is already recorded, says so and does nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time

import numpy as np

from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import write_atomic
from s2d_jax.readers import read_json, sha256_of

MANIFEST = "manifest.json"


def items_hash(items) -> str:
    """sha256 of the items as canonical JSON: which prompts a stage was run on."""
    return hashlib.sha256(json.dumps(list(items), sort_keys=True).encode()).hexdigest()


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.jsonl"


def array_name(k: int, name: str) -> str:
    return f"shard-{k:05d}.{name}.npy"


def _write_arrays(out_dir: str, k: int, arrays: dict) -> dict:
    """Each array as an atomically written .npy file -> {name: {"file", "sha256"}}."""
    records = {}
    for name, array in sorted(arrays.items()):
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(array))
        write_atomic(os.path.join(out_dir, array_name(k, name)), buf.getvalue())
        records[name] = {"file": array_name(k, name),
                         "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    return records


def _plan(what: str, target: str, items, shard_size: int, settings: dict | None) -> dict:
    if shard_size < 1:
        raise S2DError(f"shard size must be >= 1, got {shard_size}")
    plan = {"what": what, "target": target, "items": len(items), "items_sha256":
            items_hash(items), "shard_size": shard_size,
            "shards": -(-len(items) // shard_size), "settings": settings or {}}
    return json.loads(json.dumps(plan))  # as a manifest reads back (tuples are lists)


def _difference(old, plan: dict) -> str:
    """What differs between a stored plan and this run's, in the user's words."""
    if not isinstance(old, dict):
        return f"its {MANIFEST} has no readable plan"
    was, now = old.get("settings"), plan["settings"]
    if isinstance(was, dict):
        for key in sorted(set(was) | set(now)):
            if was.get(key) != now.get(key):
                return (f"it was made with {key} {was.get(key, '(not recorded)')}, this run "
                        f"asks for {key} {now.get(key, '(none)')}")
    elif now:
        return "it records none of the settings this run asks for (made by an older version)"
    for key, words in (("what", "the stage"), ("target", "the target (its fingerprint)"),
                       ("items_sha256", "the items (prompts, answers or documents)"),
                       ("shard_size", "the shard size")):
        if old.get(key) != plan[key]:
            return f"{words} differ"
    return "its plan differs"


def _read_manifest(out_dir: str, plan: dict) -> dict:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return {"plan": plan, "done": {}}
    manifest = read_json(path, "stage manifest")
    if (not isinstance(manifest, dict) or manifest.get("plan") != plan
            or not isinstance(manifest.get("done"), dict)):
        old = manifest.get("plan") if isinstance(manifest, dict) else None
        raise S2DError(f"{out_dir} holds shards of another run ({_difference(old, plan)}); "
                       f"rerun with the settings it was made with to resume, or use a new "
                       f"directory (or delete this one)")
    return manifest


def _inside(out_dir: str, name: str) -> bool:
    """Whether file `name` of a stage is in its folder, a symlink leading out excluded:
    a record is never trusted to name another file to read."""
    path = os.path.realpath(os.path.join(out_dir, name))
    return os.path.dirname(path) == os.path.realpath(out_dir) and os.path.isfile(path)


def _verified(out_dir: str, k: str, record) -> bool:
    """Whether shard k's record is well formed, names the files the stage writes (in its
    folder, checked before any is opened) and they hold the bytes recorded."""
    if not (isinstance(record, dict) and k.isdigit() and record.get("file") == shard_name(int(k))
            and isinstance(record.get("sha256"), str)
            and all(isinstance(record.get(n), int) and not isinstance(record.get(n), bool)
                    for n in ("rows", "tokens"))):
        return False
    arrays = record.get("arrays") or {}
    if not (isinstance(arrays, dict) and all(
            isinstance(f, dict) and f.get("file") == array_name(int(k), name)
            for name, f in arrays.items())):
        return False
    files = [record, *arrays.values()]
    return all(_inside(out_dir, f["file"])
               and sha256_of(os.path.join(out_dir, f["file"])) == f.get("sha256")
               for f in files)


def _shard_rows(out_dir: str, k: int) -> list[dict]:
    """The rows of verified shard k (one-line error when its bytes, though recorded, are
    not JSON-lines objects: a record written by hand, or for other bytes)."""
    path = os.path.join(out_dir, shard_name(k))
    with open(path, "rb") as f:
        data = f.read()
    fix = "delete it and rerun the stage to recompute it"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise S2DError(f"stage shard {path} is not UTF-8 text (offset {e.start}); "
                       f"{fix}") from None
    rows = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise S2DError(f"stage shard {path} line {n} is not valid JSON ({e.msg}); "
                           f"{fix}") from None
        if not isinstance(row, dict):
            raise S2DError(f"stage shard {path} line {n} is not a JSON object; {fix}")
        rows.append(row)
    return rows


def run_stage(out_dir: str, what: str, target: str, items: list, shard_size: int, work,
              tokens=lambda row: 0, log=print, settings: dict | None = None) -> dict:
    """Run `work(shard_items, k) -> rows` (JSON-serialisable dicts) or (rows, {name:
    array}) for every shard not yet complete in out_dir; -> the manifest. `tokens(row)`
    counts a row's supervised tokens. `settings` {flag: value}: every argument besides the
    items that changes what `work` writes; a resume with other settings is refused."""
    plan = _plan(what, target, items, shard_size, settings)
    manifest = _read_manifest(out_dir, plan)
    done = {k: r for k, r in manifest["done"].items() if _verified(out_dir, k, r)}
    todo = [k for k in range(plan["shards"]) if str(k) not in done]
    if not todo:
        log(f"[{what}] all {plan['shards']} shards complete in {out_dir}; skipping")
        return manifest
    log(f"[{what}] {len(done)} of {plan['shards']} shards complete; running {len(todo)}")
    start = time.perf_counter()
    for n, k in enumerate(todo, 1):
        out = work(items[k * shard_size:(k + 1) * shard_size], k)
        rows, arrays = out if isinstance(out, tuple) else (out, {})
        # arrays first: a shard's record is written after all of its files
        arrays = _write_arrays(out_dir, k, arrays) if arrays else None
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
        write_atomic(os.path.join(out_dir, shard_name(k)), data)
        done[str(k)] = {"file": shard_name(k), "rows": len(rows),
                        "tokens": int(sum(tokens(r) for r in rows)),
                        "sha256": hashlib.sha256(data).hexdigest(),
                        **({"arrays": arrays} if arrays else {})}
        # in shard order: the manifest of a resumed stage is the uninterrupted one's
        manifest["done"] = dict(sorted(done.items(), key=lambda kv: int(kv[0])))
        write_atomic(os.path.join(out_dir, MANIFEST), json.dumps(manifest, indent=1))
        elapsed = time.perf_counter() - start
        log(f"[{what}] shard {len(done)}/{plan['shards']}: "
            f"{sum(r['tokens'] for r in done.values())} tokens, ETA "
            f"{elapsed / n * (len(todo) - n):.0f} s")
    return manifest


def read_rows(out_dir: str) -> list[dict]:
    """Every row of a complete stage, in shard order."""
    shards = _complete(out_dir)["plan"]["shards"]
    return [row for k in range(shards) for row in _shard_rows(out_dir, k)]


def array_paths(out_dir: str, name: str) -> list[str]:
    """The .npy files of array `name` of a complete stage, in shard order."""
    done = _complete(out_dir)["done"]
    return [os.path.join(out_dir, done[str(k)]["arrays"][name]["file"])
            for k in range(len(done))]


def _complete(out_dir: str) -> dict:
    """The manifest of a complete stage (every shard recorded and verified)."""
    path = os.path.join(out_dir, MANIFEST)
    manifest = read_json(path, "stage manifest") if os.path.exists(path) else {}
    plan, done = (manifest.get("plan"), manifest.get("done")) if isinstance(manifest, dict) \
        else (None, None)
    shards = plan.get("shards") if isinstance(plan, dict) else None
    if not (isinstance(shards, int) and isinstance(done, dict)
            and all(_verified(out_dir, str(k), done.get(str(k))) for k in range(shards))):
        raise S2DError(f"{out_dir} is not a complete stage; rerun the stage to finish it")
    return manifest


def prefix_rows(out_dir: str):
    """Yield the rows of a stage's first shards, in order, up to its first shard not yet
    recorded (or not verified): what a stage still running has finished, read while it
    writes (its manifest is replaced atomically)."""
    path = os.path.join(out_dir, MANIFEST)
    manifest = read_json(path, "stage manifest") if os.path.exists(path) else {}
    done = manifest.get("done") if isinstance(manifest, dict) else None
    k = 0
    while isinstance(done, dict) and _verified(out_dir, str(k), done.get(str(k))):
        yield from _shard_rows(out_dir, k)
        k += 1
