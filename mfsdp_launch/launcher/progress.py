"""The launcher's progress bar: rank 0's position (`run.dir/progress.json`, rank/progress.py)
drawn with rich (step N/M, tokens/s, ETA) while the launcher's stdout is a terminal, whatever
torchrun does with the ranks' output. Not a terminal (a pipe, a log file, a batch job): nothing
is drawn; the ranks' plain log lines are the record.

The supervisor calls `poll()` from its wait loop (twice a second): the bar is refreshed there,
in the main thread, not by a thread of rich's; lines printed while it shows go above it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from ..core import rundir
from ..core.console import detach_dead_terminal


def wanted(train_cfg) -> bool:
    """train.progress and a terminal on stdout."""
    try:
        return bool(train_cfg.progress) and sys.stdout.isatty()
    except (AttributeError, ValueError, OSError):
        return False


class ProgressBar:
    def __init__(self, run_dir: Path, total_steps: int, *, enabled: bool):
        self.path = Path(run_dir) / rundir.PROGRESS
        self.total, self.enabled = int(total_steps), enabled
        self.since = time.time() - 1.0  # records of an earlier launch are not this one's
        self.bar = None
        self.mtime: Optional[float] = None

    def start(self) -> "ProgressBar":
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                            TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True,
                            auto_refresh=False, redirect_stdout=True, redirect_stderr=True)
        self.task = self.bar.add_task("train", total=self.total, completed=0, rate="")
        self._guard(self.bar.start)
        return self

    def poll(self) -> None:
        if self.bar is None:
            return
        record = self._read()
        if record is not None:
            rate = ""
            speed = self.bar.tasks[0].speed  # steps/s over rich's recent samples
            if speed and record.get("tokens_per_step"):
                rate = f"{speed * record['tokens_per_step']:,.0f} tok/s"
            self.bar.update(self.task, completed=int(record.get("step", 0)), rate=rate)
        self._guard(self.bar.refresh)

    def _read(self) -> Optional[dict]:
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self.mtime:
                return None
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        self.mtime = mtime
        if not isinstance(record, dict) or float(record.get("time", 0)) < self.since:
            return None
        return record

    def stop(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            self._guard(bar.stop)

    def _guard(self, fn) -> None:
        try:
            fn()
        except OSError:  # the terminal went away (SIGHUP): no bar, and nothing left to flush
            detach_dead_terminal()
            bar, self.bar = self.bar, None
            if bar is not None:
                try:
                    bar.stop()  # gives sys.stdout/stderr back
                except Exception:  # noqa: BLE001 - writing to /dev/null now; nothing else to do
                    pass
