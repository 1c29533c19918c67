"""Tensor, sequence and context parallelism for `te_gpt` through Transformer Engine's own layers,
the way Megatron-Bridge pairs TP with Megatron-FSDP (no DTensor TP: TE shards its weights itself).

* TP + sequence parallelism: each TransformerLayer is BUILT with `tp_size`, `set_parallel_mode=True`
  and `sequence_parallel=True` (models/llama/te_modules.py), seq-first (`sbhd`: TE's sequence parallelism
  splits dim 0). Its parameters are the local shards, tagged by TE with `tensor_model_parallel` and
  `partition_dim`, which Megatron-FSDP turns into DTensors of the full (tp=1) shape over its tp
  mesh dim. `te_modules.wire_parallel` hands the layers the mesh's tp group after the build. Between layers the
  residual stream is sharded over the sequence; `scatter_seq` / `gather_seq` enter and leave that
  region around the replicated embedding, final norm and head.
* The norm weights inside the layers see only their rank's tokens under sequence parallelism: their
  gradients are partial sums over tp (TE tags them `sequence_parallel`); `sync_sequence_parallel_grads`
  sums them before the optimizer, as Megatron's finalize_model_grads does.
* Context parallelism: `wire_parallel` gives each layer the cp group, its global ranks, a side stream and
  the "p2p" ring; batches arrive sharded with models/cp_layout.py's load-balanced layout, which is
  the one TE's attention and fused RoPE (cp_size/cp_rank offsets) expect.
* `tp_slice` maps a full (tp=1) weight onto this rank's shard, so weights drawn at the full shape
  give a tp=2 model exactly the tp=1 model's values (models/te_modules.init_te_model).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from .tensor_parallel import gather_sequence, scatter_sequence

# TE's fused SwiGLU fc1 holds [gate | up] per rank: a tp shard is [gate_r | up_r], not a contiguous
# row block of the full [gate | up].
GLU_WEIGHTS = ("fc1_weight", "fc1_bias")


def tp_slice(full: torch.Tensor, name: str, partition_dim: int, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's shard of a full TE weight `name` split along `partition_dim`."""
    if tp == 1:
        return full
    parts = full.chunk(2, dim=partition_dim) if name in GLU_WEIGHTS else (full,)
    return torch.cat([p.chunk(tp, dim=partition_dim)[tp_rank] for p in parts], dim=partition_dim)


def is_tp_sharded(param) -> bool:
    param = getattr(param, "orig_param", param)
    return bool(getattr(param, "tensor_model_parallel", False)) and getattr(param, "partition_dim", -1) >= 0


def is_sequence_parallel(param) -> bool:
    return bool(getattr(getattr(param, "orig_param", param), "sequence_parallel", False))


def scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Into TE's sequence parallelism: TE runs seq-first ([s, b, h]), so the sequence is dim 0."""
    return scatter_sequence(x, group, dim=0)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    return gather_sequence(x, group, dim=0)


def sync_sequence_parallel_grads(params: Iterable, tp_group, grad_attr: str = "grad") -> None:
    """Sum over tp the gradients of the parameters TE tags `sequence_parallel` (norm weights that
    saw 1/tp of the tokens). Under Megatron-FSDP these are shards of the reduced main gradients,
    laid out alike on every tp rank (the parameters are replicated over tp)."""
    grads = []
    for p in params:
        g = getattr(p, grad_attr, None)
        if g is not None and is_sequence_parallel(p):
            g = getattr(g, "_local_tensor", g)  # DTensor -> this rank's shard
            if g.numel():
                grads.append(g)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
