"""Tensor parallelism for the torch `gpt` (models/gpt_modules.py), kept apart from the model as
torchtitan does: applied to a built model before FSDP2 shards it over the data-parallel dims.

Megatron-style TP, without sequence parallelism: each rank of the `tp` mesh dim computes
`n_heads/tp` attention heads and `ffn_dim/tp` of the SwiGLU; the block input is replicated over
tp, and the attention output projection and the down projection sum their partial results
(one all-reduce each in forward, and one each in backward for the input's gradient).

Parameters become DTensors on the tp mesh in the tp=1 layout, so DCP checkpoints reshard between
any tp degree:
  * `attn.wo`, `mlp.w_down`: Shard(1) (row-parallel); each rank uses its local columns.
  * `attn.wqkv` and `mlp.w_gate_up` are FUSED ([q|k|v], [gate|up] along rows). A contiguous
    Shard(0) of them does not give a rank its own heads' q, k and v, so each forward all-gathers
    them over tp and keeps its rows of every part; the backward reduce-scatters the gradient.
    That costs one extra all-gather of these weights per forward (over NVLink on a GPU); separate
    q/k/v and gate/up parameters would remove it but change the model's parameter names.
  * Embedding, norms and the head stay whole on every tp rank (FSDP shards them over dp).

Each module's `forward` is replaced in place and the head counts adjusted to the local ones, so
parameter names and FSDP unit classes are unchanged.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over tp (each rank saw part of the heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce of partial sums in forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _fused_colwise_forward(linear: nn.Linear, x: torch.Tensor, *, parts: Sequence[int], rank: int, tp: int,
                           group) -> torch.Tensor:
    from torch.distributed.tensor import Partial, Replicate

    weight = linear.weight
    # Gather over tp; the gradient of the gathered copy is a partial sum, reduce-scattered back.
    full = weight.redistribute(weight.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    rows, offset = [], 0
    for size in parts:
        local = size // tp
        rows.append(full[offset + rank * local: offset + (rank + 1) * local])
        offset += size
    return F.linear(_CopyToTP.apply(x, group), torch.cat(rows))


def _rowwise_forward(linear: nn.Linear, x: torch.Tensor, *, group) -> torch.Tensor:
    return _ReduceFromTP.apply(F.linear(x, linear.weight.to_local()), group)


def _distribute(linear: nn.Linear, tp_mesh, placement) -> None:
    from torch.distributed.tensor import distribute_tensor

    w = linear.weight
    linear.weight = nn.Parameter(distribute_tensor(w.data, tp_mesh, [placement]), requires_grad=w.requires_grad)


def parallelize_gpt(model: nn.Module, tp_mesh) -> None:
    """Apply TP over `tp_mesh` (a 1-D DeviceMesh) to a built `GPT`, in place."""
    from torch.distributed.tensor import Shard

    tp, rank, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    for block in model.layers:
        attn, mlp = block.attn, block.mlp
        if attn.n_heads % tp or attn.n_kv_heads % tp:  # validation refuses these first
            raise ValueError(f"tp={tp} does not divide the heads ({attn.n_heads}, kv {attn.n_kv_heads})")
        hd = attn.head_dim
        qkv_parts = (attn.n_heads * hd, attn.n_kv_heads * hd, attn.n_kv_heads * hd)
        ffn = mlp.w_down.in_features
        for linear, parts in ((attn.wqkv, qkv_parts), (mlp.w_gate_up, (ffn, ffn))):
            _distribute(linear, tp_mesh, Shard(0))
            linear.forward = functools.partial(_fused_colwise_forward, linear, parts=parts, rank=rank, tp=tp,
                                               group=group)
        for linear in (attn.wo, mlp.w_down):
            _distribute(linear, tp_mesh, Shard(1))
            linear.forward = functools.partial(_rowwise_forward, linear, group=group)
        # The attention's views and reshapes use these: each rank now holds 1/tp of the heads.
        attn.n_heads //= tp
        attn.n_kv_heads //= tp


PLANS = {"gpt": parallelize_gpt}


def parallelize(model: nn.Module, model_name: str, tp_mesh) -> None:
    """Apply the family's TP plan; validation only lets families with a plan here reach it."""
    from .family import find_module
    from .gpt_modules import GPT

    if model_name not in PLANS:
        raise ValueError(f"model={model_name} has no tensor-parallel plan")
    PLANS[model_name](find_module(model, GPT), tp_mesh)
