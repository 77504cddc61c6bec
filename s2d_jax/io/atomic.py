"""Atomic outputs: a file or a directory appears complete at its path or not at all.

Everything the project writes (checkpoints, HF dirs, tokenizers, JSONL, reports, serving
configs) goes through these two helpers, so an interrupted run never leaves half an output
and an existing one is replaced only once the new one is complete.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile

from s2d_jax.errors import S2DError
from s2d_jax.io.outputs import DIR as DIR_KIND, check_replaceable, mark_output


def current_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; restore at once
    os.umask(mask)
    return mask


def chmod_like_open(root: str) -> None:
    """mkdtemp / mkstemp create private 0700 / 0600 entries; give `root` (and everything
    under a dir) the modes open() / mkdir() would: 0o666 / 0o777 minus the umask."""
    mask = current_umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    if not os.path.isdir(root):
        os.chmod(root, file_mode)
        return
    os.chmod(root, dir_mode)
    for d, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(d, name), dir_mode)
        for name in files:
            os.chmod(os.path.join(d, name), file_mode)


def _cannot_write(path: str, e: OSError) -> S2DError:
    return S2DError(f"cannot write {path}: {e.strerror or e}; choose a writable path with "
                    f"free space")


def write_atomic(path: str, data: str | bytes) -> None:
    """Write `data` to a temp file next to `path`, then rename it over `path`."""
    out_dir = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{os.path.basename(path)}.",
                                   suffix=".tmp")
    except OSError as e:
        raise _cannot_write(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        chmod_like_open(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _cannot_write(path, e) from None
        raise


def _temp_prefix(out: str) -> str:
    """Temp dirs beside `out` name their owner (host, pid), so a later run can tell a
    killed run's leftovers from a live run's work."""
    return f".{os.path.basename(out)}.tmp-{socket.gethostname()}-{os.getpid()}-"


def _owner_is_gone(host: str, pid: int) -> bool:
    """Only a process on this host can be asked; another host's temp is never judged stale."""
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. EPERM: alive, another user's
        return False
    return False


def remove_stale_temps(out: str) -> None:
    """Remove the temp dirs a killed run left beside `out` (its own name only, owner gone).

    A stale `.tmp-*` dir is half-written (or complete but never renamed): nothing in it is
    kept. A stale `.old` dir is the previous output, removed only when `out` exists (the
    rename finished); without `out` it is the last complete output and stays."""
    parent, base = os.path.split(out)
    pattern = re.compile(rf"\.{re.escape(base)}\.tmp-(.+)-(\d+)-[^-.]+(\.old)?")
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        if not m or not _owner_is_gone(m.group(1), int(m.group(2))):
            continue
        if m.group(3) and not os.path.lexists(out):
            continue
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) and not \
            os.path.islink(path) else os.remove(path)


@contextlib.contextmanager
def atomic_output_dir(out_dir: str, overwrite: bool = False, kind: str = "dir"):
    """Yield a temp dir next to `out_dir`; rename it to `out_dir` only if the block succeeds.

    A failure leaves nothing at `out_dir`; an existing `out_dir` is replaced only with
    `overwrite=True`, only if it is an earlier output of the same `kind` (its marker,
    outputs.py) or empty, and only once the new one is complete. The new one gets the
    marker of `kind`.
    """
    out = os.path.abspath(out_dir)
    check_replaceable("output", out_dir, kind, overwrite)
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        remove_stale_temps(out)
        tmp = tempfile.mkdtemp(prefix=_temp_prefix(out), dir=parent)
    except OSError as e:
        raise _cannot_write(out_dir, e) from None
    try:
        yield tmp
        mark_output(tmp, kind)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    chmod_like_open(tmp)
    if os.path.lexists(out):
        old = tmp + ".old"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) else os.remove(old)
    else:
        os.rename(tmp, out)


@contextlib.contextmanager
def files_dir(out_dir: str, command: str):
    """A dir a command writes files into (reports, a stage's shards): created with a marker
    naming `command` (outputs.check_outputs then lets only this command write into it
    again); if the block fails and this call created the dir, it goes again when it holds
    nothing but the marker, so a failed run leaves no empty output behind."""
    from s2d_jax.io.outputs import MARKER
    created = []
    path = os.path.abspath(out_dir)
    try:
        while not os.path.exists(path):
            created.append(path)
            path = os.path.dirname(path)
        os.makedirs(out_dir, exist_ok=True)
        if not os.path.exists(os.path.join(out_dir, MARKER)):
            mark_output(out_dir, DIR_KIND, command)
    except OSError as e:
        raise _cannot_write(out_dir, e) from None
    try:
        yield out_dir
    except BaseException:
        for d in created:  # deepest first: each only when nothing else was written there
            try:
                names = os.listdir(d)
                if set(names) <= {MARKER}:
                    for n in names:
                        os.remove(os.path.join(d, n))
                    os.rmdir(d)
            except OSError:
                break
        raise

