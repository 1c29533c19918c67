"""Megatron-FSDP's expert mesh for a mixture-of-experts model (models/llama/moe.py).

Megatron-FSDP 0.6.1 treats a parameter with `allreduce == False` as an expert parameter: it is
sharded and its gradient reduced over the expert-data-parallel group, which it reads from
`expt_device_mesh` under the same dim names as the dense mesh (dp_shard_dim, tp_dim, dp_outer_dim),
and its gradient is scaled by 1 / (the dense data-parallel size), as the dense ones are
(megatron_fsdp.py `_init_fsdp_param_and_grad_buffer`). Megatron-LM builds that mesh in
`mcore_fsdp_adapter.py` from its process groups; we build it from our DeviceMesh (mfsdp_launch/mesh.py):

* mesh.ep = 1: the experts' data-parallel group is the dense one, so the expert mesh is the dense
  mesh itself, and the experts are flagged so that Megatron-FSDP keeps them in their own buffers.
* mesh.ep > 1: a mesh over the ranks of this rank's ep slot only (its edp group, x dp_outer under
  HSDP, x tp), made with `DeviceMesh.from_group` from groups the expert mesh already has, so no
  rank creates a group the others do not. Validation still refuses ep > 1 under this engine
  (engines/__init__.py says why); `expert_device_mesh` is tested on gloo for the day it is lifted.

A model built without a mesh (mesh.enabled=false: Megatron-FSDP's own mesh) keeps its experts as
plain parameters: at ep = 1 they are data-parallel like the rest.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch


def expert_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The routed experts' weights (modules that declare `is_expert_module`)."""
    out = []
    for module in model.modules():
        if getattr(module, "is_expert_module", False):
            out.extend(module.parameters(recurse=False))
    return out


def expert_kwargs(model: torch.nn.Module, mesh, dims, plan) -> Dict[str, Any]:
    """fully_shard_model's expert arguments, the expert parameters flagged (allreduce=False); {} for
    a model without experts or without a mesh."""
    params = expert_parameters(model)
    if not params or mesh is None or not plan.use_mesh:
        return {}
    for p in params:
        p.allreduce = False
    if dims.ep == 1:
        kwargs: Dict[str, Any] = {"expt_device_mesh": mesh}
        if plan.hybrid_fsdp_group_dim:
            kwargs["hybrid_fsdp_expt_group"] = mesh[plan.hybrid_fsdp_group_dim].get_group()
        return kwargs
    return expert_mesh_kwargs(mesh, dims, plan.dp_shard_dim, plan.dp_outer_dim, plan.tp_dim)


def expert_mesh_kwargs(mesh, dims, shard_dim: str, outer_dim, tp_dim: str) -> Dict[str, Any]:
    """mesh.ep > 1: {"expt_device_mesh": this ep slot's (dp_outer, edp, tp) mesh named as the dense
    dims, "hybrid_fsdp_expt_group": its dp_outer x edp group under HSDP}."""
    from torch.distributed.device_mesh import DeviceMesh

    from ..mesh import build_expert_mesh, expert_hsdp_mesh

    if dims.tp != 1:  # validation refuses mesh.tp > 1 with a mixture of experts
        raise ValueError("the expert mesh is built for mesh.tp=1")
    emesh = build_expert_mesh(mesh, dims)
    rank, S = torch.distributed.get_rank(), dims.shard_size
    slot = (rank % S) % dims.ep  # this rank's place in its ep group
    # rank = dp_outer index * S + the flattened dp_shard x cp position (tp = 1); edp: same slot
    ranks = [[[o * S + slot + j * dims.ep] for j in range(dims.edp)] for o in range(dims.dp_outer)]
    groups, names = [emesh["edp"].get_group(), mesh["tp"].get_group()], [shard_dim, tp_dim]
    kwargs: Dict[str, Any] = {}
    if outer_dim:
        groups, names = [emesh["dp_outer"].get_group()] + groups, [outer_dim] + names
        kwargs["hybrid_fsdp_expt_group"] = expert_hsdp_mesh(emesh).get_group()
    else:
        ranks = ranks[0]
    device = mesh.device_type
    kwargs["expt_device_mesh"] = DeviceMesh.from_group(groups, device, mesh=ranks, mesh_dim_names=names)
    return kwargs
