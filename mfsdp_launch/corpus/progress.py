"""Progress of ``prepare``: a rich bar on a terminal, a plain line every few seconds otherwise."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

PLAIN_EVERY_S = 10.0


def _rates(nbytes: float, ntokens: float, elapsed: float) -> str:
    e = max(elapsed, 1e-9)
    return f"{nbytes / e / 1e6:.2f} MB/s, {ntokens / e / 1e3:,.0f}k tokens/s"


class Progress:
    """Counts input bytes and tokens of this run; rates are over this run (a resume starts at 0)."""

    def __init__(self, total_bytes: int, total_shards: int, done_bytes: int = 0, done_shards: int = 0,
                 stream: Optional[TextIO] = None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.total_bytes, self.total_shards = total_bytes, total_shards
        self.base_bytes, self.shards = done_bytes, done_shards
        self.nbytes = self.ntokens = 0
        self.start = self.last_line = time.perf_counter()
        self.enabled = enabled
        self._rich = None
        if enabled and hasattr(self.stream, "isatty") and self.stream.isatty():
            self._start_rich()

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeRemainingColumn

        self._rich = RichProgress(
            TextColumn("prepare"), BarColumn(), TextColumn("{task.fields[done]}"),
            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
            console=Console(file=self.stream), transient=False)
        self._task = self._rich.add_task("prepare", total=max(self.total_bytes, 1),
                                         completed=self.base_bytes, done="", rate="")
        self._rich.start()

    def _fields(self) -> dict:
        done = f"{(self.base_bytes + self.nbytes) / 1e6:,.1f}/{self.total_bytes / 1e6:,.1f} MB, " \
               f"shard {self.shards}/{self.total_shards}"
        return {"done": done, "rate": _rates(self.nbytes, self.ntokens, self.elapsed)}

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def advance(self, nbytes: int = 0, ntokens: int = 0, shards: int = 0) -> None:
        self.nbytes += nbytes
        self.ntokens += ntokens
        self.shards += shards
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=self.base_bytes + self.nbytes, **self._fields())
        elif time.perf_counter() - self.last_line >= PLAIN_EVERY_S:
            self.last_line = time.perf_counter()
            f = self._fields()
            print(f"prepare: {f['done']}, {f['rate']}", file=self.stream, flush=True)

    def close(self) -> str:
        """Stop the bar; returns the summary of this run's rates."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
        return f"{self.nbytes / 1e6:,.1f} MB in {self.elapsed:.1f} s: {_rates(self.nbytes, self.ntokens, self.elapsed)}"
