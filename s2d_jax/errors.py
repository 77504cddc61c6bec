"""User-facing errors and the CLI wrapper that turns them into one line and a non-zero exit."""

from __future__ import annotations

import functools
import sys


class S2DError(Exception):
    """A problem with the user's input: the message names the problem and the fix."""


def cli_main(fn):
    """Wrap a CLI `main(argv)` so that bad input prints one `error: ...` line and exits 2."""

    @functools.wraps(fn)
    def wrapper(argv=None):
        try:
            return fn(argv)
        except S2DError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper
