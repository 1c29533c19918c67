"""PyTorch FSDP2 (`fully_shard`): the CPU/gloo path, and the second engine on GPUs.

ZeRO mapping: optim_grads_params = reshard after forward; optim_grads = keep the unsharded
params from forward to backward (and across a step's micro-batches); no_shard = replicate (HSDP
with shard size 1). ZeRO-1 and HFSDP are refused by validation: FSDP2 cannot express them.

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
from ..models import qlora
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
        if not init_on_meta or self.frozen_dtype is not None:  # (on the meta device: before sharding)
            _cast(model, main_dtype, self.frozen_dtype)
        mesh = self._shard_mesh()
        reshard = zero is ZeroStrategy.optim_grads_params
        # fully_shard takes every parameter under its module that no earlier call took, so units go
        # bottom-up: wrapped after its parent, a nested unit (te_gpt's attention proj te.Linear inside
        # its TransformerLayer) would find its weight a DTensor already, which FSDP2 takes for a TP
        # shard, and TE would hand that weight's null data pointer to cuBLAS.
        units = [m for m in model.modules() if isinstance(m, spec.unit_modules) and m is not model][::-1]
        keys = {}
        whole = qlora.replicated(model)  # model.peft.kind=qlora: the NF4 base stays whole on every rank
        if whole:
            keys["ignored_params"] = whole
        if self.cpu_offload:  # train.cpu_offload: shards (and so gradients and Adam's moments) on the host
            from torch.distributed.fsdp import CPUOffloadPolicy

            keys["offload_policy"] = CPUOffloadPolicy()
        for experts in [m for m in model.modules() if getattr(m, "fsdp_mesh", None) is not None]:
            # mesh.ep > 1: the experts' own fully_shard over the expert-data-parallel mesh, before
            # their block's (models/llama/expert_parallel.py).
            fully_shard(experts, mesh=experts.fsdp_mesh, mp_policy=mp, reshard_after_forward=reshard, **keys)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **keys)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **keys)
        if init_on_meta:
            model.to_empty(device="cpu" if self.cpu_offload else self.device)
            if self.frozen_dtype is None:
                model.to(dtype=main_dtype)
            with torch.no_grad():
                spec.init_weights(model)
            if self.cpu_offload:
                _buffers_to(model, self.device)
        return model

    def wrap_optimizer(self, model, optimizer):
        return optimizer

    def set_grad_sync(self, model, sync: bool) -> None:
        model.set_requires_gradient_sync(sync)
        if ZeroStrategy(self.sharding_cfg.zero_dp_strategy) is not ZeroStrategy.optim_grads_params:
            # ZeRO-2 and no_shard hold the gathered weights from forward to backward anyway: held
            # across a step's micro-batches too, they are gathered (and cast to the compute dtype)
            # once a step instead of once a micro-batch, at no more peak memory (one H100, the 8B
            # slice in bf16 at grad_accum 8: 34.9k-35.6k tokens/s in three calls, 36.5k with it).
            # The last micro-batch reshards them.
            model.set_reshard_after_backward(sync)

    def grad_square_weight(self, grad) -> float:
        # 2-D (dp, tp) and 1-D (dp) gradients side by side, or experts on (edp, ep) beside dense
        # weights: weight each rank's local squares by (distinct shards / world), so one all-reduce
        # over all ranks counts every element once.
        if not self._mixed_layouts():
            return 1.0
        import torch.distributed as dist

        return _distinct_shards(grad) / dist.get_world_size()

    def _mixed_layouts(self) -> bool:
        return self.dims.tp > 1 or getattr(self.dims, "ep", 1) > 1

    def grad_norm_group(self):
        if self._mixed_layouts():
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

    def load_state_dict(self, model, optimizer, state: Dict[str, Any], *, strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
        if optimizer is not None and "optimizer" in state:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _buffers_to(model, device) -> None:
    """Offloaded parameters stay on the host; buffers (RoPE tables) are the forward's, on the device."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.device != device:
                persistent = name not in module._non_persistent_buffers_set
                module.register_buffer(name, buf.to(device), persistent=persistent)


def _cast(model, main_dtype, frozen_dtype) -> None:
    """Trained parameters (and buffers) in the main dtype, frozen ones in `frozen_dtype` (None: the
    main dtype too). FSDP2 needs one dtype among a unit's trained parameters only."""
    model.to(dtype=main_dtype)
    if frozen_dtype is None or frozen_dtype == main_dtype:
        return
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(frozen_dtype)


def _distinct_shards(t) -> int:
    """How many different pieces a (DTensor) gradient is split into over its mesh (FSDP2 puts
    _StridedShard, which is not `is_shard()`, on dp when tp shards the same dim)."""
    placements = getattr(t, "placements", ())
    mesh = getattr(t, "device_mesh", None)
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if not p.is_replicate()) if mesh is not None else 1
