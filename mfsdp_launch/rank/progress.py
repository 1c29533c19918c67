"""Rank 0's progress: its log lines, `run.dir/progress.json` for the launcher's bar, and a rich bar
of its own when its stdout is a terminal (a rank started by hand; under the launcher the ranks'
stdout is torchrun's pipe and the launcher draws the bar, launcher/progress.py).

progress.json is {"step", "total", "time", "tokens_per_step"}, replaced atomically at most every
WRITE_EVERY_S seconds and at the end: no host sync (the step is a Python int), no per-step write.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from ..core.atomic_io import swap_text

WRITE_EVERY_S = 0.5


class RankProgress:
    def __init__(self, train_cfg, start: int, progress_file: Optional[Path] = None, tokens_per_step: int = 0):
        from rich.console import Console

        self.console = Console(highlight=False, file=sys.stdout, soft_wrap=True)
        self.total, self.tokens_per_step = int(train_cfg.steps), int(tokens_per_step)
        self.file = Path(progress_file) if progress_file is not None else None
        self.step, self.written = start, 0.0
        self.bar = None
        if train_cfg.progress and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=self.console, transient=True)
            self.task = self.bar.add_task("train", total=train_cfg.steps, completed=start)
            self.bar.start()
        self._write(force=True)

    def log(self, row: dict) -> None:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        at = row.get("mfu_at_precision")
        if row["mfu"] is not None and at != row["mfu"]:  # FP8 GEMMs: the FP8-weighted figure too
            mfu += f" of bf16 peak, {100 * at:.1f}% at precision" if at is not None else " of bf16 peak"
        tf = f"{row['tflops_per_gpu']:.2f}" if row["tflops_per_gpu"] is not None else "n/a"
        line = (f"step {row['step']:>6}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                f"gnorm {row['grad_norm']:.3f}  tok/s/gpu {row['tokens_per_s_per_gpu']:,.0f}  "
                f"TFLOP/s/gpu {tf}  MFU {mfu}  mem {row['peak_mem_gib']:.2f} GiB  "
                f"{row['step_time_s'] * 1000:.0f} ms/step")
        if row.get("stragglers"):
            line += f"  stragglers: rank {', '.join(map(str, row['stragglers']))}"
        (self.bar.console if self.bar else self.console).print(line)
        sys.stdout.flush()

    def log_val(self, row: dict, seconds: float) -> None:
        line = f"step {row['step']:>6}  val_loss {row['val_loss']:.4f}  val_ppl {row['val_ppl']:.2f}  ({seconds:.1f} s)"
        (self.bar.console if self.bar else self.console).print(line)
        sys.stdout.flush()

    def advance(self, step: int) -> None:
        self.step = step
        if self.bar is not None:
            self.bar.update(self.task, completed=step)
        self._write()

    def _write(self, force: bool = False) -> None:
        now = time.time()
        if self.file is None or (not force and now - self.written < WRITE_EVERY_S):
            return
        self.written = now
        record = {"step": self.step, "total": self.total, "time": now, "tokens_per_step": self.tokens_per_step}
        try:
            swap_text(self.file, json.dumps(record) + "\n")
        except OSError:
            self.file = None  # the bar is a nicety: never a reason to stop training

    def close(self) -> None:
        self._write(force=True)
        if self.bar is not None:
            self.bar.stop()
