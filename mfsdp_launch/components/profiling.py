"""train.profile: torch.profiler over a window of steps. Each rank writes its chrome trace into
run.dir/profile/; rank 0 prints the top ops (self device time on GPUs, self CPU time on CPU) and
writes the same table to run.dir/profile/top_ops.txt, with a line on the MoE layers' time and their
grouped GEMMs' share of it where the model has MoE layers (components/profile_ranges.py). Torch is
imported where it is used, so validation (torch-free) can call `check_profile`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..core import rundir
from . import profile_ranges
from ..core.errors import ConfigError

if TYPE_CHECKING:
    import torch

PROFILE_DIR = rundir.PROFILE
TOP_OPS = "top_ops.txt"
TOP_N = 15


def trace_name(rank: int) -> str:
    return f"trace_rank{rank}.json.gz"


def check_profile(profile_cfg, steps: int) -> None:
    """One-line refusals for train.profile (called by validation)."""
    if profile_cfg is None:
        return
    if profile_cfg.steps < 0:
        raise ConfigError("train.profile.steps", f"must be >= 0, got {profile_cfg.steps}", "0 (off) or a step count")
    if profile_cfg.steps == 0:
        return
    if profile_cfg.start < 1:
        raise ConfigError("train.profile.start", f"must be >= 1 (the first step profiled), got {profile_cfg.start}")
    last = profile_cfg.start + profile_cfg.steps - 1
    if last > steps:
        raise ConfigError("train.profile", f"steps {profile_cfg.start}..{last} run past train.steps={steps}",
                          f"start + steps - 1 <= {steps}")


class StepProfiler:
    """Profiles steps start..start+steps-1 (1-based, as logged). `begin(step)` before a step runs,
    `end(step)` after it; steps outside the window cost one comparison."""

    def __init__(self, profile_cfg, run_dir: str, rank: int, device: "torch.device"):
        self.first = int(profile_cfg.start)
        self.last = self.first + int(profile_cfg.steps) - 1
        self.out = Path(run_dir) / PROFILE_DIR
        self.rank, self.device = rank, device
        self.prof = None  # a torch.profiler.profile while the window is open

    def begin(self, step: int) -> None:
        if step != self.first:
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=False)
        self.prof.start()

    def end(self, step: int) -> None:
        if self.prof is None or step != self.last:
            return
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.out / trace_name(self.rank)))
        if self.rank == 0:
            table = self.top_table()
            moe = profile_ranges.share_line(self.prof.events(), profile_ranges.MOE, profile_ranges.GROUPED_GEMM_OPS,
                                            self.device.type == "cuda", "MoE layers (forward + backward)")
            table += f"\n{moe}" if moe else ""
            (self.out / TOP_OPS).write_text(table + "\n")
            print(table, flush=True)
        self.prof = None

    def close(self) -> None:
        """A run that stops inside the window: stop the profiler, write nothing."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    def top_table(self) -> str:
        on_gpu = self.device.type == "cuda"
        key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        what = "self device (GPU) time" if on_gpu else "self CPU time"
        head = (f"top {TOP_N} ops by {what}, steps {self.first}-{self.last}, rank {self.rank} "
                f"(traces: {self.out}/trace_rank*.json.gz, open in chrome://tracing or Perfetto)")
        averages = self.prof.key_averages()
        if on_gpu:
            averages = profile_ranges.without_waits(averages)
        return head + "\n" + averages.table(sort_by=key, row_limit=TOP_N)


def build_profiler(train_cfg, run_dir: str, rank: int, device: "torch.device") -> Optional[StepProfiler]:
    profile_cfg = getattr(train_cfg, "profile", None)
    on = profile_cfg is not None and profile_cfg.steps > 0
    return StepProfiler(profile_cfg, run_dir, rank, device) if on else None
