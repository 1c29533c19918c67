"""The engine interface: shard a model, wrap its optimizer, control gradient sync, check and clip
each step (`check_step`: the global gradient norm and every rank's loss finiteness in one
all-reduce), and produce/load the state dicts that the checkpoint module saves with DCP."""

from __future__ import annotations

from abc import ABC, abstractmethod
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..core.globs import check_globs_match, matching


@dataclass
class StepCheck:
    """One step's check (Engine.check_step): the same on every rank."""

    grad_norm: float  # global L2 norm of the gradients, before clipping
    loss: float  # the step's loss, the mean over ranks
    finite: bool  # loss and gradient norm finite on every rank
    bad_ranks: int = 0  # ranks whose own loss was not finite
    # check_step(clip_in_step=True): what the optimizer's step divides the gradients by (a 0-d
    # device tensor, >= 1), or None when there is no clipping
    clip_divisor: Optional[torch.Tensor] = None


def _read_check(values: List[float]) -> StepCheck:
    """[square sum, ranks with a non-finite loss, mean loss] -> the StepCheck."""
    sq_sum, bad_ranks, mean_loss = values
    norm = math.sqrt(sq_sum) if sq_sum >= 0 else float("nan")
    finite = bad_ranks == 0 and math.isfinite(norm) and math.isfinite(mean_loss)
    return StepCheck(grad_norm=norm, loss=mean_loss, finite=finite, bad_ranks=int(bad_ranks))


class PendingCheck:
    """A step's check still on the device (`check_step(defer=True)`): `bad` is a 0-d float32
    device flag (1.0: the step must not be applied) that an optimizer can read without the host
    (components/optim.arm_device_skip); `result()` waits for the three numbers, copied to the
    host without blocking when the check was made, and gives the StepCheck."""

    def __init__(self, values: torch.Tensor):
        norm = values[0].sqrt()
        self.bad = (~((values[1] == 0) & torch.isfinite(norm) & torch.isfinite(values[2]))).to(torch.float32)
        self.norm = norm
        self.clip_divisor: Optional[torch.Tensor] = None  # as StepCheck's
        self._event = None
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values
        self._result: Optional[StepCheck] = None

    def result(self) -> StepCheck:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = _read_check(self._host.tolist())
        return self._result


Groups = Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]]
CLIP_EPS = 1e-6  # added to the norm a clip divides by


def _by_dtype_and_device(tensors: List[torch.Tensor]) -> Groups:
    """The groups one foreach call can take."""
    groups: Groups = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def square_sum(tensors: List[torch.Tensor], device) -> torch.Tensor:
    """The sum of squares of all `tensors`, a 0-d tensor on `device` (fp32, fp64 where a tensor is
    fp64): one foreach norm per dtype and device (one read of each tensor, a few launches), not a
    squared copy of each."""
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for (dtype, _), ts in _by_dtype_and_device(tensors).items():
        # At least fp32; fp64 main gradients stay fp64 (foreach_norm refuses to narrow them).
        norms = torch._foreach_norm(ts, 2.0, dtype=torch.promote_types(dtype, torch.float32))
        sq = sq + torch.stack(norms).pow(2).sum().to(device)
    return sq


def clip_to_norm(grads: List[torch.Tensor], total: torch.Tensor, max_norm: Optional[float]) -> None:
    """Clip: scale every gradient (shard) by min(1, max_norm / total), `total` their global norm
    (a device tensor: no host sync). max_norm None: nothing."""
    if max_norm is None or not grads:
        return
    scale = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    for (dtype, device), gs in _by_dtype_and_device(grads).items():
        # (on the host under train.cpu_offload, while the norm was summed on the device)
        torch._foreach_mul_(gs, scale.to(device=device, dtype=dtype))


def clip_divisor(total: torch.Tensor, max_norm: Optional[float]) -> Optional[torch.Tensor]:
    """What dividing the gradients by clips them as clip_to_norm scales them: max(1, total /
    max_norm), an fp32 0-d tensor where `total` is; None without clipping."""
    if max_norm is None:
        return None
    return torch.clamp((total.float() + CLIP_EPS) / max_norm, min=1.0)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Engine(ABC):
    name = "base"

    def __init__(self, *, engine_cfg, sharding_cfg, precision_cfg, dims, mesh, device: torch.device,
                 cuda_graph: bool = False, frozen_dtype: Optional[torch.dtype] = None, cpu_offload: bool = False):
        self.engine_cfg = engine_cfg
        self.sharding_cfg = sharding_cfg
        self.precision_cfg = precision_cfg
        self.dims = dims
        self.mesh = mesh  # None on Megatron-FSDP's no-mesh path
        self.device = device
        # train.cuda_graph=full_iteration; validation allows it with megatron_fsdp only.
        self.cuda_graph_mode = bool(cuda_graph)
        # The dtype parameters with requires_grad=False are kept in (LoRA's frozen base: the compute
        # dtype, no main copy); None: as the trained ones. Megatron-FSDP does this by itself.
        self.frozen_dtype = frozen_dtype
        # train.cpu_offload (FSDP2 only, validation refuses it elsewhere): sharded state in host memory.
        self.cpu_offload = bool(cpu_offload)

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
        sq, grads = self.local_grad_square(model)
        total = self._all_reduce(sq.reshape(1))[0].sqrt()
        self.scale_grads(grads, total, max_norm)
        return total

    def check_step(self, model: torch.nn.Module, max_norm: Optional[float], loss: torch.Tensor,
                   defer: bool = False, clip_in_step: bool = False):
        """The step's gradient norm and loss, checked on every rank with the one reduction the
        norm needs anyway: [weighted square sum, 1 if this rank's loss is not finite, loss / world]
        summed over all ranks. `loss`: this rank's loss of the step (mean over its microbatches).
        Collective.

        defer=False: the host reads those three numbers (the step's one device sync) and gets a
        StepCheck; the gradients are clipped only when the step is finite. defer=True: nothing
        waits; a PendingCheck, the gradients clipped whatever the verdict (a bad step's gradients
        are discarded unread: its update is skipped on the device).

        clip_in_step=True: the gradients are left as they are and the check's `clip_divisor` says
        what the optimizer's step must divide them by (components/optim.arm_device_step): one
        pass over the gradients fewer."""
        sq, grads = self.local_grad_square(model)
        loss = loss.detach().reshape(()).to(sq.dtype)
        world = _world_size()
        buf = self._all_reduce(torch.stack([sq, (~torch.isfinite(loss)).to(sq.dtype), loss / world]))
        check = PendingCheck(buf) if defer else _read_check(buf.tolist())
        norm = check.norm if defer else buf[0].sqrt()
        if clip_in_step:
            check.clip_divisor = clip_divisor(norm, max_norm)
        elif defer or check.finite:
            self.scale_grads(grads, norm, max_norm)
        return check

    def local_grad_square(self, model: torch.nn.Module) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """(this rank's weighted sum of squares of its gradient shards, those shards): summed over
        `norm_groups()`, the sums make the global norm's square."""
        grads, by_weight = [], {}
        for p in model.parameters():
            if p.grad is not None:
                grads.append(local_tensor(p.grad))
                by_weight.setdefault(self.grad_square_weight(p.grad), []).append(grads[-1])
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for weight, gs in by_weight.items():
            sq = sq + square_sum(gs, self.device) * weight
        return sq, grads

    def scale_grads(self, grads: List[torch.Tensor], total: torch.Tensor, max_norm: Optional[float]) -> None:
        """Clip: scale every local gradient shard by min(1, max_norm / total)."""
        clip_to_norm(grads, total, max_norm)

    def norm_groups(self) -> List[Any]:
        """The process groups the local squares are summed over (in order) to the global norm's
        square; the ranks outside them hold copies of the same gradients."""
        group = self.grad_norm_group()
        return [group] if group is not None else []

    def _all_reduce(self, buf: torch.Tensor) -> torch.Tensor:
        """Sum `buf` (whose first entry is the local square sum) over every rank, in one
        all-reduce: the square sum is weighted by (ranks its norm groups cover / world size), so
        the copies outside those groups count once in all, and every rank sees every other
        entry (a loss flag) too."""
        world = _world_size()
        if world == 1:
            return buf
        covered = math.prod(dist.get_world_size(g) for g in self.norm_groups())
        if covered != world:
            weight = torch.ones_like(buf)
            weight[0] = covered / world
            buf = buf * weight
        dist.all_reduce(buf)
        return buf

    def params_finite(self, model: torch.nn.Module) -> bool:
        """Whether every rank's parameter shards are finite (one all-reduce); checked before a
        checkpoint is saved. Collective."""
        bad = torch.zeros((), device=self.device, dtype=torch.float32)
        for p in model.parameters():
            t = local_tensor(p)
            # Plain tensors only: quantized (FP8) primary weights have no isfinite of their own.
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel() and t.is_floating_point():
                bad += (~torch.isfinite(t)).any().float().to(bad.device)
        if _world_size() > 1:
            dist.all_reduce(bad)
        return bool(bad.item() == 0)

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
    def load_state_dict(self, model, optimizer, state: Dict[str, Any], *, strict: bool = True) -> None:
        """Copy a DCP-loaded state into the model (and optimizer when it is in `state`).
        `strict=False`: the model state may hold part of the model's tensors (LoRA adapters)."""

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
