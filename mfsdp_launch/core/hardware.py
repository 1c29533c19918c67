"""What the machine has: GPU count without importing torch, and device peaks for MFU."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache
from typing import Optional, Tuple

# Dense bf16 tensor-core peaks (TFLOP/s), from the vendors' data sheets. Matched by substring of
# torch.cuda.get_device_name(); FP8 runs still report MFU against the bf16 peak (stated in logs).
BF16_PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("GB200", 2500.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
)


def peak_tflops_for(device_name: str) -> Optional[float]:
    for key, peak in BF16_PEAK_TFLOPS:
        if key in device_name:
            return peak
    return None


@lru_cache(maxsize=1)
def local_gpu_count() -> int:
    """NVIDIA GPUs visible to this process, found without initializing CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        if not ids:
            return 0
    found = 0
    proc = "/proc/driver/nvidia/gpus"
    if os.path.isdir(proc):
        found = len(os.listdir(proc))
    elif shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
            found = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            found = 0
    if visible is not None:
        return min(found, len(ids)) if found else 0
    return found


CPU_AUTO_PROCESSES = 2  # launcher.nproc_per_node=auto without a GPU: two gloo processes


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_compute_capability(index: int = 0) -> Tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)
