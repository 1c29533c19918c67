"""Messages to the user on stderr (a leaf module: the CLI entry points and the workers share it)."""

from __future__ import annotations

import sys


def eprint(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def detach_dead_terminal() -> None:
    """Point stdout and stderr at /dev/null: the terminal is gone (a closed window, SIGHUP) or the
    pipe reader left. What is still buffered then flushes without error, so the process ends with
    its own exit code instead of Python's 120 for an unflushable stdout."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass
    os.close(devnull)
