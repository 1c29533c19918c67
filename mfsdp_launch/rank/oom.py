"""Out of GPU memory at run time: the failing rank prints one line (step, measured peak, the GPU's
total, the estimate and the same hint as the pre-spawn check) instead of a wall of tracebacks.

The loop tags an escaping exception with the step it happened in (`note_step`); the worker asks
`is_oom` and prints `oom_line` as the first line of its failure block, then the traceback, which
the launcher keeps for run.dir/logs/ only (launcher/output.py shows a block that starts with `LINE_RE`
as its first line). Imports no torch at module level: the launcher reads `LINE_RE`.
"""

from __future__ import annotations

import re
from typing import Optional

from ..planner.memory import GIB, HINT

LINE_RE = re.compile(r"^mfsdp-train: rank \d+ ran out of GPU memory")
# torch.cuda.OutOfMemoryError's text, CUDA's own error string, NCCL's and cuBLAS's allocation failures.
_OOM_TEXT = re.compile(r"(CUDA|NCCL|cuBLAS|CUBLAS|cuDNN|cudnn)[^\n]*out of memory|out of memory[^\n]*(CUDA|NCCL)|"
                       r"CUBLAS_STATUS_ALLOC_FAILED", re.I)
_TRIED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
_STEP_ATTR = "mfsdp_step"


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_oom(exc: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, or a RuntimeError whose text is a CUDA/NCCL out-of-memory,
    anywhere in the exception's chain (DCP and NCCL wrap them)."""
    import torch

    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    for e in _chain(exc):
        if oom_type is not None and isinstance(e, oom_type):
            return True
        if isinstance(e, RuntimeError) and _OOM_TEXT.search(str(e)):
            return True
    return False


def note_step(exc: BaseException, step: int) -> None:
    """Record on `exc` the step (1-based, the one being trained) it escaped from; the first wins."""
    try:
        if getattr(exc, _STEP_ATTR, None) is None:
            setattr(exc, _STEP_ATTR, step)
    except AttributeError:  # an exception type with __slots__
        pass


def _peaks() -> Optional[str]:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).total_memory
    return (f"peak {torch.cuda.max_memory_allocated(dev) / GIB:.1f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved(dev) / GIB:.1f} GiB reserved, of the GPU's {total / GIB:.1f} GiB")


def oom_line(exc: BaseException, rank: int, estimate_gib: Optional[float] = None) -> str:
    """`mfsdp-train: rank 1 ran out of GPU memory at step 3: peak ... GiB ...; try ...`."""
    step = getattr(exc, _STEP_ATTR, None)
    where = f"at step {step}" if step is not None else "outside a training step (start-up, resume, last save)"
    parts = [_peaks() or "no CUDA device to measure a peak on"]
    tried = next((m.group(1) for m in map(_TRIED.search, (str(e) for e in _chain(exc))) if m), None)
    if tried:
        parts.append(f"it tried to allocate {tried} more")
    if estimate_gib is not None:
        parts.append(f"the estimate was ~{estimate_gib:.1f} GiB")
    return (f"mfsdp-train: rank {rank} ran out of GPU memory {where}: {', '.join(parts)}; {HINT} "
            f"(traceback in logs/rank{rank}.stderr.log)")


def estimate_gib(cfg) -> Optional[float]:
    """The dry run's per-rank estimate for `cfg`, or None (never fails: it runs inside a failure)."""
    try:
        from ..planner.memory import estimate
        from ..mesh import ParallelDims, world_size

        return estimate(cfg, ParallelDims.from_config(cfg.mesh, world_size(cfg.launcher))).total / GIB
    except Exception:  # noqa: BLE001 - a report of a failure must not fail
        return None
