"""The environment variables the project reads, each checked like a flag: a bad value is
one S2DError naming the variable, the problem and the fix, never a silent default or a
directory created in the wrong place.

    S2D_JAX_CACHE     the cache root (fetched models, the CPU kernels' library, engine and
                      study dirs by default); unset: ~/.cache/s2d-jax
    S2D_SMALL_MATMUL  1/on/true/yes (default) or 0/off/false/no: the CPU decode kernels
    S2D_LIBTPU_PATH   a libtpu.so kept out of the environment (as .ci/run installs it), for
                      --topology's deviceless TPU compiles (s2d_jax/parallel/topology.py)
"""

from __future__ import annotations

import os

from s2d_jax.errors import S2DError
from s2d_jax.readers import expand_path

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SHIPPED_DRAFT = "smollm2-draft"
_ON, _OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")
# the clone's root (also an editable install's); a wheel has none, its files are package data
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cache_root() -> str:
    """$S2D_JAX_CACHE (with ~ and $VARS expanded) or ~/.cache/s2d-jax, as an absolute path."""
    raw = os.environ.get("S2D_JAX_CACHE")
    if raw is None:
        return os.path.join(os.path.expanduser("~"), ".cache", "s2d-jax")
    return directory_setting("S2D_JAX_CACHE", raw, "unset it (the cache is then "
                             "~/.cache/s2d-jax) or set it to a directory")


def directory_setting(var: str, raw: str, if_empty: str) -> str:
    """The directory an environment variable names (~ and $VARS expanded), checked as a
    flag is: not empty (`if_empty` says what to do instead), nothing left unexpanded,
    absolute (a relative one would move with the working directory), not a file."""
    name = f"{var}={raw!r}"
    if not raw.strip():
        raise S2DError(f"{var} is set but empty; {if_empty}")
    path = expand_path(raw.strip())
    if "$" in path or path.startswith("~"):
        raise S2DError(f"{name} holds an unexpanded {'$VAR' if '$' in path else '~'}; set it "
                       f"to a directory path that exists in this environment")
    if not os.path.isabs(path):
        raise S2DError(f"{name} is a relative path (the cache would move with the working "
                       f"directory); set an absolute path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise S2DError(f"{name} is a file, not a directory; set it to a directory")
    return path


def smollm2_dir() -> str:
    """Where infer.fetch_smollm2 puts the real target's HF dir."""
    return os.path.join(cache_root(), SMOLLM2_NAME)


def shipped_draft_dir() -> str:
    """The SmolLM2 draft the project ships: package data of an installed wheel, models/ of a
    clone (an editable install maps the one to the other)."""
    try:
        from importlib.resources import files
        path = str(files("s2d_jax.shipped") / SHIPPED_DRAFT)
        if os.path.isdir(path):
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    return os.path.join(_REPO, "models", SHIPPED_DRAFT)


# models found by name from any directory (a path that exists is taken as a path first)
MODEL_NAMES = {"smollm2": smollm2_dir, "smollm2-draft": shipped_draft_dir}


# shipped folders of the clone -> the package an installed wheel holds them in (pyproject.toml)
SHIPPED_DIRS = {"data": "s2d_jax.shipped_data", "configs": "s2d_jax.shipped_configs"}


def shipped_file(rel: str) -> str | None:
    """Where the clone's `data/...` or `configs/...` file `rel` lies from any directory:
    the clone's copy, else an installed wheel's package data; None if neither has it."""
    head, _, rest = rel.replace(os.sep, "/").partition("/")
    if head not in SHIPPED_DIRS or not rest or os.path.isabs(rel):
        return None
    path = os.path.join(_REPO, rel)
    if os.path.isfile(path):
        return path
    try:
        from importlib.resources import files
        path = files(SHIPPED_DIRS[head])
        for part in rest.split("/"):  # one part at a time: a namespace package's path
            path = path.joinpath(part)  # takes one (Python 3.11)
        path = str(path)
    except (ModuleNotFoundError, TypeError):
        return None
    return path if os.path.isfile(path) else None


def resolve_input(spec: str) -> str:
    """An input path flag's value: an existing path as given (~ and $VARS expanded), a file
    the project ships (`data/demo_questions.jsonl`, `configs/train/...`) from any directory
    (shipped_file), anything else as given (its reader says it is missing)."""
    path = expand_path(spec)
    if os.path.exists(path):
        return path
    return shipped_file(path) or path


def resolve_model(spec: str) -> str:
    """A model flag's value: an existing path as given (~ and $VARS expanded), a known name
    (MODEL_NAMES) as its location, anything else as given (its loader says it is missing)."""
    path = expand_path(spec)
    if os.path.exists(path) or spec not in MODEL_NAMES:
        return path
    return MODEL_NAMES[spec]()


def small_matmul_forced() -> bool:
    """S2D_SMALL_MATMUL set on: the CPU kernels on any CPU, not only where they pay."""
    return "S2D_SMALL_MATMUL" in os.environ and small_matmul_enabled()


def quant_activations_setting() -> str | None:
    """S2D_QUANT_ACTIVATIONS: how the CPU kernels take a block-quantized weight's activations
    ("int8" as llama.cpp, or "float"); None when unset (small_matmul.activation_mode)."""
    raw = os.environ.get("S2D_QUANT_ACTIVATIONS")
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in ("int8", "float"):
        return value
    raise S2DError(f"S2D_QUANT_ACTIVATIONS={raw!r} is neither int8 nor float; unset it for "
                   "the default (int8 where the CPU has AVX-512 VNNI)")


def small_matmul_enabled() -> bool:
    raw = os.environ.get("S2D_SMALL_MATMUL")
    if raw is None:
        return True
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise S2DError(f"S2D_SMALL_MATMUL={raw!r} is neither on ({'/'.join(_ON)}) nor off "
                   f"({'/'.join(_OFF)}); unset it to use the CPU kernels, or set 0")
