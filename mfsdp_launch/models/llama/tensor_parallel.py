"""Tensor parallelism with sequence parallelism for the torch `gpt` (models/llama/gpt_modules.py), kept
apart from the model as torchtitan does: applied to a built model before FSDP2 shards it over the
data-parallel dims.

Megatron-style TP with sequence parallelism (SP): each rank of the `tp` mesh dim computes
`n_heads/tp` attention heads and `ffn_dim/tp` of the SwiGLU. Between them the residual stream, the
norms and the residual adds hold `T/tp` of the tokens (sequence dim 1): the embedding output is
scattered over tp, each attention/MLP input all-gathered over the sequence (its backward
reduce-scatters), each `wo`/`w_down` output reduce-scattered instead of all-reduced (its backward
all-gathers), and the final norm's output gathered before the head. The norm weights see 1/tp
of the tokens; an identity-forward/all-reduce-backward on each norm weight makes their gradients
whole, so FSDP2 (sharding over dp only) reduces the same gradient on every tp rank.

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


SEQ = 1  # gpt's activations are [B, T, H]


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over tp (a norm weight that saw 1/tp of the tokens)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _gather(x: torch.Tensor, group, dim: int = SEQ) -> torch.Tensor:
    """All-gather along the sequence dim."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, group, dim: int = SEQ) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over tp, then this rank's block of the sequence (gloo has no reduce-scatter)."""
    if dist.get_backend(group) == "gloo":
        x = x.clone(memory_format=torch.contiguous_format)  # summed in place: never the caller's tensor
        dist.all_reduce(x, group=group)
        return _split(x, group)
    seq_first = x.movedim(SEQ, 0).contiguous()
    out = seq_first.new_empty((seq_first.shape[0] // dist.get_world_size(group), *seq_first.shape[1:]))
    dist.reduce_scatter_tensor(out, seq_first, group=group)
    return out.movedim(0, SEQ)


class _Scatter(torch.autograd.Function):
    """Replicated -> sequence-sharded: split forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _GatherToReplicated(torch.autograd.Function):
    """Sequence-sharded -> replicated for what follows on every rank alike (the head): all-gather
    forward, this rank's block of the (identical) gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, ctx.dim), None, None


def scatter_sequence(x: torch.Tensor, group, dim: int = SEQ) -> torch.Tensor:
    """Enter sequence parallelism: this tp rank's block of the replicated `x` along `dim`."""
    return _Scatter.apply(x, group, dim)


def gather_sequence(x: torch.Tensor, group, dim: int = SEQ) -> torch.Tensor:
    """Leave sequence parallelism: the whole sequence, for layers replicated over tp."""
    return _GatherToReplicated.apply(x, group, dim)


class _GatherForTP(torch.autograd.Function):
    """Sequence-sharded -> the whole sequence for a column-parallel layer: all-gather forward,
    reduce-scatter backward (each rank's gradient is a partial sum over its heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterFromTP(torch.autograd.Function):
    """Row-parallel partial sums -> sequence-sharded sum: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def _fused_colwise_forward(linear: nn.Linear, x: torch.Tensor, *, parts: Sequence[int], rank: int,
                           tp: int) -> torch.Tensor:
    from torch.distributed.tensor import Partial, Replicate

    weight = linear.weight
    # Gather over tp; the gradient of the gathered copy is a partial sum, reduce-scattered back.
    full = weight.redistribute(weight.device_mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    rows, offset = [], 0
    for size in parts:
        local = size // tp
        rows.append(full[offset + rank * local: offset + (rank + 1) * local])
        offset += size
    return F.linear(x, torch.cat(rows))  # x: the whole sequence (_GatherForTP at the block's entry)


def _rowwise_forward(linear: nn.Linear, x: torch.Tensor, *, group) -> torch.Tensor:
    return _ReduceScatterFromTP.apply(F.linear(x, linear.weight.to_local()), group)


def _norm_forward(norm: nn.Module, x: torch.Tensor, *, group) -> torch.Tensor:
    weight = _CopyToTP.apply(norm.weight, group)
    return F.rms_norm(x, (x.shape[-1],), weight, norm.eps)


def _sequence_parallel(model: nn.Module, group) -> None:
    """Scatter after the embedding, gather after the final norm, gather at each attention/MLP
    input, norms on the local tokens with whole gradients."""
    embed = model.tok_emb.forward
    model.tok_emb.forward = lambda ids: scatter_sequence(embed(ids), group)
    final = functools.partial(_norm_forward, model.norm, group=group)
    model.norm.forward = lambda x: gather_sequence(final(x), group)
    for block in model.layers:
        for norm in (block.attn_norm, block.mlp_norm):
            norm.forward = functools.partial(_norm_forward, norm, group=group)
        attn, mlp = block.attn.forward, block.mlp.forward
        block.attn.forward = functools.partial(_gathered, attn, group=group)
        block.mlp.forward = functools.partial(_gathered, mlp, group=group)


def _gathered(forward, x: torch.Tensor, *args, group):
    return forward(_GatherForTP.apply(x, group), *args)


def _distribute(linear: nn.Linear, tp_mesh, placement) -> None:
    from torch.distributed.tensor import distribute_tensor

    w = linear.weight
    linear.weight = nn.Parameter(distribute_tensor(w.data, tp_mesh, [placement]), requires_grad=w.requires_grad)


def parallelize_gpt(model: nn.Module, tp_mesh) -> None:
    """Apply TP + SP over `tp_mesh` (a 1-D DeviceMesh) to a built `GPT`, in place."""
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
            linear.forward = functools.partial(_fused_colwise_forward, linear, parts=parts, rank=rank, tp=tp)
        for linear in (attn.wo, mlp.w_down):
            _distribute(linear, tp_mesh, Shard(1))
            linear.forward = functools.partial(_rowwise_forward, linear, group=group)
        # The attention's views and reshapes use these: each rank now holds 1/tp of the heads.
        attn.n_heads //= tp
        attn.n_kv_heads //= tp
    _sequence_parallel(model, group)
