"""Reading the user's text files (prompts, configs, JSON sidecars, reports, corpora): every
way a file can be unreadable becomes one S2DError naming the file, the problem and the fix,
instead of a UnicodeDecodeError / JSONDecodeError / YAMLError traceback.

Ground level (next to errors.py) so that config.py and every package above can use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import yaml

from s2d_jax.errors import S2DError


def expand_path(path: str) -> str:
    """A user's path with `~` and `$VAR` / `${VAR}` expanded: the one rule for every path the
    API and the CLIs take (a quoted `~` reaches us unexpanded by the shell)."""
    return os.path.expandvars(os.path.expanduser(path))


def read_text(path: str, what: str = "file") -> str:
    """The whole file as str, without a leading UTF-8 byte order mark (some Windows
    editors write one; it is no content); `what` names it in the error ("prompts file",
    ...)."""
    path = expand_path(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise S2DError(f"{what} {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise S2DError(f"{what} {path} is a directory; pass a file") from None
    except OSError as e:
        raise S2DError(f"cannot read {what} {path}: {e.strerror}; check the path and its "
                       f"permissions") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise S2DError(f"{what} {path} is not valid UTF-8 text (byte 0x{data[e.start]:02x} "
                       f"at offset {e.start}); re-save it as UTF-8") from None


def parse_json(text: str, path: str, what: str = "file", line: int | None = None) -> Any:
    """json.loads with a one-line error; `line` names a JSON-lines row."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{path}:{line}" if line is not None else f"{path}"
        raise S2DError(f"{what} {where} is not valid JSON ({e.msg} at line {e.lineno} column "
                       f"{e.colno}); fix or re-create it") from None


def read_json(path: str, what: str = "file") -> Any:
    return parse_json(read_text(path, what), path, what)


def read_yaml(path: str, what: str = "config file") -> Any:
    text = read_text(path, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise S2DError(f"{what} {path} is not valid YAML ({str(e).splitlines()[0]}); "
                       f"fix it") from None


def sha256_of(path: str) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
