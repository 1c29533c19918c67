"""What the machine has: GPU count without importing torch, and device peaks for MFU."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache
from typing import Optional, Tuple

# Dense (no sparsity) tensor-core peaks in TFLOP/s, (bf16, fp8), from the vendors' data sheets;
# fp8 None where the GPU has no FP8 tensor cores. Matched by substring of
# torch.cuda.get_device_name(), so a name that holds another (GB200 holds B200) comes first.
# `mfu` is against the bf16 figure for every run, FP8 ones too; `mfu_at_precision` blends in the
# fp8 one (core/mfu.py).
DENSE_PEAK_TFLOPS = (
    ("GH200", 989.0, 1979.0),
    ("H200", 989.0, 1979.0),
    ("H100 PCIe", 756.0, 1513.0),
    ("H100", 989.0, 1979.0),
    ("H800", 989.0, 1979.0),
    ("GB200", 2500.0, 5000.0),
    ("B200", 2250.0, 4500.0),
    ("A100", 312.0, None),
    ("A800", 312.0, None),
    ("L40S", 362.0, 733.0),
    ("L4", 121.0, 242.0),
    ("A10G", 70.0, None),
    ("RTX 4090", 165.0, 330.0),  # fp32 accumulation (fp16 accumulation is twice as fast)
)
PRECISIONS = ("bf16", "fp8")


def peak_tflops_for(device_name: str, precision: str = "bf16") -> Optional[float]:
    """The dense peak of `precision` (bf16 | fp8) of the first table entry the name holds."""
    column = 1 + PRECISIONS.index(precision)
    for entry in DENSE_PEAK_TFLOPS:
        if entry[0] in device_name:
            return entry[column]
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
