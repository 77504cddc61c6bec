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


# --- whole executables, keyed without tracing ---------------------------------------------
#
# JAX's cache above keys a program by its lowered text: a second start still traces and
# lowers every program (2 s of the README's main command) before it can look it up.
# `compiled()` keys the executable by what makes it instead (the function, its static
# arguments, the arguments' types and placements, this package's source, JAX's version
# and settings, the decode scopes): a second start reads the executable with no trace.

EXECUTABLES = "executables"  # their folder under program_dir()
# the module state a decode program is traced under (the CPU kernels' choice, the decode
# scopes): part of the key, read only where the module is loaded (tests check the names)
TRACE_STATE = {"s2d_jax.model.small_matmul": ("_choice", "_activations"),
               "s2d_jax.model.decode_scope": ("_static_decode", "_tensor", "_fused")}
# FFI targets a cached executable calls, by name prefix -> (module, function) that
# registers them in this process before the executable is loaded (True: registered)
FFI_PROVIDERS = {"s2d_": ("s2d_jax.model.small_matmul", "built")}
_SOURCE: list[str] = []  # this package's source fingerprint, computed once
_stats = {"hits": 0, "misses": 0}  # this process's compiled() look-ups (tests, notes)
_LOADED: dict = {}  # its file -> the executable compiled() returned in this process


def source_fingerprint() -> str:
    """sha256 of every source file of the s2d_jax package (the code a program is traced
    from, the CPU kernels' C++ included)."""
    if not _SOURCE:
        root = os.path.dirname(os.path.abspath(__file__))
        h = hashlib.sha256()
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith((".py", ".cc", ".h")):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read() + b"\0")
        _SOURCE.append(h.hexdigest())
    return _SOURCE[0]


def _stable(value) -> str | None:
    """repr(value), None where it names an object's address (not the same next start)."""
    text = repr(value)
    return None if " at 0x" in text else text


def _leaf_key(x) -> str | None:
    """An array's type and placement (its values are the program's inputs); anything else
    (a static argument such as the chain, a Python number) by its text."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return repr((type(x).__name__, tuple(x.shape), str(x.dtype),
                     getattr(x, "weak_type", None), str(getattr(x, "sharding", None))))
    return _stable(x)


def executable_key(fn, args: tuple, kwargs: dict) -> str | None:
    """The key of fn.lower(*args, **kwargs).compile() (see above); None: not cacheable
    (a static argument or setting without a stable text)."""
    import jax
    from jax._src import config as jax_config
    leaves, tree = jax.tree.flatten((args, kwargs))
    static = [_stable(tree)] + [_leaf_key(x) for x in leaves]  # the tree's data, the leaves
    if None in static:
        return None
    state = []
    for module, names in TRACE_STATE.items():
        mod = sys.modules.get(module)
        state.append([module, *[repr(getattr(mod, n, None)) if mod else None for n in names]])
    context = [_stable(v) or type(v).__name__ for v in jax_config.trace_context()]
    settings = {k: _stable(v) for k, v in sorted(jax.config.values.items())
                if "cache" not in k}
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(("S2D_", "JAX_", "XLA_", "TF_", "TPU_", "CUDA_", "LIBTPU"))
           and k not in (ENV, "S2D_JAX_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    blob = repr([getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)),
                 static, state, context, settings, env,
                 jax.__version__, source_fingerprint(), jax.default_backend(),
                 [str(d) for d in jax.devices()]])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _custom_calls(compiled) -> list[str]:
    import re
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 - a program without text: assume none
        return []
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', text or "")))


def _providers_ready(targets: list[str]) -> bool:
    """Register the FFI targets `targets` need in this process (FFI_PROVIDERS)."""
    import importlib
    for prefix, (module, name) in FFI_PROVIDERS.items():
        if any(t.startswith(prefix) for t in targets):
            if not getattr(importlib.import_module(module), name)():
                return False
    return True


def compiled(fn, *args, **kwargs):
    """fn.lower(*args, **kwargs).compile() for a jitted fn, read from the cache's folder
    where an earlier process compiled it under the same key (executable_key), written
    there otherwise. The cache off (S2D_COMPILE_CACHE=0, or JAX's own folder set by the
    user): compiled as usual. A damaged or unreadable entry is compiled anew."""
    import pickle

    try:
        folder = program_dir()
    except S2DError:
        folder = None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR", folder) != folder:
        folder = None  # the user's own JAX cache folder: JAX's cache only
    key = executable_key(fn, args, kwargs) if folder else None
    if key is None:
        return fn.lower(*args, **kwargs).compile()
    path = os.path.join(folder, EXECUTABLES, key + ".pkl")
    if path in _LOADED:  # this process's: no disk read for a later call (a chat's turns)
        return _LOADED[path]
    loaded = _read_executable(path)
    if loaded is not None:
        _stats["hits"] += 1
        _LOADED[path] = _Checked(loaded, path, lambda: _fresh_compile(fn, args, kwargs))
        return _LOADED[path]
    _stats["misses"] += 1
    out = _LOADED[path] = _fresh_compile(fn, args, kwargs)
    try:
        from jax.experimental import serialize_executable
        payload, in_tree, out_tree = serialize_executable.serialize(out)
        devices = [d.id for d in out.runtime_executable().local_devices()]
        blob = pickle.dumps({"executable": payload, "in_tree": in_tree, "out_tree": out_tree,
                             "ffi": _custom_calls(out), "devices": devices})
    except Exception:  # noqa: BLE001 - not serializable (a backend, a constant): not kept
        return out
    _write_atomic(path, blob)
    return out


def _fresh_compile(fn, args: tuple, kwargs: dict):
    """fn compiled here, without JAX's own persistent cache: an executable JAX read back from
    it, serialized again into this cache, lacks some of its kernels, and a later process
    that loads it fails when it runs ("Function wrapped_add.1 not found (type id: 1)"). That
    happens whenever this key changes but the program does not (any edit of the package's
    source): three `s2d peer-bench` runs on SmolLM2 over one cache folder, the second and
    third under another source fingerprint, failed in the third before this, not after.
    (A tiny jitted function did not show it.)"""
    # JAX decides whether its cache is in use once a process (compilation_cache.is_cache_used
    # memoizes it), so the switch is that function's, for this one compile
    from jax._src import compilation_cache as jax_cache
    used = getattr(jax_cache, "is_cache_used", None)
    if used is not None:
        jax_cache.is_cache_used = lambda backend: False
    try:
        return fn.lower(*args, **kwargs).compile()
    finally:
        if used is not None:
            jax_cache.is_cache_used = used


class _Checked:
    """An executable read from the cache, which its first call checks (waiting for its
    result): XLA:CPU's loader can return an executable that fails when run ("Function
    wrapped_slice.3 / iota_compare_fusion not found (type id: 1)", twice on 2026-12-06,
    from a cache folder many runs had filled). Such a call compiles the program anew, drops
    the entry (the next process writes a good one) and runs that; everything else is the
    executable's."""

    def __init__(self, executable, path: str, compile_fn):
        self._exe, self._path, self._compile, self._checked = executable, path, compile_fn, False

    def __call__(self, *args, **kwargs):
        if self._checked:
            return self._exe(*args, **kwargs)
        import jax
        try:
            # the failure can surface at dispatch or only when the result is waited for
            out = jax.block_until_ready(self._exe(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - only the loader's own failure is retried
            if "not found" not in str(e) or "Function" not in str(e):
                raise
            _stats["broken"] = _stats.get("broken", 0) + 1
            try:
                os.remove(self._path)
            except OSError:
                pass
            if any(getattr(x, "is_deleted", lambda: False)()
                   for x in jax.tree.leaves((args, kwargs))):
                raise S2DError(f"a compiled program read from {self._path} could not run "
                               f"({str(e).splitlines()[0][:120]}) and has been removed from "
                               "the cache; run the command again") from None
            self._exe = self._compile()
            out = self._exe(*args, **kwargs)
        self._checked = True
        return out

    def __getattr__(self, name):
        return getattr(self._exe, name)


def _read_executable(path: str):
    import pickle
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
        if not _providers_ready(entry["ffi"]):
            return None
        import jax
        from jax.experimental import serialize_executable
        by_id = {d.id: d for d in jax.devices()}
        return serialize_executable.deserialize_and_load(
            entry["executable"], entry["in_tree"], entry["out_tree"],
            execution_devices=[by_id[i] for i in entry["devices"]])
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - damaged, or from an incompatible process: compile
        return None


def _write_atomic(path: str, blob: bytes) -> None:
    import tempfile
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except OSError:  # a full or read-only disk: the program still runs, uncached
        try:
            os.remove(tmp)
        except (OSError, UnboundLocalError):
            pass


def _value_path(kind: str, key: str | None) -> str | None:
    if key is None:
        return None
    try:
        folder = program_dir()
    except S2DError:
        return None
    return None if folder is None else os.path.join(folder, kind, key + ".pkl")


def recall(kind: str, key: str | None):
    """A value an earlier process kept with `remember(kind, key, value)` (what a program
    derives from its executables: output shapes, measured seconds), or None."""
    import pickle
    path = _value_path(kind, key)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # noqa: BLE001 - absent or damaged: measured again
        return None


def remember(kind: str, key: str | None, value) -> None:
    """Keep `value` (picklable) for later processes under `kind`/`key` (`executable_key`:
    a key that changes with the code, JAX, the machine and the settings)."""
    import pickle
    path = _value_path(kind, key)
    try:
        blob = pickle.dumps(value)
    except Exception:  # noqa: BLE001 - not picklable: not kept
        return
    if path is not None:
        _write_atomic(path, blob)
