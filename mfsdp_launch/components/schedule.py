"""The LR schedule (`optim.schedule`): a linear warm-up, then cosine, linear, WSD or constant.

Every schedule is a pure function of the optimizer step, so a resume recomputes the LR of the
restored step exactly (components/optim.py `load_schedule`), whatever the world size. With
`D = optim.decay_steps or train.steps` (the step at which the LR reaches its floor,
`floor = min_lr_ratio * lr`) and `W = optim.warmup_steps`, for 0-based step `s`:

    warm-up   s < W:  lr * (s + 1) / W
    cosine:   floor + (lr - floor) * (1 + cos(pi * p)) / 2,  p = min(1, (s - W) / (D - W))
    linear:   lr - (lr - floor) * p
    wsd:      lr until S = max(W, D - round(decay_fraction * D)), then lr - (lr - floor) * q,
              q = min(1, (s - S) / (D - S))   (warm-up, stable, decay: "WSD")
    constant: lr
"""

from __future__ import annotations

import math

import torch

from ..core.schema import Schedule


def _progress(step: int, start: int, end: int) -> float:
    return min(1.0, max(0.0, (step - start) / max(1, end - start)))


def wsd_decay_start(optim_cfg, total_steps: int) -> int:
    """The first step of WSD's decay phase."""
    end = optim_cfg.decay_steps or total_steps
    return max(optim_cfg.warmup_steps, end - round(optim_cfg.decay_fraction * end))


def lr_at(step: int, optim_cfg, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based) under `optim_cfg.schedule`."""
    base, warmup = optim_cfg.lr, optim_cfg.warmup_steps
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    kind = Schedule(getattr(optim_cfg, "schedule", Schedule.cosine))
    if kind is Schedule.constant:
        return base
    end = optim_cfg.decay_steps or total_steps
    floor = base * optim_cfg.min_lr_ratio
    if kind is Schedule.cosine:
        return floor + 0.5 * (base - floor) * (1 + math.cos(math.pi * _progress(step, warmup, end)))
    if kind is Schedule.linear:
        return base - (base - floor) * _progress(step, warmup, end)
    start = wsd_decay_start(optim_cfg, total_steps)
    return base if step < start else base - (base - floor) * _progress(step, start, end)


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int):
    """A LambdaLR over lr_at; created after the engine wrapped the optimizer's step."""
    base = optim_cfg.lr
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, optim_cfg, total_steps) / base
    )
