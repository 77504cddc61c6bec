"""The target's output states for distilling a draft on its full distribution (logit KD).

For every token row of a distillation file (`s2d_jax/data/distill.py`'s JSON lines), the
target's final-normed hidden state x at each input position (ids[:-1]) is stored, float16,
in one [tokens, D] `.npy` array (rows one after another) beside a JSON index. The target's
logits are x @ E^T with its (tied, frozen) embedding E, which the draft shares: the train
step recomputes the teacher's distribution over the draft head's vocabulary from x at the
cost of one sub-vocabulary head, so a run stores D numbers per token instead of V logits
and reads any head vocabulary from the same file.

    states = TeacherStates(path)     # memory-mapped
    x = states.gather(index)         # index [...] int -> [..., D] float16
"""

from __future__ import annotations

import json
import os

import numpy as np

from s2d_jax.errors import S2DError
from s2d_jax.readers import sha256_of

META = "teacher_states.json"
STATES = "teacher_states.npy"
BUCKET = 64  # rows are padded to multiples of this: few compiled shapes


def row_offsets(lengths) -> np.ndarray:
    """Start of each row's states: row i's input positions are offsets[i] + arange(len_i - 1)."""
    return np.concatenate([[0], np.cumsum([n - 1 for n in lengths])]).astype(np.int64)


class _Parts:
    """Per-shard state files read as one [N, D] array (read-only, memory-mapped): what a
    joined dir indexes instead of a copy of them. Integer-array and slice indexing."""

    def __init__(self, arrays: list):
        self.arrays = arrays
        self.starts = np.concatenate([[0], np.cumsum([a.shape[0] for a in arrays])])
        self.shape = (int(self.starts[-1]), int(arrays[0].shape[1]))

    def __getitem__(self, index):
        flat = (np.arange(self.shape[0])[index] if isinstance(index, slice)
                else np.asarray(index, np.int64))
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"state index out of range [0, {self.shape[0]})")
        part = np.searchsorted(self.starts, flat.reshape(-1), side="right") - 1
        out = np.empty((flat.size, self.shape[1]), self.arrays[0].dtype)
        for p in np.unique(part):
            at = part == p
            out[at] = self.arrays[p][flat.reshape(-1)[at] - self.starts[p]]
        return out.reshape(*flat.shape, self.shape[1])


def _load_parts(path: str, meta: dict) -> _Parts:
    arrays = []
    for rel, n in zip(meta["parts"], meta["part_states"]):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise S2DError(f"teacher states {path} index {f}, which is gone; rerun the data "
                           f"engine's teacher stage (or delete {path})")
        a = np.load(f, mmap_mode="r")
        if a.shape != (n, meta["dim"]):
            raise S2DError(f"{f} holds {a.shape[0]} states of {a.shape[1:]}, {path} indexes "
                           f"{n} of ({meta['dim']},): the shard changed; rerun the teacher stage")
        arrays.append(a)
    return _Parts(arrays)


class TeacherStates:
    """A written teacher-states dir, checked against the token rows it was computed from:
    one states file, or (the data engine's joined dir) an index of its shards' files."""

    def __init__(self, path: str, rows_path: str | None = None):
        meta_path = os.path.join(path, META)
        if not os.path.isfile(meta_path):
            raise S2DError(f"{path} holds no {META}; write it with "
                           f"s2d_jax.data.teacher.write_teacher_states (python -m "
                           f"train.smollm2_draft does) or unset data.teacher")
        with open(meta_path, encoding="utf-8-sig") as f:  # -sig: a BOM is no content
            self.meta = json.load(f)
        if rows_path is not None and self.meta["rows_sha256"] != sha256_of(rows_path):
            raise S2DError(f"teacher states {path} were computed from another version of "
                           f"{rows_path}; rewrite them (delete {path})")
        self.states = (_load_parts(path, self.meta) if "parts" in self.meta
                       else np.load(os.path.join(path, STATES), mmap_mode="r"))
        self.offsets = np.asarray(self.meta["offsets"], np.int64)
        if self.states.shape[0] != self.offsets[-1]:
            raise S2DError(f"{path} has {self.states.shape[0]} states, its index "
                           f"{self.offsets[-1]}: the states are incomplete; delete {path}")

    @property
    def dim(self) -> int:
        return int(self.states.shape[1])

    def gather(self, index: np.ndarray) -> np.ndarray:
        flat = np.asarray(index, np.int64).reshape(-1)
        return np.asarray(self.states[flat]).reshape(*np.shape(index), self.dim)


def states_fn(cfg):
    """The jitted target pass: tokens [B, T] -> final-normed hidden states [B, T, D] f16."""
    import jax
    import jax.numpy as jnp

    from s2d_jax.model import transformer as model

    @jax.jit
    def states(params, tokens):
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        h, _ = model.run_layers(params, cfg, model.embed_tokens(params, cfg, tokens), pos)
        return model.rms_norm(h, params["final_norm"], cfg.rms_norm_eps).astype(jnp.float16)

    return states


def state_batches(states, params, rows: list[list[int]], batch_tokens: int):
    """Yield (row indices, their states [len(row) - 1, D] each) for every row, in batches:
    rows by length, padded at the end to a multiple of BUCKET (causal: padding after a
    row's tokens changes none of its states), about batch_tokens tokens per call."""
    order = np.argsort([len(r) for r in rows], kind="stable")
    i = 0
    while i < len(order):
        first = -(-(len(rows[order[i]]) - 1) // BUCKET) * BUCKET
        group = order[i:i + max(1, batch_tokens // first)]
        width = -(-(len(rows[group[-1]]) - 1) // BUCKET) * BUCKET  # the longest of them
        tokens = np.zeros((len(group), width), np.int32)
        for b, j in enumerate(group):
            tokens[b, :len(rows[j]) - 1] = rows[j][:-1]
        x = np.asarray(states(params, tokens))
        yield group, [x[b, :len(rows[j]) - 1] for b, j in enumerate(group)]
        i += len(group)


def rows_states(states, params, rows: list[list[int]], dim: int,
                batch_tokens: int = 4096) -> np.ndarray:
    """The states of every row, one after another (row_offsets): [sum(len - 1), D] f16."""
    offsets = row_offsets([len(r) for r in rows])
    out = np.zeros((int(offsets[-1]), dim), np.float16)
    for group, xs in state_batches(states, params, rows, batch_tokens):
        for j, x in zip(group, xs):
            out[offsets[j]:offsets[j + 1]] = x
    return out


def _check_rows(rows, rows_path: str) -> None:
    if not rows or min(len(r) for r in rows) < 2:
        raise S2DError(f"{rows_path} needs rows of at least 2 tokens")


def _finish(out_dir: str, tmp: str, meta: dict) -> str:
    """Move the written states into place, then write the index (what marks them complete)."""
    from s2d_jax.io.atomic import write_atomic
    os.replace(tmp, os.path.join(out_dir, STATES))
    write_atomic(os.path.join(out_dir, META), json.dumps(meta))
    return out_dir


def _up_to_date(out_dir: str, sha: str, log) -> bool:
    meta_path = os.path.join(out_dir, META)
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8-sig") as f:
            if json.load(f).get("rows_sha256") == sha:
                log(f"[teacher] {out_dir} is up to date")
                return True
    return False


def same_leading_rows(rows: list[list[int]], other: list[list[int]]) -> int:
    """How many rows at the start of `rows` equal those of `other`."""
    n = 0
    while n < min(len(rows), len(other)) and list(rows[n]) == list(other[n]):
        n += 1
    return n


def write_teacher_states(target_dir: str, rows_path: str, out_dir: str, *,
                         batch_tokens: int = 4096, reuse: tuple[str, str] | None = None,
                         log=print) -> str:
    """Run the target over every row of `rows_path`, store its final-normed hidden states
    under `out_dir`. Idempotent: an existing complete dir for the same rows is kept.
    reuse = (rows file, its written states dir): the states of the leading rows the two
    files share are copied, not computed again (a data slice that grows by rows)."""
    from s2d_jax.data.sources import load_token_rows
    from s2d_jax.io.checkpoint import load_model

    sha = sha256_of(rows_path)
    if _up_to_date(out_dir, sha, log):
        return out_dir
    cfg, params, _ = load_model(target_dir, dtype="float32")
    rows = [r["input_ids"] for r in load_token_rows(rows_path, cfg.vocab_size)]
    _check_rows(rows, rows_path)
    offsets = row_offsets([len(r) for r in rows])
    first, old = 0, None
    if reuse is not None:
        old = TeacherStates(reuse[1], reuse[0])  # refuses states of another rows version
        if old.dim == cfg.hidden_size and old.meta.get("target") == target_dir:
            first = same_leading_rows(rows, [r["input_ids"] for r in
                                             load_token_rows(reuse[0], cfg.vocab_size)])
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, STATES + ".tmp")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                    shape=(int(offsets[-1]), cfg.hidden_size))
    if first:
        out[:offsets[first]] = old.states[:offsets[first]]
        log(f"[teacher] {first} of {len(rows)} rows ({offsets[first]} states) from {reuse[1]}")
    done = int(offsets[first])
    for group, xs in state_batches(states_fn(cfg), params, rows[first:], batch_tokens):
        for j, x in zip(group, xs):
            out[offsets[first + j]:offsets[first + j + 1]] = x
        done += sum(len(x) for x in xs)
        log(f"[teacher] {done}/{offsets[-1]} states")
    out.flush()
    del out
    return _finish(out_dir, tmp, {"rows_sha256": sha, "rows": rows_path, "target": target_dir,
                                  "dim": cfg.hidden_size, "offsets": offsets.tolist()})


def join_states(parts: list[str], rows_path: str, out_dir: str, target: str, *,
                log=print) -> str:
    """One teacher-states dir for `rows_path` from per-shard state files `parts` (.npy,
    rows in the same order, as the data engine's teacher stage writes them): what
    data.teacher reads. It indexes the shards' files (named relative to out_dir) instead of
    copying them, so the states are stored once. Idempotent like write_teacher_states."""
    from s2d_jax.data.sources import load_token_rows
    from s2d_jax.io.atomic import write_atomic

    sha = sha256_of(rows_path)
    if _up_to_date(out_dir, sha, log):
        return out_dir
    arrays = [np.load(p, mmap_mode="r") for p in parts]
    rows = [r["input_ids"] for r in load_token_rows(rows_path, 1 << 31)]
    _check_rows(rows, rows_path)
    offsets = row_offsets([len(r) for r in rows])
    if sum(a.shape[0] for a in arrays) != offsets[-1]:
        raise S2DError(f"the state files hold {sum(a.shape[0] for a in arrays)} states, "
                       f"{rows_path} needs {offsets[-1]}; rerun the teacher stage")
    dims = {a.shape[1:] for a in arrays}
    if len(dims) != 1 or len(next(iter(dims))) != 1:
        raise S2DError(f"the state files' shapes differ ({sorted(dims)}); rerun the teacher stage")
    os.makedirs(out_dir, exist_ok=True)
    log(f"[teacher] {out_dir}: {int(offsets[-1])} states of {len(parts)} shards (indexed)")
    # the rows and shards named relative to out_dir: a moved cache stays the same bytes
    write_atomic(os.path.join(out_dir, META), json.dumps({
        "rows_sha256": sha, "rows": os.path.relpath(rows_path, out_dir), "target": target,
        "dim": int(arrays[0].shape[1]), "offsets": offsets.tolist(),
        "parts": [os.path.relpath(p, out_dir) for p in parts],
        "part_states": [int(a.shape[0]) for a in arrays]}))
    copy = os.path.join(out_dir, STATES)  # a copy an earlier version joined, now unread
    if os.path.exists(copy):
        os.remove(copy)
    return out_dir
