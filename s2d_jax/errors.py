"""User-facing errors and the CLI wrapper that turns them into one line and a non-zero exit."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading


class S2DError(Exception):
    """A problem with the user's input: the message names the problem and the fix."""


# how long a stop may wait for the main thread: Python runs a signal's handler on the main
# thread between bytecodes only, and an XLA compile or a device wait holds it for seconds
HARD_STOP_S = 3.0


def cli_main(fn=None, *, hard_stop: bool = True):
    """Wrap a CLI `main(argv)` so that bad input prints one `error: ...` line and exits 2;
    SIGINT / SIGTERM unwind like Ctrl-C (so atomic outputs remove their temp files) and
    exit 130. hard_stop: where the main thread has not taken the signal within HARD_STOP_S
    (inside XLA), the process exits there (130) instead of finishing the compile;
    `@cli_main(hard_stop=False)`: a CLI with its own shutdown (the server)."""
    if fn is None:
        return functools.partial(cli_main, hard_stop=hard_stop)

    @functools.wraps(fn)
    def wrapper(argv=None):
        try:
            with _sigterm_as_interrupt(hard_stop):
                return fn(argv)
        except S2DError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("error: interrupted; nothing half-written was kept, rerun the command to "
                  "finish", file=sys.stderr)
            if hard_stop and _TAKEN[0]:
                # a signal unwinds a compile on the main thread while XLA's own threads
                # compile on: the interpreter's teardown beside them segfaults (exit -11)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(130)
            sys.exit(130)

    return wrapper


def _raise_interrupt(signum, frame):
    _TAKEN[0] += 1  # the main thread runs Python: it unwinds, no hard stop needed
    raise KeyboardInterrupt


_TAKEN = [0]  # signals the Python handler has taken (the hard stop's watcher compares)


@contextlib.contextmanager
def _sigterm_as_interrupt(hard_stop: bool = False):
    """SIGTERM's default action kills the process without unwinding (temp dirs stay)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_interrupt)
    own_sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if own_sigint:
        signal.signal(signal.SIGINT, _raise_interrupt)
    stop = _hard_stop() if hard_stop else contextlib.nullcontext()
    try:
        with stop:
            yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if own_sigint and signal.getsignal(signal.SIGINT) is _raise_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _hard_stop():
    """A thread that sees each SIGINT / SIGTERM as it arrives (signal.set_wakeup_fd: C
    writes the number to a pipe even while the main thread is inside XLA) and, where the
    Python handler has not run within HARD_STOP_S, ends the process (exit 130)."""
    import time
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # set_wakeup_fd's requirement
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        os.close(read_end)
        os.close(write_end)
        yield
        return

    def watch():
        seen = _TAKEN[0]
        while True:
            try:
                data = os.read(read_end, 1)
            except OSError:
                return
            if not data:
                return
            if data[0] not in (signal.SIGINT, signal.SIGTERM):
                continue
            seen += 1
            deadline = time.monotonic() + HARD_STOP_S
            while _TAKEN[0] < seen and time.monotonic() < deadline:
                time.sleep(0.05)
            if _TAKEN[0] >= seen:
                continue
            print("\nerror: interrupted while JAX was busy (compiling or computing); stopped "
                  "there without cleaning up, rerun the command to finish", file=sys.stderr,
                  flush=True)
            os._exit(130)

    threading.Thread(target=watch, name="s2d-hard-stop", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        os.close(write_end)  # the watcher's read returns b"": it ends
