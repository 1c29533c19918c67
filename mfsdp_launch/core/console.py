"""Messages to the user on stderr (a leaf module: the CLI entry points and the workers share it)."""

from __future__ import annotations

import sys


def eprint(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
