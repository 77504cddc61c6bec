"""Checks of the values a user gives, one rule each, shared by the Python API and every
command-line flag (s2d_jax/cli/args.py turns argparse's `int` / `float` types into these), so a
value refused by a flag is refused the same way by the function it reaches.

Each check returns the value (normalised: numpy scalars become Python ones) or raises a
one-line S2DError naming the argument, what is wrong and what to give instead. Bools are
refused where numbers are meant (True is an int to Python, never a token count to a user);
strings are refused where numbers are meant (the API does not parse "16"); NaN and inf are
never a number; integers must fit int32, the engine's type for lengths and ids.
"""

from __future__ import annotations

import math
import numbers
import os

from s2d_jax.errors import S2DError

INT32_MAX = 2**31 - 1


def _shown(value) -> str:
    text = repr(value)
    return (text[:40] + "...") if len(text) > 43 else text


def _kind(value) -> str:
    return type(value).__name__


def integer(value, name: str, lo: int | None = None, hi: int = INT32_MAX,
            optional: bool = False):
    """An int in [lo, hi] (None passes when `optional`)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise S2DError(f"{name} must be an integer, got {_shown(value)} ({_kind(value)}); "
                       f"pass a whole number such as 16")
    value = int(value)
    if lo is not None and value < lo:
        raise S2DError(f"{name} must be >= {lo}, got {value}")
    if value > hi:
        raise S2DError(f"{name} must be <= {hi}, got {value}"
                       + ("; it must fit a 32-bit integer" if hi == INT32_MAX else ""))
    return value


def number(value, name: str, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, optional: bool = False):
    """A finite real number in [lo, hi] ((lo, hi] with `lo_open`)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise S2DError(f"{name} must be a number, got {_shown(value)} ({_kind(value)}); "
                       f"pass a number such as 0.5")
    value = float(value)
    if not math.isfinite(value):
        span = (f" in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else
                f" >= {lo:g}" if lo is not None else "")
        raise S2DError(f"{name} must be a finite number{span}, got {value}; give a finite "
                       f"value")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    if lo is not None and hi is not None and (below or value > hi):
        raise S2DError(f"{name} must lie in {'(' if lo_open else '['}{lo:g}, {hi:g}], got "
                       f"{value:g}")
    if below:
        raise S2DError(f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {value:g}")
    if hi is not None and value > hi:
        raise S2DError(f"{name} must be <= {hi:g}, got {value:g}")
    return value


def text(value, name: str, optional: bool = False, nonempty: bool = True):
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise S2DError(f"{name} must be a string, got {_shown(value)} ({_kind(value)})")
    if nonempty and not value.strip():
        raise S2DError(f"{name} is empty; give a non-empty string")
    return value


def path(value, name: str, optional: bool = False) -> str | None:
    """A file-system path (str or os.PathLike), non-empty; returned as str, unexpanded."""
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise S2DError(f"{name} must be a path (str), got {_shown(value)} ({_kind(value)}); "
                       f"pass a directory or file path")
    value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise S2DError(f"{name} is an empty path; pass a directory or file path")
    return value


def choice(value, name: str, choices, optional: bool = False):
    if value is None and optional:
        return None
    if not isinstance(value, str) or value not in choices:
        raise S2DError(f"{name} must be one of {', '.join(map(str, choices))}, got "
                       f"{_shown(value)}")
    return value


def _sequence(value, name: str, what: str, allow_empty: bool = False) -> list:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or \
            isinstance(value, dict):
        raise S2DError(f"{name} must be a list of {what}, got {_shown(value)} "
                       f"({_kind(value)}); pass e.g. [{'0.5, 0.5, 0' if 'number' in what else '2, 4'}]")
    items = list(value)
    if not items and not allow_empty:
        raise S2DError(f"{name} is an empty list; give at least one of {what}")
    return items


def numbers_list(value, name: str, lo: float | None = None, hi: float | None = None,
                 optional: bool = False, allow_empty: bool = False):
    """A list of finite numbers, each in [lo, hi] (non-empty unless `allow_empty`)."""
    if value is None and optional:
        return None
    return [number(v, f"{name}[{i}]", lo, hi)
            for i, v in enumerate(_sequence(value, name, "numbers", allow_empty))]


def integers_list(value, name: str, lo: int | None = None, optional: bool = False):
    if value is None and optional:
        return None
    return [integer(v, f"{name}[{i}]", lo)
            for i, v in enumerate(_sequence(value, name, "integers"))]


def sampling(temperature, top_p, top_k, prefix: str = "") -> tuple[float, float, int]:
    """The sampling settings: temperature finite >= 0 (0 = greedy), top_p in (0, 1] (1 =
    off), top_k >= 0 (0 = off). `prefix` "--" names them as flags."""
    def named(n):
        return prefix + (n.replace("_", "-") if prefix else n)
    t, p, k = (number(temperature, named("temperature")), number(top_p, named("top_p")),
               integer(top_k, named("top_k")))
    if t < 0:
        raise S2DError(f"{named('temperature')} must be a finite number >= 0 (0 = greedy), "
                       f"got {t:g}")
    if not 0 < p <= 1:
        raise S2DError(f"{named('top_p')} must lie in (0, 1] (1 = off), got {p:g}")
    if k < 0:
        raise S2DError(f"{named('top_k')} must be >= 0 (0 = off), got {k}")
    return t, p, k


def callable_or_none(value, name: str):
    if value is not None and not callable(value):
        raise S2DError(f"{name} must be a function (or None), got {_shown(value)} "
                       f"({_kind(value)})")
    return value


def switch(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise S2DError(f"{name} must be True or False, got {_shown(value)} ({_kind(value)})")
    return value


# The example a list of strings' error shows, by the argument's name: training overrides
# and a request's stop strings are lists of very different strings.
STRINGS_EXAMPLES = {"overrides": "['optimizer.lr=1e-4']", "stop": "'\\n\\n' or ['\\n\\n', 'User:']"}


def strings_list(value, name: str, allow_empty: bool = True) -> list[str]:
    """A list of strings (a lone string is refused: it is not a list of one)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or \
            isinstance(value, dict):
        raise S2DError(f"{name} must be a list of strings, got {_shown(value)} "
                       f"({_kind(value)}); pass e.g. "
                       f"{STRINGS_EXAMPLES.get(name, repr(['one', 'two']))}")
    items = list(value)
    for i, v in enumerate(items):
        if not isinstance(v, str):
            raise S2DError(f"{name}[{i}] must be a string, got {_shown(v)} ({_kind(v)})")
    if not allow_empty and not items:
        raise S2DError(f"{name} is an empty list")
    return items


def decode_settings(max_new_tokens, temperature, top_k, top_p, seed) -> dict:
    """The per-request decoding settings of the API (Chat, generate, Decoder.generate) and
    of every decoding CLI (their flags reach these functions)."""
    t, p, k = sampling(temperature, top_p, top_k)
    return {"max_new_tokens": integer(max_new_tokens, "max_new_tokens", 1),
            "temperature": t, "top_k": k, "top_p": p, "seed": integer(seed, "seed", 0)}


def model_setting(method, methods, gamma=None, thresholds=None, exit=None, exits=None,
                  dtype=None, dtypes=None) -> None:
    """How a model is decoded (load_decoder / Chat / generate): the method one of `methods`,
    gamma and exit >= 1, thresholds in [0, 1], exits >= 1, dtype one of `dtypes`."""
    choice(method, "method", methods)
    integer(gamma, "gamma", 1, optional=True)
    numbers_list(thresholds, "thresholds", 0.0, 1.0, optional=True)
    integer(exit, "exit", 1, optional=True)
    integers_list(exits, "exits", 1, optional=True)
    if dtypes is not None:
        choice(dtype, "dtype", dtypes, optional=True)


def token_prompts(prompts, name: str = "prompts") -> list[list[int]]:
    """A batch of token-id prompts: a list of lists of non-negative integers."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise S2DError(f"{name} must be a list of token-id lists, got {_shown(prompts)} "
                       f"({_kind(prompts)}); encode text with the tokenizer first")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
            raise S2DError(f"{name}[{i}] must be a list of token ids, got {_shown(p)} "
                           f"({_kind(p)})")
        out.append([integer(t, f"{name}[{i}] token", 0) for t in p])
    return out
