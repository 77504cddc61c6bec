"""Which paths a command may write: one check every command runs on its outputs and inputs
before any work, so that no output can destroy data.

An output may never be, contain or lie inside an input (model dirs, data files, config
files, tokenizer dirs), nor be empty, the current directory, the home directory or one of
their ancestors (`/`). Paths are compared after `~` expansion and symlink resolution.

An existing model dir output is replaced (`--overwrite`, `export_overwrite=true`) only when
it is recognisably an earlier output of the same kind: every model dir this project writes
carries a small marker file naming its kind (written by `atomic.atomic_output_dir`); an
empty dir may go too, since nothing is lost. Anything else is refused with one error line.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, NamedTuple

from s2d_jax.errors import S2DError

MARKER = ".s2d-output.json"
HF_DIR, CHECKPOINT, DRAFT_PACK = "hf", "checkpoint", "draft-pack"
# kinds of model dir outputs -> how messages name them
KINDS = {HF_DIR: "an HF model dir", CHECKPOINT: "a params checkpoint",
         DRAFT_PACK: "a draft pack", "dir": "an output dir"}
FILE, DIR = "file", "files-dir"  # a file (replaced freely), a dir files are written into
CACHE = "cache"  # a dir other runs share too (the fetched models, kernels): place checks only


class Output(NamedTuple):
    flag: str  # how the user named it: "--out", "export_dir"
    path: str | None  # None: not written by this run
    kind: str = FILE  # FILE, DIR or a model dir kind of KINDS (replaced only as one)
    overwrite: bool = False
    overwrite_hint: str = "--overwrite"  # how the user asks to replace it
    # a DIR output's command (e.g. "python -m infer.bench"): an existing non-empty dir is
    # written into only when its marker names this command ("" = no such check)
    owner: str = ""


def real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def _within(path: str, root: str) -> bool:
    """Both real paths: `path` is `root` or lies inside it."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def mark_output(out_dir: str, kind: str, command: str = "") -> None:
    with open(os.path.join(out_dir, MARKER), "w") as f:
        f.write(json.dumps({"written_by": "s2d-jax", "kind": kind,
                            **({"command": command} if command else {})}) + "\n")


def _marker(path: str, field: str) -> str | None:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8-sig") as f:
            value = json.load(f).get(field)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def output_kind(path: str) -> str | None:
    """The kind in `path`'s marker, or None when it has none (not written by this project)."""
    return _marker(path, "kind")


def check_replaceable(flag: str, path: str, kind: str, overwrite: bool,
                      overwrite_hint: str = "--overwrite") -> None:
    """An existing model dir output `path` may be replaced only with `overwrite` and only
    if it is empty or carries the marker of `kind`."""
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise S2DError(f"{flag} {path} already exists; pass {overwrite_hint} or choose "
                       f"another path")
    if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        return
    found = output_kind(path) if os.path.isdir(path) else None
    if found == kind:
        return
    what = (f"is {KINDS.get(found, found)}, not {KINDS[kind]}" if found else
            f"has no {MARKER}: it is not {KINDS[kind]} this project wrote")
    raise S2DError(f"{flag} {path} {what}, so {overwrite_hint} will not replace it; remove "
                   f"it yourself if it may go, or choose another path")


def _named_paths(inputs: dict) -> list[tuple[str, str]]:
    """{flag: path | [paths] | None} -> [(flag, path)] for the paths given."""
    out = []
    for flag, value in inputs.items():
        values = [value] if isinstance(value, str) or value is None else list(value)
        out += [(flag, v) for v in values if v]
    return out


def _check_place(o: Output) -> str:
    """The output's real path; refuses empty paths and the cwd / home and their ancestors."""
    if not o.path.strip():
        raise S2DError(f"{o.flag} is empty; pass a path for the output, e.g. runs/out")
    r = real(o.path)
    for what, d in (("the current directory", real(os.getcwd())),
                    ("your home directory", real(os.path.expanduser("~")))):
        if _within(d, r):
            place = f"is {what}" if d == r else f"({r}) holds {what}"
            raise S2DError(f"{o.flag} {o.path!r} {place}; an output never replaces that, "
                           f"choose a new path such as runs/out")
    return r


def _check_against(o: Output, r: str, flag: str, path: str) -> None:
    """Refuse output `o` (real path `r`) when it is, holds or lies inside `path`."""
    p = real(path)
    if r == p:
        relation = "is"
    elif _within(p, r):
        if o.kind == CACHE:  # a shared dir holds many things; this run writes its own names
            return
        relation = "contains"
    elif _within(r, p):
        relation = "lies inside"
    else:
        return
    raise S2DError(f"{o.flag} {o.path} {relation} the input {flag} {path}; writing it would "
                   f"destroy that input, choose an output path outside every input")


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _check_room(o: Output, r: str) -> None:
    """The output can be written: an existing path is of the kind wanted (a file for FILE,
    a directory otherwise), and the directory it is written in (or its nearest existing
    ancestor) is a writable directory (os.access: a read-only mount stops root too)."""
    wants_dir = o.kind != FILE
    if os.path.exists(r):
        if wants_dir and not os.path.isdir(r):
            raise S2DError(f"{o.flag} {o.path} is a file, not a directory; pass a directory "
                           f"path")
        if not wants_dir and os.path.isdir(r):
            raise S2DError(f"{o.flag} {o.path} is a directory; pass a file path")
        here = r if wants_dir else os.path.dirname(r)
    else:
        here = _nearest_existing(os.path.dirname(r))
        if not os.path.isdir(here):
            raise S2DError(f"{o.flag} {o.path} cannot be created: {here} is a file, not a "
                           f"directory; choose another path")
    if not os.access(here, os.W_OK | os.X_OK):
        raise S2DError(f"{o.flag} {o.path} cannot be written: {here} is not writable; "
                       f"choose another path")


def _check_owner(o: Output, r: str) -> None:
    """A files-dir output that exists with content was written by this command before
    (its marker), so no other tool's files there are replaced."""
    if o.kind != DIR or not o.owner or not os.path.isdir(r) or not os.listdir(r):
        return
    found = _marker(r, "command")
    if found != o.owner:
        what = f"its {MARKER} names {found}" if found else f"it has no {MARKER}"
        raise S2DError(f"{o.flag} {o.path} holds files that {o.owner} did not write ({what}); "
                       f"choose a new or empty directory, or remove it yourself if it may go")


def check_outputs(outputs: Iterable[Output], inputs: dict) -> None:
    """Refuse, before any work, outputs that could destroy data (see the module doc).

    `inputs`: {how the user named it: path, list of paths or None}. Outputs are also
    checked against each other: none may be another, nor lie inside a model dir output
    (which is replaced as a whole)."""
    given = [o for o in outputs if o.path is not None]
    named = _named_paths(inputs)
    reals = []
    for o in given:
        r = _check_place(o)
        for flag, path in named:
            _check_against(o, r, flag, path)
        for other, r_other in reals:
            if r == r_other or (other.kind in KINDS and _within(r, r_other)) or (
                    o.kind in KINDS and _within(r_other, r)):
                raise S2DError(f"{o.flag} {o.path} and {other.flag} {other.path} overlap; "
                               f"give each output its own path")
        reals.append((o, r))
        _check_room(o, r)
        _check_owner(o, r)
        if o.kind in KINDS:
            check_replaceable(o.flag, o.path, o.kind, o.overwrite, o.overwrite_hint)
