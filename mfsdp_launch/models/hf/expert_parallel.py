"""Expert parallelism (mesh.ep > 1) for Hugging Face MoE models (models/hf/moe.py: SPLITTABLE),
through the Llama family's dispatcher and grouped experts.

Each experts block keeps its parameters and their names (`gate_up_proj`, `down_proj`): they
become DTensors of their global shape [E, ...] holding this rank's E/ep experts
(models/expert_parallel.py), so the HF load and export and DCP checkpoints see the tensors they
saw at ep = 1. Only the block's forward is replaced: it takes what the HF router chose,
(hidden_states [N, dim], top_k_index [N, k], top_k_weights [N, k]), sorts the (token, slot) rows
by expert, sends them to the ranks holding their experts (`AllToAllDispatcher`), runs that rank's
experts as one grouped GEMM (models/llama/moe.py: `run_local_experts`) and sums the weighted
outputs back per token, as HF's own loop does. The router, any shared expert and the rest of the
block stay HF's.

`mark_experts` flags the blocks as expert modules at every ep: Megatron-FSDP's expert mesh reads
that flag (engines/megatron_experts.py), as for the Llama family's GroupedExperts.
"""

from __future__ import annotations

import types
from functools import partial
from typing import List

import torch
import torch.nn as nn

from ..expert_parallel import AllToAllDispatcher, expert_split, shard_expert_weights
from ..llama.moe import route_tokens, run_local_experts
from .moe import WEIGHTS, experts_blocks


def mark_experts(model: nn.Module) -> List[nn.Module]:
    """Flag the model's experts blocks as expert modules (their parameters Megatron-FSDP's expert
    parameters); returns them."""
    blocks = experts_blocks(model)
    for block in blocks:
        block.is_expert_module = True
    return blocks


def apply_expert_parallel(model: nn.Module, mesh, dims) -> List[nn.Module]:
    """Split every experts block of `model` over the ep groups of `mesh`, in place, before the
    engine shards; returns the blocks. Validation checked the architecture (SPLITTABLE) and that
    ep divides its experts and dp_shard x cp."""
    split = expert_split(mesh, dims)
    blocks = mark_experts(model)
    for block in blocks:
        experts = block.gate_up_proj.shape[0]
        shard_expert_weights(block, WEIGHTS, split)
        block.dispatcher = AllToAllDispatcher(split.group, dims.ep, experts)
        block.forward = types.MethodType(_split_forward, block)
    return blocks


def _split_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts contract ([N, dim], [N, k], [N, k] -> [N, dim]) over the ep group."""
    counts = torch.bincount(top_k_index.flatten(), minlength=self.gate_up_proj.shape[0])
    # The weights are read here, inside forward: FSDP2 has swapped in the unsharded ones.
    local = partial(run_local_experts, w_gate_up=self.gate_up_proj, w_down=self.down_proj,
                    grad_scale=self.grad_scale)
    return route_tokens(hidden_states, top_k_weights, top_k_index, counts,
                        partial(self.dispatcher.run, experts=local))
