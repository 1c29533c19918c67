"""engine.fuse_wgrad_accumulation: Transformer Engine's linear layers write each weight gradient
straight into Megatron-FSDP's gradient buffer (TE's `fuse_wgrad_accumulation`, Megatron-Core's
`gradient_accumulation_fusion`).

Without it, autograd hands every TE weight a bf16 gradient that Megatron-FSDP then copies into a
communication bucket (sharded gradient buffer) or adds into its accumulation buffer (unsharded:
one data-parallel rank, ZeRO-0/1): one more pass over every weight gradient a micro-batch. With
it, the wgrad GEMM's output is that bucket or buffer (TE asks the weight's `get_main_grad()`).

Megatron-FSDP 0.6.1 marks every weight it gathers `overwrite_main_grad=True`, so TE's GEMM writes
rather than adds. That is right for a sharded buffer (each micro-batch fills a fresh bucket that
is reduce-scattered, then added into the shard) and wrong for an unsharded one, where
`get_main_grad()` is the accumulation buffer itself: only the last micro-batch would be kept.
TE reads the flag in its forward, so a hook just before each fused module's forward sets it to
whether the weight's buffer is sharded.

A weight shared with another module (tied embeddings) is left alone: TE would mark it as
accumulated and Megatron-FSDP would drop the other module's gradient.
"""

from __future__ import annotations

from collections import Counter
from typing import List

import torch

from .te_state import te_modules


def fusable_te_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """TE's Linear, LayerNormLinear, LayerNormMLP and GroupedLinear (and subclasses: te_gpt's
    replicated head), the modules whose backward honours fuse_wgrad_accumulation, whose trainable
    weights are theirs alone."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    found = []
    for _, module in te_modules(model):
        if not hasattr(module, "fuse_wgrad_accumulation"):
            continue
        own = list(module.parameters(recurse=False))
        if any(p.requires_grad for p in own) and all(uses[id(p)] == 1 for p in own):
            found.append(module)
    return found


def _overwrite_only_sharded_buffers(module: torch.nn.Module, args) -> None:
    """Before TE's forward reads it: overwrite a sharded buffer's bucket, add into an unsharded buffer.
    A weight that did not come from Megatron-FSDP's buffers turns the fusion off for this call."""
    fused = True
    for p in module.parameters(recurse=False):
        if not p.requires_grad:
            continue
        gbuf = getattr(p, "_gbuf", None)
        if gbuf is None or not hasattr(p, "get_main_grad"):
            fused = False
            continue
        p.overwrite_main_grad = bool(gbuf.is_data_distributed)
    module.fuse_wgrad_accumulation = fused


def fuse_te_wgrad_accumulation(model: torch.nn.Module) -> None:
    """Turn the fusion on for every fusable TE module of a model Megatron-FSDP has wrapped. Called
    after `fully_shard_model`, which gives the weights their `get_main_grad`."""
    for module in fusable_te_modules(model):
        module.fuse_wgrad_accumulation = True
        module.register_forward_pre_hook(_overwrite_only_sharded_buffers)
