"""Rank-side stop requests and process guards.

`install_process_guards` runs first thing in every rank (`python -m mfsdp_launch.rank`, the
command torchrun starts): the rank dies with torchrun (a parent-death signal), and SIGTERM,
SIGINT, SIGHUP or SIGUSR1 arriving at any time (also during start-up, before the training loop
listens) become a graceful stop request: the run dir's STOP file, which rank 0 checks after every
step. SLURM sends SIGUSR1 ahead of a time limit or preemption (`--signal`), and SIGTERM to every
process when it cancels or preempts a job.

`StopControl` is the same request seen from the training loop: a collective `requested(step)`
that every rank answers alike.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import List, Optional

from ..core import rundir

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def run_dir_from(argv: List[str]) -> Optional[Path]:
    """The run dir: $MFSDP_RUN_DIR (set by the launcher and the sbatch script), else the folder of
    the frozen config named by `--config`."""
    if os.environ.get("MFSDP_RUN_DIR"):
        return Path(os.environ["MFSDP_RUN_DIR"])
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve().parent
        if a.startswith("--config="):
            return Path(a.split("=", 1)[1]).resolve().parent
    return None


def install_process_guards(run_dir: Optional[Path]) -> None:
    from ..core.process import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)  # torchrun died (killed): so do we, at once
    stop_file = Path(run_dir) / rundir.STOP if run_dir is not None else None

    def request_stop(signum, _frame):
        if stop_file is not None:
            try:
                stop_file.touch()
            except OSError:
                pass

    for sig in STOP_SIGNALS:
        signal.signal(sig, request_stop)


class StopControl:
    """`requested(step)`: True on every rank once any rank got a stop signal or rank 0 sees the
    STOP file. Collective (an all_reduce on `group`, a CPU group): call it on every rank, once a
    step. The same all_reduce carries a vote (`requested(step, vote=...)`; any rank's True makes
    `voted` True on every rank): rank 0's "a time-based checkpoint is due", at no extra cost."""

    def __init__(self, run_dir, rank: int, group=None):
        self.stop_file = Path(run_dir) / rundir.STOP
        self.rank = rank
        self.group = group
        self.reason: Optional[str] = None  # the signal's name, or "STOP file"
        self._flag = None
        self.voted = False

    def install(self) -> "StopControl":
        def handler(signum, _frame):
            self.reason = self.reason or signal.Signals(signum).name

        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)
        return self

    def requested(self, step: int, vote: bool = False) -> bool:
        import torch
        import torch.distributed as dist

        if self._flag is None:
            self._flag = torch.zeros(2, dtype=torch.int32)
        local = self.reason is not None or (self.rank == 0 and self.stop_file.exists())
        if local and self.reason is None:
            self.reason = "STOP file"
        self._flag[0], self._flag[1] = int(local), int(vote)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group)
        stop, self.voted = self._flag.tolist()
        self.voted = bool(self.voted)
        return bool(stop)
