"""JAX's persistent compilation cache, on for every command and the Python API: a second
start reads the compiled programs from disk instead of compiling them (issue 69).

    S2D_COMPILE_CACHE   unset: $S2D_JAX_CACHE/xla (~/.cache/s2d-jax/xla); 0/off/false/no:
                        off; an absolute path: the cache there

Programs go to a folder per machine and JAX version (`machine_key`): JAX's own key holds
the jax/jaxlib versions, the XLA flags and the device kind, but on a CPU the device kind
is just "cpu", and an XLA:CPU program is built for the host's instruction set (AVX-512
here, AVX2 elsewhere): a cache folder shared between machines (a home on NFS) must not
hand one machine's programs to another. `s2d cache` reports the size, `--clear` empties it.

`enable()` runs when s2d_jax is imported: before JAX is, it sets JAX's own environment
variables (JAX reads them when it starts; nothing here imports JAX, so a CLI's checks
stay fast); after, it updates jax.config. A variable the user set to JAX is kept.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import shutil
import sys

from s2d_jax.errors import S2DError

ENV = "S2D_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no")
# Every program is written: the thresholds' defaults (1 s of compile) skip the many
# programs that compile in under a second idle, which take several on a loaded 2-core
# machine, and a cached program reads back in milliseconds whatever its compile time.
SETTINGS = {"jax_compilation_cache_dir": None,  # filled in by enable()
            "jax_persistent_cache_min_compile_time_secs": 0.0,
            "jax_persistent_cache_min_entry_size_bytes": -1}  # -1: no size floor


def cache_dir() -> str | None:
    """The cache's root ($S2D_COMPILE_CACHE, default $S2D_JAX_CACHE/xla); None: off."""
    raw = os.environ.get(ENV)
    if raw is None:
        from s2d_jax.env import cache_root
        return os.path.join(cache_root(), "xla")
    if raw.strip().lower() in _OFF:
        return None
    from s2d_jax.env import directory_setting
    return directory_setting(ENV, raw, "set an absolute path, or 0 to turn the compilation "
                                       "cache off")


def machine_key() -> str:
    """This machine's and JAX's folder name: jaxlib's version, the CPU architecture and a
    hash of the CPU's model and instruction-set flags."""
    cpu = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:  # Linux: the model and the flags XLA compiles for
            lines = [x for x in f if x.startswith(("model name", "flags", "Features"))]
        cpu += "".join(sorted(set(lines)))
    except OSError:
        pass
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    digest = hashlib.sha256(cpu.encode()).hexdigest()[:12]
    return f"jaxlib-{version}-{platform.machine() or 'cpu'}-{digest}"


def program_dir() -> str | None:
    """Where this machine's programs go (None: the cache is off)."""
    root = cache_dir()
    return None if root is None else os.path.join(root, machine_key())


def enable() -> str | None:
    """Turn the cache on for this process (see the module docstring) -> its folder, or None
    where it is off or the user set JAX's own cache folder. Never raises: a bad setting is
    reported by `s2d cache`, and the commands run on without a cache."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return None  # the user's own JAX setting wins
    try:
        path = program_dir()
    except S2DError:
        return None
    if path is None:
        return None
    settings = {**SETTINGS, "jax_compilation_cache_dir": path}
    if "jax" in sys.modules:
        import jax
        for name, value in settings.items():
            jax.config.update(name, value)
    else:
        for name, value in settings.items():
            os.environ.setdefault(name.upper(), str(value))
    return path


def usage(root: str) -> tuple[int, int, list[str]]:
    """(files, bytes, machine folders) under the cache root `root`."""
    files = size = 0
    folders = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))) \
        if os.path.isdir(root) else []
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                size += os.path.getsize(os.path.join(dirpath, name))
                files += 1
            except OSError:  # removed while we walk (another process's eviction)
                pass
    return files, size, folders


def clear(root: str) -> None:
    """Remove every cached program under `root` (the folder itself stays)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
