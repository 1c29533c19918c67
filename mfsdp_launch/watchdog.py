"""Stall watchdog: dump every thread's Python stack when training stops making progress.

A distributed hang (a collective one rank never reaches, a deadlocked capture) otherwise shows
nothing until NCCL's timeout, and then only a C++ trace. `faulthandler` prints the Python stacks
from a C thread, so it works while the main thread is blocked inside a collective.
"""

from __future__ import annotations

import faulthandler
import sys
from typing import Optional


class StallWatchdog:
    def __init__(self, seconds: Optional[float], label: str = ""):
        self.seconds = float(seconds) if seconds else None
        self.label = label

    def arm(self) -> None:
        """(Re)start the countdown; call once per completed step."""
        if self.seconds is None:
            return
        faulthandler.dump_traceback_later(self.seconds, repeat=True, file=sys.stderr, exit=False)

    def start(self) -> None:
        if self.seconds is not None:
            print(f"{self.label}stall watchdog: stacks go to stderr after {self.seconds:g} s without a step",
                  file=sys.stderr, flush=True)
        self.arm()

    def stop(self) -> None:
        if self.seconds is not None:
            faulthandler.cancel_dump_traceback_later()
