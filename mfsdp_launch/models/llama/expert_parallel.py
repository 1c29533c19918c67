"""Expert parallelism (mesh.ep > 1) for the Llama family's MoE layers (models/llama/moe.py).

Each ep group (mfsdp_launch/mesh.py) splits every MoE layer's experts: rank i of the group keeps
experts [i * E/ep, (i+1) * E/ep). `apply_expert_parallel` turns the experts' weights into DTensors
sharded on the expert mesh's "ep" dim (dim 0, the expert dim; built identically on every rank, so
each keeps its slice without communication), gives each MoE layer an `AllToAllDispatcher`, and
marks the experts module with the mesh its own fully_shard takes (`fsdp_mesh`: "edp", with
dp_outer in front under HSDP) and scales their gradients by 1/ep (`grad_scale`).

Why 1/ep: an expert's gradient on rank r sums the contributions of every token its ep group sent
it; FSDP then averages it over the edp group (dp_outer x edp), so it holds the sum over every
rank's tokens divided by edp x dp_outer. The dense weights' gradients are the mean over the
dp_outer x dp_shard x cp ranks, ep times more. (torchtitan sets FSDP's gradient divide factor
instead; FSDP2 skips that division on a one-rank edp mesh, and gloo has no PREMUL_SUM for it,
so the scale is applied in the experts' backward, where it holds for every edp size.)
This is FSDP2's form: Megatron-FSDP scales expert gradients itself (engines/megatron_experts.py).

DCP saves the expert weights in their global shape [E, ...], so a checkpoint written at one ep
(or dp) resumes at any other.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn

from .moe import MoE, moe_layers


class AllToAllDispatcher:
    """Tokens to the ranks holding their experts and back, over one ep group.

    gloo (the CPU path) has all_to_all with uneven splits (alltoallv; checked on torch 2.13), as
    NCCL does, so both run the same code: one all_to_all of the per-expert counts, then one of the
    token rows each way (`_AllToAll`: the backward is the reverse exchange).
    """

    def __init__(self, group, ep: int, experts: int):
        self.group, self.ep, self.local = group, ep, experts // ep

    def run(self, xs: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """xs [A, dim]: this rank's (token, slot) rows grouped by global expert (`counts` [E] each)
        -> the experts' outputs in the same row order."""
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
    makes its output depend on them (moe._no_rows)."""

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


def apply_expert_parallel(model: nn.Module, mesh, dims) -> List[MoE]:
    """Split every MoE layer's experts over the ep groups of `mesh` (in place, before the engine
    shards); returns the layers. Validation checked that ep divides the experts and dp_shard x cp."""
    from torch.distributed.tensor import DTensor, Shard

    from ...mesh import build_expert_mesh

    emesh = build_expert_mesh(mesh, dims)
    ep_mesh = emesh["ep"]
    fsdp_mesh = emesh["dp_outer", "edp"] if dims.dp_outer > 1 else emesh["edp"]
    index = ep_mesh.get_local_rank()
    group = _token_group(dims)
    layers = moe_layers(model)
    for layer in layers:
        ex = layer.experts
        for name in ("w_gate_up", "w_down"):
            full = getattr(ex, name)
            part = full.detach().chunk(dims.ep, dim=0)[index].clone()
            local = DTensor.from_local(part, ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                       stride=full.stride())
            setattr(ex, name, nn.Parameter(local, requires_grad=full.requires_grad))
        ex.fsdp_mesh = fsdp_mesh
        ex.grad_scale = 1.0 / dims.ep
        layer.dispatcher = AllToAllDispatcher(group, dims.ep, layer.cfg.experts)
    return layers


def _token_group(dims):
    """A process group of this rank's ep group for the token all-to-alls alone. The mesh's own
    group of the same ranks may be FSDP's (dp_shard at ep = dp_shard), whose collectives autograd
    issues from hooks whose order relative to the all-to-all backward depends on each rank's
    routing (seen on gloo: a reduce-scatter met an all-to-all); on a group of their own the
    all-to-alls keep the one order their data dependencies give. Collective: every rank creates
    every ep group, in the same order."""
    groups = sorted({tuple(dims.expert_groups_of(r)["ep"]) for r in range(dims.world_size)})
    mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return mine
