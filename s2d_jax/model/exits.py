"""The one rule for a sorted draft's exits, without JAX (CLIs check before JAX starts).

Exits are layer counts e_1 < ... < e_m: exit i is layers [0, e_i) of the draft plus the
shared head. Training needs the last exit at the draft's full depth; decoding may stop
shallower (the draft's cache then holds only e_m layers). Every place that takes exits
(the SoFT config, a draft's stored `s2d_exits`, the decode spec, the chain, the cost
probes) asks `exits_problem` and words the error for its own source.
"""

from __future__ import annotations

import numbers


def exits_problem(exits, num_layers: int | None = None, *,
                  to_depth: bool = False) -> str | None:
    """Why `exits` are not a sorted draft's exits, or None when they are: a non-empty
    sequence of integers (not bools, not floats: nothing is rounded) >= 1, strictly
    increasing, at most `num_layers` (when given), ending at it when `to_depth`."""
    try:
        exits = list(exits)
    except TypeError:
        return "they are not a list of layer counts"
    if not exits:
        return "there are none"
    if not all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in exits):
        return "they are not all integers"
    if exits[0] < 1 or any(a >= b for a, b in zip(exits, exits[1:])):
        return "they are not strictly increasing layer counts >= 1"
    if num_layers is not None and exits[-1] > num_layers:
        return f"exit {exits[-1]} is deeper than the draft's {num_layers} layers"
    if to_depth and num_layers is not None and exits[-1] != num_layers:
        return f"the last exit {exits[-1]} is not the draft's depth {num_layers}"
    return None
