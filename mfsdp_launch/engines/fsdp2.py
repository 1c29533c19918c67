"""PyTorch FSDP2 (`fully_shard`): the CPU/gloo path, and the second engine on GPUs.

ZeRO mapping: optim_grads_params = reshard after forward; optim_grads = keep the unsharded
params from forward to backward; no_shard = replicate (HSDP with shard size 1). ZeRO-1 and
HFSDP are refused by validation: FSDP2 cannot express them.

With mesh.tp > 1 the model arrives with DTensor parameters on the mesh's tp dim
(models/llama/tensor_parallel.py); FSDP2 shards them over the dp dims, a 2-D (dp, tp) layout, as torchtitan.
DCP saves them in their global shapes, so a checkpoint resumes at any other tp.
With mesh.cp > 1 the shard dim is the flattened dp_shard x cp ("dp_shard_cp"), as torchtitan.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch

from ..core.sharding import ZeroStrategy
from ..mesh import replicate_mesh
from ..components.precision import torch_dtype
from .base import Engine


class FSDP2Engine(Engine):
    name = "fsdp2"

    def _shard_mesh(self):
        # With mesh.cp > 1 the cp ranks hold different tokens of the same samples: FSDP shards
        # (and averages gradients) over dp_shard x cp, the flattened "dp_shard_cp" dim.
        zero = ZeroStrategy(self.sharding_cfg.zero_dp_strategy)
        if zero is ZeroStrategy.no_shard:
            return replicate_mesh(self.mesh, "hsdp" if self.dims.cp > 1 else "dp")
        if self.dims.dp_outer > 1:
            return self.mesh["dp_outer", self.dims.dp_shard_dim]
        return self.mesh[self.dims.dp_shard_dim]

    def shard(self, model, spec, *, init_on_meta: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        pc = self.precision_cfg
        zero = ZeroStrategy(self.sharding_cfg.zero_dp_strategy)
        mp = MixedPrecisionPolicy(
            param_dtype=torch_dtype(pc.compute_dtype),
            reduce_dtype=torch_dtype(pc.grad_comm_dtype or pc.main_grads_dtype),
            output_dtype=None,
        )
        main_dtype = torch_dtype(pc.main_params_dtype) or torch_dtype(pc.compute_dtype)
        if not init_on_meta:
            model.to(dtype=main_dtype)
        mesh = self._shard_mesh()
        reshard = zero is ZeroStrategy.optim_grads_params
        units = [m for m in model.modules() if isinstance(m, spec.unit_modules) and m is not model]
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        if init_on_meta:
            model.to_empty(device=self.device)
            model.to(dtype=main_dtype)
            with torch.no_grad():
                spec.init_weights(model)
        return model

    def wrap_optimizer(self, model, optimizer):
        return optimizer

    def set_grad_sync(self, model, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)

    def grad_square_weight(self, grad) -> float:
        # 2-D (dp, tp) and 1-D (dp) gradients side by side: weight each rank's local squares by
        # (distinct shards / world), so one all-reduce over all ranks counts every element once.
        if self.dims.tp == 1:
            return 1.0
        import torch.distributed as dist

        return _distinct_shards(grad) / dist.get_world_size()

    def grad_norm_group(self):
        if self.dims.tp > 1:
            import torch.distributed as dist

            return dist.group.WORLD
        if ZeroStrategy(self.sharding_cfg.zero_dp_strategy) is ZeroStrategy.no_shard or self.dims.shard_size == 1:
            return None
        return self.mesh[self.dims.dp_shard_dim].get_group()

    def state_dict(self, model, optimizer) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        out = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            out["optimizer"] = get_optimizer_state_dict(model, optimizer)
        return out

    def load_state_dict(self, model, optimizer, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(model, state["model"])
        if optimizer is not None and "optimizer" in state:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _distinct_shards(t) -> int:
    """How many different pieces a (DTensor) gradient is split into over its mesh (FSDP2 puts
    _StridedShard, which is not `is_shard()`, on dp when tp shards the same dim)."""
    placements = getattr(t, "placements", ())
    mesh = getattr(t, "device_mesh", None)
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if not p.is_replicate()) if mesh is not None else 1
