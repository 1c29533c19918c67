"""Context parallelism for the torch `gpt` (models/llama/gpt_modules.py): the sequence is split over the
mesh's `cp` dim, and attention all-gathers keys and values (Llama 3's all-gather CP).

Each cp rank holds two of 2*cp equal chunks of every sequence (models/cp_layout.py: chunks r and
2*cp-1-r, which balances causal attention work). Everything but attention is per token, so only
attention talks: each layer all-gathers K and V over cp, puts them in global order, and each of
the rank's two query chunks attends to the keys before its end with a lower-right causal mask
(`causal_lower_right`; on CUDA SDPA runs it on the flash/efficient kernels). The backward
reduce-scatters (sums) the gathered K/V gradient back to the rank that owns each token. RoPE reads
the local tokens' global positions.

Why not torch's `context_parallel` (ring attention): it is CUDA-only and a private, experimental
API that changed between torch 2.11 and 2.13, and CPU/gloo must run the same code as the GPU.
All-gather CP costs K/V of the whole sequence per layer (small under GQA) and no ring schedule.

Gradients: each rank's loss is the mean over its local tokens (equal counts on every rank), so
the engines average gradients over dp_shard x cp (the "dp_shard_cp" dim) and get the global mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import cp_layout


class _GatherSequence(torch.autograd.Function):
    """[B, H, T/cp, D] local -> [cp, B, H, T/cp, D] of every cp rank; the backward sums each rank's
    gradient of the gathered copy and hands every owner its part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group = group
        x = x.contiguous()
        # Stacked along dim 0 (gloo wants the output as one [cp*B, ...] tensor).
        out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out.view(cp, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().flatten(0, 1)
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


def gather_sequence(x: torch.Tensor, group, cp: int, seq_dim: int = 2) -> torch.Tensor:
    """The whole sequence of `x` (this rank's cp part along `seq_dim`), in global token order."""
    parts = _GatherSequence.apply(x, group, cp).unbind(0)
    return cp_layout.unshard_sequence(list(parts), dim=seq_dim)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_rank: int, cp: int,
                    scale=None) -> torch.Tensor:
    """Causal attention of this rank's queries q [B, H, T/cp, D] (its two chunks) against the
    whole sequence's k, v [B, H, T, D] (heads already expanded for GQA); `scale`: SDPA's (None:
    1/sqrt(D))."""
    from torch.nn.attention.bias import causal_lower_right

    chunk = q.shape[2] // 2
    out = []
    for q_part, index in zip(q.split(chunk, dim=2), cp_layout.chunks_of(cp_rank, cp)):
        end = (index + 1) * chunk  # the chunk's last key, global
        bias = causal_lower_right(chunk, end)
        out.append(F.scaled_dot_product_attention(q_part, k[:, :, :end], v[:, :, :end], attn_mask=bias, scale=scale))
    return torch.cat(out, dim=2)


@dataclass
class ContextParallel:
    """What an Attention module needs to run over a cp group (set by `apply_context_parallel`)."""

    group: Any
    rank: int
    size: int

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of the local tokens (for RoPE)."""
        return cp_layout.positions(local_len * self.size, self.rank, self.size, device=device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> torch.Tensor:
        """q [B, H, T/cp, D], k/v [B, Hkv, T/cp, D] local -> attention output [B, H, T/cp, D]."""
        k, v = gather_sequence(k, self.group, self.size), gather_sequence(v, self.group, self.size)
        if k.shape[1] != q.shape[1]:
            # The lower-right flash/efficient paths of CausalBias (torch 2.11-2.13) take no GQA.
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return chunk_attention(q, k, v, cp_rank=self.rank, cp=self.size, scale=scale)


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Run the gpt's attention over `cp_mesh` (a 1-D DeviceMesh, or a ProcessGroup), in place."""
    from .gpt_modules import Attention

    group = cp_mesh if isinstance(cp_mesh, dist.ProcessGroup) else cp_mesh.get_group()
    cp = ContextParallel(group, dist.get_rank(group), dist.get_world_size(group))
    for module in model.modules():
        if isinstance(module, Attention):
            module.context_parallel = cp
