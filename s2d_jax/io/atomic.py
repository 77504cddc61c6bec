"""Atomic outputs: a file or a directory appears complete at its path or not at all.

Everything the project writes (checkpoints, HF dirs, tokenizers, JSONL, reports, serving
configs) goes through these two helpers, so an interrupted run never leaves half an output
and an existing one is replaced only once the new one is complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from s2d_jax.errors import S2DError


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


@contextlib.contextmanager
def atomic_output_dir(out_dir: str, overwrite: bool = False):
    """Yield a temp dir next to `out_dir`; rename it to `out_dir` only if the block succeeds.

    A failure leaves nothing at `out_dir`; an existing `out_dir` is replaced only with
    `overwrite=True`, and only once the new one is complete.
    """
    out = os.path.abspath(out_dir)
    if os.path.lexists(out) and not overwrite:
        raise S2DError(f"output {out_dir} already exists; pass --overwrite or choose another path")
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    except OSError as e:
        raise _cannot_write(out_dir, e) from None
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    chmod_like_open(tmp)
    if os.path.lexists(out):
        old = tmp + ".old"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    else:
        os.rename(tmp, out)
