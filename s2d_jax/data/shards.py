"""A data-engine stage's output as JSON-lines shards with a manifest: resumable after any
interruption, idempotent, and skipped once complete.

A stage maps a fixed list of items (prompts, documents) to rows, `shard_size` items per
shard; shard k's rows may depend only on its items and k (seed + k for sampling), so a
shard computed twice is the same shard. DIR/manifest.json holds the plan ("what", the
target's fingerprint, the items' hash, shard size and count: a rerun with another plan is
refused, not mixed in) and one record per finished shard (file, rows, tokens, sha256).
Each shard file is written atomically and only then recorded, so a kill at any point
leaves whole shards; a rerun verifies the recorded ones, recomputes the rest and, when
every shard is already recorded, says so and does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from s2d_jax.errors import S2DError
from s2d_jax.io.atomic import write_atomic
from s2d_jax.readers import read_json, sha256_of

MANIFEST = "manifest.json"


def items_hash(items) -> str:
    """sha256 of the items as canonical JSON: which prompts a stage was run on."""
    return hashlib.sha256(json.dumps(list(items), sort_keys=True).encode()).hexdigest()


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.jsonl"


def _plan(what: str, target: str, items, shard_size: int) -> dict:
    if shard_size < 1:
        raise S2DError(f"shard size must be >= 1, got {shard_size}")
    return {"what": what, "target": target, "items": len(items), "items_sha256":
            items_hash(items), "shard_size": shard_size,
            "shards": -(-len(items) // shard_size)}


def _read_manifest(out_dir: str, plan: dict) -> dict:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return {"plan": plan, "done": {}}
    manifest = read_json(path, "stage manifest")
    if (not isinstance(manifest, dict) or manifest.get("plan") != plan
            or not isinstance(manifest.get("done"), dict)):
        raise S2DError(f"{out_dir} holds shards of another run ({MANIFEST}'s plan differs: "
                       f"what, target, prompts or shard size); use a new directory or delete "
                       f"this one")
    return manifest


def _verified(out_dir: str, k: str, record) -> bool:
    """Whether shard k's record is well formed and its file holds the bytes recorded."""
    if not (isinstance(record, dict) and k.isdigit() and record.get("file") == shard_name(int(k))
            and isinstance(record.get("sha256"), str)):
        return False
    path = os.path.join(out_dir, record["file"])
    return os.path.isfile(path) and sha256_of(path) == record["sha256"]


def run_stage(out_dir: str, what: str, target: str, items: list, shard_size: int, work,
              tokens=lambda row: 0, log=print) -> dict:
    """Run `work(shard_items, k) -> rows` (JSON-serialisable dicts) for every shard not yet
    complete in out_dir; -> the manifest. `tokens(row)` counts a row's supervised tokens."""
    plan = _plan(what, target, items, shard_size)
    manifest = _read_manifest(out_dir, plan)
    done = {k: r for k, r in manifest["done"].items() if _verified(out_dir, k, r)}
    todo = [k for k in range(plan["shards"]) if str(k) not in done]
    if not todo:
        log(f"[{what}] all {plan['shards']} shards complete in {out_dir}; skipping")
        return manifest
    log(f"[{what}] {len(done)} of {plan['shards']} shards complete; running {len(todo)}")
    start = time.perf_counter()
    for n, k in enumerate(todo, 1):
        rows = work(items[k * shard_size:(k + 1) * shard_size], k)
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()
        write_atomic(os.path.join(out_dir, shard_name(k)), data)
        done[str(k)] = {"file": shard_name(k), "rows": len(rows),
                        "tokens": int(sum(tokens(r) for r in rows)),
                        "sha256": hashlib.sha256(data).hexdigest()}
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
    path = os.path.join(out_dir, MANIFEST)
    manifest = read_json(path, "stage manifest") if os.path.exists(path) else {}
    plan, done = (manifest.get("plan"), manifest.get("done")) if isinstance(manifest, dict) \
        else (None, None)
    shards = plan.get("shards") if isinstance(plan, dict) else None
    if not (isinstance(shards, int) and isinstance(done, dict)
            and all(_verified(out_dir, str(k), done.get(str(k))) for k in range(shards))):
        raise S2DError(f"{out_dir} is not a complete stage; rerun the stage to finish it")
    rows = []
    for k in range(shards):
        with open(os.path.join(out_dir, shard_name(k)), encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows
