"""Per-token loss over an optimizer step: every target token of the global batch weighs the same,
whatever the split into micro-batches and data-parallel ranks (torchtitan PR #2206; Megatron-FSDP's
`calculate_per_token_loss` does the same with an unscaled gradient sum).

A micro-batch's loss is the mean over its own target tokens (labels != -100). With loss-masked
data (SFT) the micro-batches hold different numbers of targets, so the mean of those means would
weigh a target of a short answer more than one of a long answer, and change with the split. The
loop scales micro-batch `m`'s loss by ``w_m = n_m * world / N``, where ``n_m`` is its target
count and ``N`` the count summed over every micro-batch of every rank (one all-reduce of a
device scalar before the step's first forward; no host sync). Both engines average gradients
over the ``world / copies`` ranks that hold distinct tokens (``copies`` = tp: tensor-parallel
ranks read the same tokens and count them alike), so the applied gradient is
``sum over targets of the step / distinct targets``: the per-token mean. The step's loss,
``sum_m loss_m * w_m`` averaged over the world (Engine.check_step), is that same number.

Without a loss mask every micro-batch holds ``mbs * seq_len`` targets, ``w_m = 1 / ga``, and the
loop keeps its plain ``loss / ga`` (the losses of pretraining stay bitwise what they were).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..models.losses import IGNORE_INDEX


def target_count(batch: dict) -> torch.Tensor:
    """The target tokens of one micro-batch (int64 device scalar)."""
    return (batch["labels"] != IGNORE_INDEX).sum()


def step_weights(batches: Sequence[dict], world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w [ga] fp32, N int64 scalar): each micro-batch's loss weight and the step's target count
    summed over every rank (each tensor-parallel copy counted; see the module docstring).
    Collective (every rank, same order); nothing waits on the device."""
    counts = torch.stack([target_count(b) for b in batches]).to(torch.int64)
    total = counts.sum()
    if world > 1:
        dist.all_reduce(total)
    weights = (counts.double() * world / total.clamp(min=1).double()).float()
    return weights, total


def distinct_targets(total: int, copies: int) -> int:
    """The step's distinct target tokens from `step_weights`' total (tp copies counted once)."""
    return int(total) // max(1, int(copies))


def weighted_mean(losses: List[torch.Tensor], counts: List[torch.Tensor], world: int) -> float:
    """Per-token mean of micro-batch means over every rank (validation): sum(loss * n) / sum(n).
    Collective."""
    pair = torch.stack([sum(l.float() * n for l, n in zip(losses, counts)),
                        sum(n.float() for n in counts)]).double()
    if world > 1:
        dist.all_reduce(pair)
    total, n = pair.tolist()
    return total / n if n else float("nan")
