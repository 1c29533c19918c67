"""What every mixture-of-experts family counts once per step and reports the same way: the built-in
MoE (models/llama/moe.py, moe_stats.py) and Hugging Face's (models/hf/router_loss.py).

Torch-free at import."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def in_recompute() -> bool:
    """True while autograd recomputes a checkpointed block (activation checkpointing): its forward
    runs a second time, whose routing must not be counted again."""
    import torch

    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def sum_over_ranks(stats: "torch.Tensor") -> "torch.Tensor":
    """`stats` summed over every rank in place (a collective when distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    return stats


def load_max(loads: "torch.Tensor") -> "torch.Tensor":
    """`moe_load_max`: per MoE layer (a row of `loads` [layers, experts], tokens per expert), max /
    mean tokens per expert; 1.0 is balanced. On the device: the loop reads it at log steps only
    (components/metrics.host_values), so no step waits for it."""
    mean = loads.mean(dim=1).clamp(min=1e-9)
    return loads.max(dim=1).values / mean
