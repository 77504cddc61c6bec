"""Seconds since this process started, for a CLI's "time to first token": what a user
waits from pressing enter, imports included (most of a warm start is imports and loading,
which a clock started in main() would leave out)."""

from __future__ import annotations

import os
import time

_IMPORTED = time.time()  # the fallback's origin: where /proc is not readable


def _started_at() -> float:
    """The process's start as a time.time() value (Linux: /proc, to 10 ms)."""
    try:
        with open("/proc/self/stat") as f:
            # field 22 (starttime, clock ticks after boot); the name in field 2 may hold spaces
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_STARTED = _started_at()


def since_start() -> float:
    return time.time() - _STARTED
