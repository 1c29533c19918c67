"""The parent-death signal: a process that must not outlive its parent (torchrun under the
launcher, a rank under torchrun) asks the kernel to kill it when the parent exits."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Optional

_PR_SET_PDEATHSIG = 1
_LIBC: list = []


def libc():
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def set_parent_death_signal(sig: int = signal.SIGKILL, expected_parent: Optional[int] = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux; elsewhere a
    no-op returning False). If the parent is already gone (it died before this call), exit now."""
    lib = libc()
    if lib is None:
        return False
    try:
        ok = lib.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except AttributeError:
        return False
    parent = os.getppid()
    if parent == 1 or (expected_parent is not None and parent != expected_parent):
        os._exit(128 + int(sig))
    return ok
