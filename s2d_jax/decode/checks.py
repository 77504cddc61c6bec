"""Checks of the traced decode settings that every entry point shares, without JAX (a CLI
or a serving config is checked before JAX starts): one rule per setting, so a flag, a
calibrated s2d_serving.json and a Python call are refused alike."""

from __future__ import annotations

from s2d_jax import validate
from s2d_jax.errors import S2DError


def check_thresholds(thresholds, exits) -> tuple[float, ...]:
    """One escalation threshold per exit, each in [0, 1] (1 = never stop at that exit; NaN
    is refused) -> floats; None = 0 at every exit (always the first exit's token)."""
    exits = tuple(exits)
    if thresholds is None:
        return (0.0,) * len(exits)
    out = tuple(validate.numbers_list(thresholds, "thresholds", 0.0, 1.0, allow_empty=True))  # "0.5" is not a list
    if len(out) != len(exits):
        raise S2DError(f"got {len(out)} threshold(s) for {len(exits)} exit(s) {exits}; "
                       f"pass one threshold per exit")
    if any(not 0.0 <= t <= 1.0 for t in out):
        raise S2DError(f"thresholds must lie in [0, 1], got {list(out)}")
    return out


def check_stop_threshold(stop) -> float:
    """The dynamic draft length's stop threshold: in [0, 1] (0 = always gamma tokens)."""
    stop = validate.number(stop, "the draft stop threshold")
    if not 0.0 <= stop <= 1.0:
        raise S2DError(f"the draft stop threshold must lie in [0, 1] (0 = off), got {stop}")
    return stop


NGRAM_MAX = 16  # the longest suffix the lookup rung matches


def check_lookup(ngram, lookup_len, gamma: int) -> tuple[tuple[int, int], int]:
    """The lookup rung's n range (MIN, MAX with 1 <= MIN <= MAX <= NGRAM_MAX) and its most
    tokens in [0, gamma] (0 = gamma) -> (ngram, lookup_len) as ints."""
    ngram = tuple(validate.integers_list(ngram, "the lookup's n range", 1))
    if len(ngram) != 2 or not 1 <= ngram[0] <= ngram[1] <= NGRAM_MAX:
        raise S2DError(f"the lookup's n range must be MIN,MAX with 1 <= MIN <= MAX <= "
                       f"{NGRAM_MAX}, got {list(ngram)}")
    lookup_len = validate.integer(lookup_len, "the lookup length", 0)
    if lookup_len > gamma:
        raise S2DError(f"the lookup length must lie in [0, gamma = {gamma}] (0 = gamma), got "
                       f"{lookup_len}")
    return ngram, lookup_len
