"""AdamW with no-decay groups for norms and biases, and a warm-up + cosine LR schedule."""

from __future__ import annotations

import math
from typing import List

import torch


def set_lr(group: dict, value: float) -> None:
    """Set a param group's LR in place: capturable FusedAdam (CUDA graphs) keeps it as a device
    tensor that its step reads, so that is filled; a plain number is replaced."""
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Two groups: matrices decay; norms, biases and other 1-D params don't.

    "params" comes first in each dict: Megatron-FSDP finds the model from the first value of
    the first group.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue  # frozen: no optimizer state at all
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: torch.nn.Module, optim_cfg, *, fused_ok: bool = False) -> torch.optim.Optimizer:
    groups = param_groups(model, optim_cfg.weight_decay)
    kwargs = dict(lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)
    if optim_cfg.impl == "te_fused":
        from transformer_engine.pytorch.optimizers import FusedAdam

        return FusedAdam(groups, adam_w_mode=True, **kwargs)
    return torch.optim.AdamW(groups, fused=True if fused_ok else None, **kwargs)


def lr_at(step: int, optim_cfg, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then cosine to min_lr_ratio * lr."""
    base = optim_cfg.lr
    warmup = optim_cfg.warmup_steps
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    decay = max(1, (optim_cfg.decay_steps or total_steps) - warmup)
    progress = min(1.0, (step - warmup) / decay)
    floor = base * optim_cfg.min_lr_ratio
    return floor + 0.5 * (base - floor) * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int):
    """A LambdaLR over lr_at; created after the engine wrapped the optimizer's step."""
    base = optim_cfg.lr
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, optim_cfg, total_steps) / base
    )
