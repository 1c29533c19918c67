"""MFU, twice. `mfu` is against the dense bf16 peak for every run, FP8 ones too: the figure the
peers report, so it compares across trainers. `mfu_at_precision` is against the peak of the
precision each GEMM ran in: with a share `s` of a token's training FLOPs in FP8 GEMMs
(core/fp8_flops.py),

    precision peak = 1 / (s / P_fp8 + (1 - s) / P_bf16)

the rate of a step whose every FLOP ran at its own precision's peak (each FLOP weighted by the
time it takes there, so 100 % is reachable exactly when every GEMM runs at its peak; the
arithmetic mean of the peaks would overstate what a mixed step can reach). Without FP8 GEMMs
(s = 0) it is the bf16 peak and both figures are equal; GEMMs in fp32 or fp16 also count against
the bf16 peak. Torch-free: the dry run states both.

`train.peak_tflops` restates the bf16 peak (a clock-limited part, a GPU not in the table); the
FP8 peak keeps the device's FP8:bf16 ratio: that of its table entry, or FP8_PER_BF16 (the ratio of
every FP8 GPU in core/hardware.py's table) for a device not in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .hardware import peak_tflops_for

FP8_PER_BF16 = 2.0
EXAMPLE_DEVICE = "H200"  # the dry run does not know the ranks' GPU: it quotes this one's peaks


@dataclass(frozen=True)
class Peaks:
    """Dense peaks in TFLOP/s (None: unknown) and where they came from."""

    bf16: Optional[float]
    fp8: Optional[float]
    source: str


def peaks_for(device_name: Optional[str], configured: Optional[float]) -> Peaks:
    """The peaks of a GPU by its name (None: a CPU); `configured`: train.peak_tflops."""
    bf16 = peak_tflops_for(device_name) if device_name else None
    fp8 = peak_tflops_for(device_name, "fp8") if device_name else None
    if configured:
        ratio = fp8 / bf16 if bf16 and fp8 else (None if bf16 else FP8_PER_BF16)
        return Peaks(float(configured), float(configured) * ratio if ratio else None, "train.peak_tflops")
    if device_name is None:
        return Peaks(None, None, "a CPU has no known peak")
    return Peaks(bf16, fp8 if bf16 else None, f"{device_name} dense bf16" if bf16 else f"unknown device {device_name!r}")


def precision_peak(peaks: Peaks, fp8_share: Optional[float]) -> Optional[float]:
    """The peak `mfu_at_precision` is against; None when a figure it needs is unknown."""
    if peaks.bf16 is None or fp8_share is None:
        return None
    if fp8_share <= 0:
        return peaks.bf16
    if peaks.fp8 is None:
        return None
    return 1.0 / (fp8_share / peaks.fp8 + (1.0 - fp8_share) / peaks.bf16)


def mfu(tflops: Optional[float], peak: Optional[float]) -> Optional[float]:
    return tflops / peak if tflops is not None and peak else None


def _share_text(fp8_share: float) -> str:
    return f"{100 * fp8_share:.1f}% of the FLOPs/token in FP8 GEMMs"


def start_line(peaks: Peaks, fp8_share: Optional[float]) -> str:
    """The start line's MFU part: both peaks, labelled."""
    if peaks.bf16 is None:
        return f"MFU null ({peaks.source})"
    line = f"MFU against {peaks.bf16:.0f} TFLOP/s ({peaks.source}); mfu_at_precision "
    if fp8_share is None:
        return line + "null (which GEMMs run in FP8 is not known for this model)"
    if fp8_share <= 0:
        return line + "the same (no FP8 GEMMs)"
    peak = precision_peak(peaks, fp8_share)
    if peak is None:
        return line + f"null (no FP8 peak known; {_share_text(fp8_share)})"
    return line + f"against {peak:.0f} TFLOP/s ({_share_text(fp8_share)} at {peaks.fp8:.0f}, the rest at {peaks.bf16:.0f})"


def dry_run_line(configured: Optional[float], fp8_share: Optional[float]) -> str:
    """The dry run's MFU lines: which peak each figure is against, before the GPU is known."""
    peaks = peaks_for(None if configured else EXAMPLE_DEVICE, configured)
    where = (f"train.peak_tflops={peaks.bf16:g} TFLOP/s (bf16)" if configured
             else f"the GPU's dense bf16 peak ({EXAMPLE_DEVICE}: {peaks.bf16:.0f} TFLOP/s)")
    if fp8_share is not None and fp8_share <= 0:
        return f"MFU: mfu and mfu_at_precision against {where}; no FP8 GEMMs"
    line = f"MFU: mfu against {where}\nMFU: mfu_at_precision against the FP8-weighted peak: "
    if fp8_share is None:
        return line + "the FP8 share is counted at the start, from the built model's FP8 layers"
    peak = precision_peak(peaks, fp8_share)
    fp8 = f"FP8 at {FP8_PER_BF16:g}x" if configured else f"{EXAMPLE_DEVICE}: FP8 {peaks.fp8:.0f}"
    return line + f"{_share_text(fp8_share)} ({fp8}, blended {peak:.0f} TFLOP/s)"
