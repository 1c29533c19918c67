"""What the command-line tools (mfsdp-export, mfsdp-generate, mfsdp-eval) share: bad input is one
line on stderr and exit 2, from argparse or from the tool itself."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from ..core.console import eprint
from ..core.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_tool(prog: str, body: Callable[[], int]) -> int:
    """`body()`'s exit code; a ConfigError, CheckpointError or DCP failure (a damaged shard, an
    unreadable file: DCP's BaseException too) becomes one line and exit 2."""
    from ..checkpoint.errors import CheckpointError, dcp_failures, describe

    try:
        return body()
    except (ConfigError, CheckpointError) as exc:
        eprint(f"{prog}: error: {exc}")
        return 2
    except dcp_failures() as exc:
        eprint(f"{prog}: error: {describe(exc)}")
        return 2
