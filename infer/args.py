"""Argument parsing shared by the entry points (`infer/`, `train/`): list flags, the
`[NAME=]PATH` target syntax and the `--fake-devices` flag.

Every parser raises a one-line S2DError naming the flag and the fix, which `cli_main`
prints as `error: ...` (argparse's own `type=` errors would print a usage block instead).
"""

from __future__ import annotations

import argparse
import os

from s2d_jax.errors import S2DError


def parse_floats(text: str, flag: str = "value", nonempty: bool = False) -> list[float]:
    """'0.6,0.4,0' -> [0.6, 0.4, 0.0]; empty items are skipped."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
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
        targets[name] = path
    return targets


def add_fake_devices_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fake-devices", type=int, default=0,
                        help="fake N CPU devices (sets XLA_FLAGS before JAX starts)")


def fake_cpu_devices(n: int) -> None:
    """Make the CPU backend show `n` devices. XLA reads the flag when the backend starts
    (the first device query), so call this before anything touches jax.devices()."""
    if n:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={n}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
