"""Argument parsing shared by the entry points (`infer/`, `train/`): the parser class,
list flags, range checks of numeric flags (finite floats only), the `[NAME=]PATH` target
syntax and the `--fake-devices` flag.

Every check raises a one-line S2DError naming the flag and the fix, which `cli_main`
prints as `error: ...` (argparse's own errors would print a usage block instead).
"""

from __future__ import annotations

import argparse
import math
import os
import re

from s2d_jax.config import finite_float
# the gamma check lives beside max_gamma (the library's benchmark uses it too)
from s2d_jax.decode.defaults import check_gamma  # noqa: F401
from s2d_jax.errors import S2DError
from s2d_jax.readers import expand_path


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each flag's default after its help unless the
    help already says it or there is none to show (unset, or a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = any(action.default is v for v in (None, False, argparse.SUPPRESS))  # not 0
        if "default" in text.lower() or unset or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose errors are one-line S2DErrors (cli_main prints them),
    whose --help shows defaults (HelpFormatter), and which reads negative number lists
    such as `--costs -1,2` as values, not options."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        # argparse's own pattern (-1, -.5) misses lists and exponents; no flag starts with
        # a digit, so anything like -1,2 or -1e-3 is a value
        self._negative_number_matcher = re.compile(r"^-[\d.][\d.,eE+-]*$")

    def error(self, message):
        raise S2DError(f"{message}; see {self.prog} --help")


def finite_number(text: str) -> float:
    """argparse `type=` for float flags: NaN and inf are refused (one line via `error`)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give a finite "
                                         f"value")
    return value


def path_arg(text: str) -> str:
    """argparse `type` of every path flag: `~` and `$VARS` expanded (readers.expand_path)."""
    return expand_path(text)


def check_at_least(args, minimums: dict[str, float]) -> None:
    """Refuse `args.<dest>` below its minimum (None = unset, allowed); NaN is refused too."""
    for dest, lo in minimums.items():
        v = getattr(args, dest)
        if v is not None and not v >= lo:
            raise S2DError(f"--{dest.replace('_', '-')} must be >= {lo:g}, got {v}")


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if not temperature >= 0 or math.isinf(temperature):
        raise S2DError(f"--temperature must be a finite number >= 0 (0 = greedy), got "
                       f"{temperature}")
    if not 0 < top_p <= 1:
        raise S2DError(f"--top-p must lie in (0, 1] (1 = off), got {top_p}")
    if top_k < 0:
        raise S2DError(f"--top-k must be >= 0 (0 = off), got {top_k}")


def check_output_path(path: str, flag: str = "--out", is_dir: bool = False) -> None:
    """Fail before any work when `path` cannot be written: its nearest existing ancestor
    must be a writable directory (a regular file there stops root too), and a file output
    must not be an existing directory."""
    if not is_dir and os.path.isdir(path):
        raise S2DError(f"{flag} {path} is a directory; pass a file path")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise S2DError(f"{flag} {path} cannot be created: {parent} is not a writable "
                       f"directory; choose another path")


def parse_floats(text: str, flag: str = "value", nonempty: bool = False) -> list[float]:
    """'0.6,0.4,0' -> [0.6, 0.4, 0.0]; empty items are skipped."""
    try:
        vals = [finite_float(float(x), flag) for x in text.split(",") if x.strip()]
    except ValueError:
        raise S2DError(f"{flag} {text!r} is not comma-separated numbers, e.g. 0.6,0.4,0")
    if nonempty and not vals:
        raise S2DError(f"{flag} is empty; give comma-separated numbers, e.g. 0.6,0.4,0")
    return vals


def parse_ints(text: str, flag: str = "value", minimum: int | None = None) -> list[int]:
    """'6,9,12' -> [6, 9, 12]; with `minimum`, at least one value and none below it."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = None
    if vals is None or (minimum is not None and (not vals or min(vals) < minimum)):
        kind = "integers" if minimum is None else f"integers >= {minimum}"
        raise S2DError(f"{flag} {text!r} is not comma-separated {kind}, e.g. 6,9,12")
    return vals


def parse_targets(specs: list[str], flag: str = "--target") -> dict[str, str]:
    """['l=models/demo/target-l', 'ckpt/vicuna'] -> {'l': ..., 'vicuna': 'ckpt/vicuna'}."""
    targets = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(spec)), spec
        if not name or not path:
            raise S2DError(f"bad {flag} {spec!r}; use PATH or NAME=PATH")
        if name in targets:
            raise S2DError(f"target name {name!r} given twice; name them NAME=PATH")
        targets[name] = expand_path(path)
    return targets


def add_fake_devices_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fake-devices", type=int, default=0,
                        help="fake N CPU devices (sets XLA_FLAGS before JAX starts)")


def fake_cpu_devices(n: int) -> None:
    """Make the CPU backend show `n` devices. XLA reads the flag when the backend starts
    (the first device query), so call this before anything touches jax.devices()."""
    if n < 0:
        raise S2DError(f"--fake-devices must be >= 0 (0 = the real devices), got {n}")
    if n:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
