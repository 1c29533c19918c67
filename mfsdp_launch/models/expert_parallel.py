"""Expert parallelism (mesh.ep > 1), the part every family shares: the experts' 3-D weights split
over the ep ranks, and the all-to-all that sends tokens to the ranks holding their experts.

Each ep group (mfsdp_launch/mesh.py) splits every MoE layer's experts: rank i of the group keeps
experts [i * E/ep, (i+1) * E/ep). `shard_expert_weights` turns an experts module's weights
([E, ...], the expert dim first) into DTensors sharded on the expert mesh's "ep" dim (built
identically on every rank, so each keeps its slice without communication), and marks the module
with the mesh its own fully_shard takes (`fsdp_mesh`: "edp", with dp_outer in front under HSDP,
engines/fsdp2.py) and the factor on its gradients (`grad_scale` = 1/ep; models/llama/expert_parallel.py
says why). Parameter names and global shapes do not change, so DCP checkpoints and the Hugging
Face load and export see the same tensors at every ep.

The families apply it: the Llama family's MoE layers (models/llama/expert_parallel.py) and the
experts blocks of Hugging Face MoE models (models/hf/expert_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class ExpertSplit:
    """What every MoE layer of one model shares under mesh.ep > 1."""

    ep_mesh: object  # the expert mesh's "ep" dim: the expert weights' DTensor mesh
    fsdp_mesh: object  # the experts' own fully_shard mesh: "edp" (x "dp_outer")
    index: int  # this rank's place in its ep group
    group: object  # the process group of the token all-to-alls (`token_group`)
    ep: int


def expert_split(mesh, dims) -> ExpertSplit:
    """The meshes and the token group of `mesh` (a collective: it creates every ep group)."""
    from ..mesh import build_expert_mesh

    emesh = build_expert_mesh(mesh, dims)
    ep_mesh = emesh["ep"]
    fsdp_mesh = emesh["dp_outer", "edp"] if dims.dp_outer > 1 else emesh["edp"]
    return ExpertSplit(ep_mesh, fsdp_mesh, ep_mesh.get_local_rank(), token_group(dims), dims.ep)


def shard_expert_weights(module: nn.Module, names: Sequence[str], split: ExpertSplit) -> None:
    """`module`'s weights `names` ([E, ...]) -> DTensors holding this rank's E/ep experts, in place;
    the module marked for its own fully_shard and its gradient scale."""
    from torch.distributed.tensor import DTensor, Shard

    for name in names:
        full = getattr(module, name)
        part = full.detach().chunk(split.ep, dim=0)[split.index].clone()
        local = DTensor.from_local(part, split.ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                   stride=full.stride())
        setattr(module, name, nn.Parameter(local, requires_grad=full.requires_grad))
    module.fsdp_mesh = split.fsdp_mesh
    module.grad_scale = 1.0 / split.ep


class AllToAllDispatcher:
    """Tokens to the ranks holding their experts and back, over one ep group.

    gloo (the CPU path) has all_to_all with uneven splits (alltoallv; checked on torch 2.13), as
    NCCL does, so both run the same code: one all_to_all of the per-expert counts, then one of the
    token rows each way (`_AllToAll`: the backward is the reverse exchange).
    """

    def __init__(self, group, ep: int, experts: int):
        self.group, self.ep, self.local = group, ep, experts // ep

    def run(self, xs: torch.Tensor, counts: torch.Tensor,
            experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """xs [A, dim]: this rank's (token, slot) rows grouped by global expert (`counts` [E] each)
        -> the experts' outputs in the same row order. `experts(rows, counts)` runs this rank's
        experts on rows grouped by local expert."""
        send = counts.view(self.ep, self.local)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # how many rows each source sends each expert
        sent_rows = send.sum(1).tolist()
        recv_rows = recv.sum(1).tolist()
        got = _all_to_all(xs, recv_rows, sent_rows, self.group)
        # Rows arrive by source rank, each source's rows by local expert: regroup them by expert.
        block_expert = torch.arange(self.local, device=xs.device).repeat(self.ep)
        row_expert = torch.repeat_interleave(block_expert, recv.flatten(), output_size=got.shape[0])
        perm = torch.argsort(row_expert, stable=True)
        out = experts(got[perm], recv.sum(0))
        back = out[torch.argsort(perm)]
        return _all_to_all(back, sent_rows, recv_rows, self.group)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of `group` (in_rows[i] to rank i) and back, the backward the reverse
    exchange, on c10d's synchronous all_to_all_single (torch.distributed.nn.functional's is
    deprecated). Every rank must run the backward: a rank whose experts received no rows still
    makes its output depend on them (models/llama/moe.py: _no_rows)."""

    @staticmethod
    def forward(ctx, x, out_rows: List[int], in_rows: List[int], group):
        ctx.rows, ctx.group = (out_rows, in_rows), group
        out = x.new_empty((sum(out_rows), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_rows, in_rows = ctx.rows
        back = grad.new_empty((sum(in_rows), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_rows, out_rows, group=ctx.group)
        return back, None, None, None


def _all_to_all(x: torch.Tensor, out_rows: List[int], in_rows: List[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_rows, in_rows, group)


def token_group(dims):
    """A process group of this rank's ep group for the token all-to-alls alone. The mesh's own
    group of the same ranks may be FSDP's (dp_shard at ep = dp_shard), whose collectives autograd
    issues from hooks whose order relative to the all-to-all backward depends on each rank's
    routing (seen on gloo: a reduce-scatter met an all-to-all); on a group of their own the
    all-to-alls keep the one order their data dependencies give. Collective: every rank creates
    every ep group, in the same order."""
    groups = sorted({tuple(dims.expert_groups_of(r)["ep"]) for r in range(dims.world_size)})
    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return mine
