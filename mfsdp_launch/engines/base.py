"""The engine interface: shard a model, wrap its optimizer, control gradient sync, clip, and
produce/load the state dicts that the checkpoint module saves with DCP."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..core.globs import check_globs_match, matching


class Engine(ABC):
    name = "base"

    def __init__(self, *, engine_cfg, sharding_cfg, precision_cfg, dims, mesh, device: torch.device,
                 cuda_graph: bool = False):
        self.engine_cfg = engine_cfg
        self.sharding_cfg = sharding_cfg
        self.precision_cfg = precision_cfg
        self.dims = dims
        self.mesh = mesh  # None on Megatron-FSDP's no-mesh path
        self.device = device
        # train.cuda_graph=full_iteration; validation allows it with megatron_fsdp only.
        self.cuda_graph_mode = bool(cuda_graph)

    @abstractmethod
    def shard(self, model: torch.nn.Module, spec, *, init_on_meta: bool) -> torch.nn.Module:
        """Shard `model` (built on `device`, or on meta when init_on_meta) and return the module to train."""

    @abstractmethod
    def wrap_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make the optimizer work on the sharded parameters (returns the one to step)."""

    @abstractmethod
    def set_grad_sync(self, model: torch.nn.Module, sync: bool) -> None:
        """Whether the next backward reduces gradients across data-parallel ranks."""

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: Optional[float]) -> torch.Tensor:
        """Global L2 norm of the gradients over all shards; scales them to max_norm if given."""
        params = [p for p in model.parameters() if p.grad is not None]
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for p in params:
            sq += local_tensor(p.grad).float().pow(2).sum() * self.grad_square_weight(p.grad)
        group = self.grad_norm_group()
        if group is not None:
            dist.all_reduce(sq, group=group)
        total = sq.sqrt()
        if max_norm is not None:
            scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for p in params:
                local_tensor(p.grad).mul_(scale.to(local_tensor(p.grad).dtype))
        return total

    def grad_norm_group(self):
        """Process group over which the weighted local squares add up to the global norm's square."""
        return None

    def grad_square_weight(self, grad: torch.Tensor) -> float:
        """How much this rank's squares of `grad` count in that sum (1: the shards are disjoint)."""
        return 1.0

    @abstractmethod
    def state_dict(self, model, optimizer) -> Dict[str, Any]:
        """{'model': ..., 'optimizer': ...} of (sharded) tensors for DCP. A collective."""

    @abstractmethod
    def load_state_dict(self, model, optimizer, state: Dict[str, Any]) -> None:
        """Copy a DCP-loaded state into the model (and optimizer when it is in `state`)."""

    def full_model_state_dict(self, model) -> Dict[str, torch.Tensor]:
        """Unsharded weights with wrapper prefixes removed (for export); collective."""
        from torch.distributed.tensor import DTensor

        out = {}
        for k, v in self.state_dict(model, None)["model"].items():
            if isinstance(v, DTensor):
                v = v.full_tensor()
            if isinstance(v, torch.Tensor):
                out[strip_prefixes(k)] = v.detach().cpu()
        return out

    def forward_context(self):
        from contextlib import nullcontext

        return nullcontext()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def strip_prefixes(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p):], True
        key = key.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")
    return key


def apply_freeze(model: torch.nn.Module, patterns: List[str]) -> List[str]:
    """requires_grad=False for parameters matching any glob; returns the frozen names."""
    if not patterns:
        return []
    params = dict(model.named_parameters())
    check_globs_match("model.freeze", patterns, list(params), "parameter")
    frozen = matching(params, patterns)
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen
