"""The straggler report: at every log step each rank's busy time per step is gathered (one
all_gather of one float on the CPU control group), and a rank slower than
`train.straggler_ratio` x the median of the others is named in the log line and in metrics.jsonl.

"Busy" is the time a rank spends on its own work, not waiting for the others: in synchronous data
parallelism every rank waits for the slowest one inside the collectives, so wall-clock step
times are all alike and name nobody. So:

* on a CPU rank: the training thread's CPU time (`time.thread_time`); a rank blocked in a gloo
  collective uses none. A rank slowed by a busy or slower CPU, or heavier data loading, shows.
* on a CUDA rank: the host's wall time between log steps before the device is synchronized
  (the host does not wait for the GPUs in between): a rank whose host stalls (data loading, CPU
  contention, a slow file system) shows; a slow GPU makes every rank's kernels wait and shows as
  lower MFU on all of them instead.

The row gets `step_busy_s` (this report's median), `step_busy_max_s`, `slowest_rank` and
`stragglers` (the ranks over the ratio, [] when none).
"""

from __future__ import annotations

import statistics
import time
from typing import List, Optional

import torch
import torch.distributed as dist


class StragglerReport:
    def __init__(self, ratio: float, world_size: int, device: torch.device, group=None):
        self.ratio, self.world_size, self.group = float(ratio), world_size, group
        self.clock = time.perf_counter if device.type == "cuda" else time.thread_time
        self.last = self.clock()

    @property
    def enabled(self) -> bool:
        return self.ratio > 0 and self.world_size > 1

    def check(self, steps: int) -> dict:
        """Collective (every rank, at every log step, before the device sync of the step timer):
        the report's fields for the metrics row, {} when off."""
        now = self.clock()
        busy, self.last = (now - self.last) / max(1, steps), now
        if not self.enabled:
            return {}
        mine = torch.tensor([busy], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        times = [float(t) for t in every]
        median = statistics.median(times)
        slowest = max(range(len(times)), key=lambda r: times[r])
        return {"step_busy_s": median, "step_busy_max_s": times[slowest], "slowest_rank": slowest,
                "stragglers": stragglers(times, self.ratio)}


def stragglers(times: List[float], ratio: float) -> List[int]:
    """The ranks whose time is over `ratio` x the median of the other ranks' times (with the
    rank itself in the median, one slow rank of two could never be over 2x it)."""
    order = sorted(range(len(times)), key=lambda r: times[r])
    ranked = [times[r] for r in order]
    out = []
    for i, r in enumerate(order):
        others = median_without(ranked, i)
        if others > 0 and times[r] > ratio * others:
            out.append(r)
    return sorted(out)


def median_without(ranked: List[float], i: int) -> float:
    """The median of the sorted list `ranked` without its item `i`."""
    m = len(ranked) - 1

    def at(k: int) -> float:
        return ranked[k if k < i else k + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def build(train_cfg, world_size: int, device: torch.device, group=None) -> Optional[StragglerReport]:
    report = StragglerReport(train_cfg.straggler_ratio, world_size, device, group)
    return report if report.enabled else None
