"""Named ranges of a model part in train.profile's traces, forward and backward, and what share of
that part's time some of its ops take: the MoE layers and their grouped GEMMs (issue 24's "grouped
GEMM >= 60 % of the MoE layers' time"), read from the profiler's own event tree, in which CUPTI's
records of the host waiting to launch count no GPU time (NOT_GPU_WORK; the top-ops table drops them).

A forward range is a record_function around the part. Its backward has no call to wrap: a hook on
the part's output gradient opens the range (autograd is about to run the part's backward) and a
hook on its input gradient closes it (every gradient through the part has arrived). Only while the
profiler records, outside torch.compile and outside activation checkpointing's recompute."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

if TYPE_CHECKING:
    import torch

MOE = "mfsdp.moe"  # the MoE layers' ranges: MOE + ".forward", MOE + ".backward"
# The expert GEMMs among a MoE layer's ops: bf16 grouped, FP8 grouped (torchao), the padded bmm.
GROUPED_GEMM_OPS = ("aten::_grouped_mm", "aten::_scaled_grouped_mm", "aten::bmm")


def _recording() -> bool:
    import torch

    return bool(torch.autograd.profiler._is_profiler_enabled) and not torch.compiler.is_compiling()


def profiled(name: str, x: "torch.Tensor", run: Callable[["torch.Tensor"], "torch.Tensor"],
             in_recompute: Callable[[], bool] = lambda: False) -> "torch.Tensor":
    """run(x), inside the ranges name.forward and (its backward) name.backward while profiling;
    `in_recompute` (asked only then): activation checkpointing recomputes the part, no ranges."""
    if not _recording() or in_recompute():
        return run(x)
    import torch

    with torch.profiler.record_function(name + ".forward"):
        y = run(x)
    if not (torch.is_grad_enabled() and x.requires_grad and y.requires_grad):
        return y
    backward = torch.profiler.record_function(name + ".backward")

    def enter(grad):
        backward.__enter__()
        return grad

    def leave(grad):
        if backward.record is not None:
            backward.__exit__(None, None, None)
            backward.record = None
        return grad

    y.register_hook(enter)
    x.register_hook(leave)
    return y


# Events that carry device time but are no GPU work: CUPTI's record of the host waiting on a full
# launch queue is timed as device time (in a launch-bound eager step it exceeds the step's kernels).
NOT_GPU_WORK = ("Command Buffer Full",)


def without_waits(averages):
    """torch.profiler's key_averages() without NOT_GPU_WORK rows: the top-ops table's first row and
    its percentages otherwise come from the host's waits (360 % of a step's kernels, seen on an H200)."""
    from torch.autograd.profiler_util import EventList

    kept = [a for a in averages if a.key not in NOT_GPU_WORK]
    if len(kept) == len(averages):
        return averages
    return EventList(kept, use_device=getattr(averages, "_use_device", None),
                     profile_memory=getattr(averages, "_profile_memory", False),
                     with_flops=getattr(averages, "_with_flops", False))


def _time(evt, on_gpu: bool) -> float:
    """`evt`'s time with its children's: on the GPU, the device time of its own kernels and theirs,
    without NOT_GPU_WORK events anywhere below it."""
    if not on_gpu:
        return evt.cpu_time_total
    if evt.name in NOT_GPU_WORK:
        return 0.0
    return evt.self_device_time_total + sum(_time(c, True) for c in evt.cpu_children)


def _inner_time(evt, ops: Sequence[str], on_gpu: bool) -> float:
    """The time of the ops named `ops` below `evt` (a matched op's own children are not searched)."""
    total = 0.0
    for child in evt.cpu_children:
        total += _time(child, on_gpu) if child.name in ops else _inner_time(child, ops, on_gpu)
    return total


def share_line(events: Iterable, name: str, ops: Sequence[str], on_gpu: bool, what: str) -> Optional[str]:
    """One line: the time of the ranges `name`.forward/.backward in the profiled steps, and the share
    of it the ops `ops` take; None when no such range was recorded. `events`: prof.events()."""
    events = list(events)
    ranges = [e for e in events if e.name in (name + ".forward", name + ".backward")]
    if not ranges:
        return None
    unit = "GPU" if on_gpu else "CPU"
    whole = sum((e.self_device_time_total if on_gpu else e.self_cpu_time_total) for e in events
                if not (on_gpu and e.name in NOT_GPU_WORK))
    part = sum(_time(e, on_gpu) for e in ranges)
    inner = sum(_inner_time(e, ops, on_gpu) for e in ranges)
    share = f"{100 * inner / part:.1f} %" if part else "n/a"
    of_steps = 100 * part / max(whole, 1e-9)
    return (f"{what}: {part / 1e3:.1f} ms of {unit} time in {len(ranges)} ranges ({of_steps:.1f} % of the profiled "
            f"steps); {' + '.join(ops)}: {inner / 1e3:.1f} ms, {share} of it")
