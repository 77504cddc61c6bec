"""User-facing errors and the CLI wrapper that turns them into one line and a non-zero exit."""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading


class S2DError(Exception):
    """A problem with the user's input: the message names the problem and the fix."""


def cli_main(fn):
    """Wrap a CLI `main(argv)` so that bad input prints one `error: ...` line and exits 2;
    SIGINT / SIGTERM unwind like Ctrl-C (so atomic outputs remove their temp files) and
    exit 130."""

    @functools.wraps(fn)
    def wrapper(argv=None):
        try:
            with _sigterm_as_interrupt():
                return fn(argv)
        except S2DError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("error: interrupted; nothing half-written was kept, rerun the command to "
                  "finish", file=sys.stderr)
            sys.exit(130)

    return wrapper


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM's default action kills the process without unwinding (temp dirs stay)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
