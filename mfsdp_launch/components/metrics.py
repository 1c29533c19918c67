"""Throughput, MFU and memory, written as one JSON line per logged step (rank 0 only)."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..core import rundir, storage
from ..core.mfu import Peaks, peaks_for
from .metrics_tail import MetricsTail


def device_peaks(device: torch.device, configured: Optional[float]) -> Peaks:
    """This device's dense bf16 and FP8 peaks (core/mfu.py); MFU is null rather than guessed when
    the device is unknown. `configured`: train.peak_tflops."""
    return peaks_for(torch.cuda.get_device_name(device) if device.type == "cuda" else None, configured)


def peak_reserved_gib(device: torch.device) -> Optional[float]:
    """The caching allocator's reserved peak (what runs out first; planner/memory.py aims at it); None on CPU."""
    return torch.cuda.max_memory_reserved(device) / 1024**3 if device.type == "cuda" else None


def alloc_retries(device: torch.device) -> Optional[int]:
    """How often the caching allocator had to free its cache and retry a cudaMalloc so far: a
    count that grows every step means memory is nearly full and the steps slow down."""
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) if device.type == "cuda" else None


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    # CPU: the process's peak resident set size (KiB on Linux, bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)


def host_values(row: dict) -> dict:
    """`row` with its tensors read to the host: 0-d ones as floats, 1-d ones (a figure per layer)
    as lists to 4 places, others as nested lists. A model's per-step metrics stay on the device
    until a log step needs them (one wait, then)."""

    def host(v):
        if not isinstance(v, torch.Tensor):
            return v
        if v.dim() == 1:
            return [round(x, 4) for x in v.tolist()]
        return v.item() if v.dim() == 0 else v.tolist()

    return {k: host(v) for k, v in row.items()}


class MetricsWriter:
    """Rank 0 writes metrics.jsonl, prints log lines and (optionally) TensorBoard scalars and
    W&B / MLflow rows (`logging_cfg`: the config's `logging` section; see trackers). `run_dir` may
    be an object store (core/storage.py: the rows are put there every few seconds and at close);
    the trackers' and TensorBoard's files go to `local_dir` (default: run_dir)."""

    def __init__(self, run_dir, *, enabled: bool, tensorboard: bool = False, start_step: int = 0,
                 logging_cfg=None, local_dir: Optional[Path] = None, data_tokens: Optional[int] = None):
        self.enabled = enabled
        self.data_tokens = data_tokens  # the training data's size: each row's epochs = tokens_seen / it
        self.path = storage.path(run_dir) / rundir.METRICS
        local_dir = Path(local_dir if local_dir is not None else run_dir)
        self._tb = None
        self._trackers = None
        if enabled and logging_cfg is not None:
            from .trackers import open_trackers

            self._trackers = open_trackers(logging_cfg, local_dir, resumed_step=start_step) or None
        self._tail = None
        if enabled:
            if not storage.is_remote(run_dir):  # a torn last line (a crash mid-write): its row again
                self._tail = MetricsTail(run_dir)
                self._tail.repair(self.path, start_step)
            self._drop_rows_after(start_step)
            self._file = storage.open_append(self.path)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(local_dir / "tensorboard"))
                except ImportError:
                    print("mfsdp-train: warning: logging.tensorboard=true but tensorboard is not installed",
                          file=sys.stderr)

    def _drop_rows_after(self, step: int, keep_aside: bool = False) -> None:
        """On resume, rows past the checkpoint were never committed: drop them so steps stay unique.
        `keep_aside`: append them to ROLLED_BACK_METRICS instead (a rollback's undone steps)."""
        if not self.path.exists():
            return
        keep, undone = [], []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            (keep if row.get("step", 0) <= step else undone).append(line)
        if keep_aside and undone:
            aside = storage.open_append(self.path.parent / rundir.ROLLED_BACK_METRICS)
            aside.write("".join(u + "\n" for u in undone))
            aside.close()
        text = "".join(k + "\n" for k in keep).encode()
        storage.atomic_write(self.path, lambda f: f.write(text))

    def rewind(self, step: int) -> None:
        """After a rollback to `step`: the rows of the later steps move to ROLLED_BACK_METRICS."""
        if not self.enabled:
            return
        self._file.close()
        self._drop_rows_after(step, keep_aside=True)
        self._file = storage.open_append(self.path)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.data_tokens and isinstance(row.get("tokens_seen"), int):
            row = {**row, "epochs": row["tokens_seen"] / self.data_tokens}
        self._file.write(json.dumps(row) + "\n")
        if self._tail is not None:
            self._tail.add(row)
        if self._trackers is not None:
            self._trackers.log(row)
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self._tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self._trackers is not None:
            self._trackers.close()
            self._trackers = None
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


class StepTimer:
    """Wall time per step; synchronizes CUDA only when a time is read (at log steps)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        dt, self.t0 = now - self.t0, now
        return dt
