"""Expert parallelism (mesh.ep > 1) for the Llama family's MoE layers (models/llama/moe.py).

Each ep group (mfsdp_launch/mesh.py) splits every MoE layer's experts: rank i of the group keeps
experts [i * E/ep, (i+1) * E/ep). `apply_expert_parallel` turns the experts' weights into DTensors
sharded on the expert mesh's "ep" dim, marks the experts module with the mesh its own fully_shard
takes and scales their gradients by 1/ep (models/expert_parallel.py, shared with `model=hf`), and
gives each MoE layer an `AllToAllDispatcher`.

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

import torch.nn as nn

from ..expert_parallel import AllToAllDispatcher, expert_split, shard_expert_weights
from .moe import MoE, moe_layers


def apply_expert_parallel(model: nn.Module, mesh, dims) -> List[MoE]:
    """Split every MoE layer's experts over the ep groups of `mesh` (in place, before the engine
    shards); returns the layers. Validation checked that ep divides the experts and dp_shard x cp."""
    split = expert_split(mesh, dims)
    layers = moe_layers(model)
    for layer in layers:
        shard_expert_weights(layer.experts, ("w_gate_up", "w_down"), split)
        layer.dispatcher = AllToAllDispatcher(split.group, dims.ep, layer.cfg.experts)
    return layers
