"""Stall watchdog: when training stops making progress, dump every thread's Python stack (to
stderr) and the flight recorder's last collectives (to run.dir/logs), per rank.

A distributed hang (a collective one rank never reaches, a deadlocked capture) otherwise shows
nothing until NCCL's timeout, and then only a C++ trace.

The stacks are read by a Python thread, under the GIL (`sys._current_frames`), so the dump is
safe at any moment, also during start-up while threads come and go. (`faulthandler`'s
dump_traceback_later reads the thread states from a C thread without the GIL, and crashed ranks
with SIGSEGV when it fired while threads were being created.) The training thread releases the
GIL while it waits in a collective or on the GPU, so the watchdog runs during a hang.

The flight recorder (`TORCH_FR_BUFFER_SIZE`, or `TORCH_NCCL_TRACE_BUFFER_SIZE` before torch 2.8;
the launcher turns it on) keeps the last collectives of every process group with their state
(scheduled, started, completed): `logs/flight_recorder_stall_rank<R>` (gloo and other CPU
backends) and `logs/flight_recorder_stall_nccl_rank<R>` (NCCL), pickles that PyTorch's analyzer
reads across ranks to name the collective a rank is missing:
`python -m torch.distributed.flight_recorder.fr_trace RUN/logs -p flight_recorder_stall_nccl_rank`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional, TextIO

from ..core import rundir


def format_stacks(label: str = "") -> str:
    """Every thread's Python stack, most recent call last, as one text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        parts.append(f"{label}thread {names.get(ident, '?')} ({ident:#x}), most recent call last:\n")
        parts.append("".join(traceback.format_stack(frame)))
    return "".join(parts)


def dump_flight_recorder(logs_dir: Path, rank: int) -> list:
    """Write the flight recorder's entries (if torch.distributed is up and recording); returns
    the files written."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    written = []
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return []
        from torch._C import _distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - a diagnostic must never take the rank down
        return []
    for attr, prefix in (("_dump_fr_trace", rundir.FLIGHT_RECORDER_STALL),
                         ("_dump_nccl_trace", rundir.FLIGHT_RECORDER_STALL_NCCL)):
        fn = getattr(c10d, attr, None)
        if fn is None:
            continue
        try:
            # No stack traces: symbolizing them from this thread during an NCCL hang crashed a
            # rank (SIGSEGV, torch 2.11 on H200); the Python stacks are printed beside it anyway.
            data = fn(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        except Exception:  # noqa: BLE001 - e.g. NCCL built in but not used
            continue
        path = Path(logs_dir) / f"{prefix}{rank}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            written.append(path)
        except OSError:
            pass
    return written


class StallWatchdog:
    """`arm()` once per completed step; after `seconds` without one, dump (and again every
    `seconds` while the stall lasts; the flight recorder once per stall)."""

    def __init__(self, seconds: Optional[float], label: str = "", logs_dir: Optional[Path] = None,
                 rank: Optional[int] = None, file: Optional[TextIO] = None):
        self.seconds = float(seconds) if seconds else None
        self.label = label
        run_dir = os.environ.get("MFSDP_RUN_DIR")
        self.logs_dir = Path(logs_dir) if logs_dir else (Path(run_dir) / rundir.LOGS if run_dir else None)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.file = file
        self._last = time.monotonic()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def arm(self) -> None:
        """(Re)start the countdown; call once per completed step."""
        self._last = time.monotonic()

    def start(self) -> None:
        if self.seconds is None:
            return
        print(f"{self.label}stall watchdog: stacks go to stderr after {self.seconds:g} s without a step",
              file=self.file or sys.stderr, flush=True)
        self.arm()
        self._thread = threading.Thread(target=self._watch, name="mfsdp-stall-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def _watch(self) -> None:
        dumped_for = None  # the _last value of the stall whose flight recorder was written
        while not self._stopped.is_set():
            since = time.monotonic() - self._last
            if since < self.seconds:
                self._wake.wait(self.seconds - since)
                continue
            stalled_at = self._last
            self._dump(since, with_recorder=dumped_for != stalled_at)
            dumped_for = stalled_at
            self._wake.wait(self.seconds)

    def _dump(self, since: float, with_recorder: bool) -> None:
        out = self.file or sys.stderr
        text = (f"{self.label}stall watchdog: no step for {since:.1f} s; Python stacks:\n"
                + format_stacks(self.label))
        if with_recorder and self.logs_dir is not None:
            for path in dump_flight_recorder(self.logs_dir, self.rank):
                text += f"{self.label}stall watchdog: flight recorder written to {path}\n"
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass
