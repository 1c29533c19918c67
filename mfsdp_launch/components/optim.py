"""The optimizer (`optim.name`: AdamW, or Muon with AdamW for the rest) with no-decay groups for
norms and biases, and what a resume keeps of the configured hyper-parameters. The LR schedule
lives in components/schedule.py."""

from __future__ import annotations

from typing import List, Optional

import torch

from ..core.dtypes import Dtype
from ..core.schema import OptimImpl, OptimName
from .schedule import build_scheduler, lr_at  # noqa: F401  (the schedule, imported from here by callers)


def set_lr(group: dict, value: float) -> None:
    """Set a param group's LR in place: capturable FusedAdam (CUDA graphs) keeps it as a device
    tensor that its step reads, so that is filled; a plain number is replaced."""
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


def _no_decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2 or "norm" in name.lower()


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Two groups: matrices decay; norms, biases and other 1-D params don't.

    "params" comes first in each dict: Megatron-FSDP finds the model from the first value of
    the first group.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue  # frozen: no optimizer state at all
        (no_decay if _no_decay(name, p) else decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: torch.nn.Module, optim_cfg, *, fused_ok: bool = False,
                    decoupled_grad: bool = False) -> torch.optim.Optimizer:
    """`fused_ok`: optim.impl=torch may pick torch's fused AdamW (the worker passes: on CUDA).
    `decoupled_grad`: the engine puts gradients in `param.decoupled_grad` (engine.use_decoupled_grad;
    validation allows it with TE's FusedAdam and optim.impl=triton only), so they read them there."""
    kwargs = dict(lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)
    if OptimName(getattr(optim_cfg, "name", OptimName.adamw)) is OptimName.muon:
        from .muon import Muon, muon_groups

        no_decay = {id(p) for name, p in model.named_parameters() if _no_decay(name, p)}
        return Muon(muon_groups(model, optim_cfg.weight_decay, no_decay), momentum=optim_cfg.muon_momentum,
                    weight_decay=optim_cfg.weight_decay, **kwargs)
    groups = param_groups(model, optim_cfg.weight_decay)
    state_dtype = Dtype(getattr(optim_cfg, "state_dtype", Dtype.fp32))
    if state_dtype is not Dtype.fp32:
        from .adamw import AdamW

        return AdamW(groups, state_dtype=getattr(torch, state_dtype.torch_name), **kwargs)
    impl = OptimImpl(optim_cfg.impl)
    if impl is OptimImpl.te_fused:
        from transformer_engine.pytorch.optimizers import FusedAdam

        return FusedAdam(groups, adam_w_mode=True, use_decoupled_grad=decoupled_grad, **kwargs)
    if impl is OptimImpl.triton:
        from .fused_adamw import FusedAdamW

        return FusedAdamW(groups, decoupled_grad=decoupled_grad, **kwargs)
    if impl is OptimImpl.fused:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    if impl is OptimImpl.foreach:
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
    return torch.optim.AdamW(groups, fused=True if fused_ok else None, **kwargs)


def fused_adamw_problem(device_type: str) -> str:
    """'' when torch's fused AdamW steps on `device_type`; else torch's reason, in one line."""
    try:
        p = torch.zeros(2, device=device_type, requires_grad=True)
        p.grad = torch.ones_like(p)
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError, TypeError) as exc:
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ""


def skips_on_device(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether `arm_device_step` can skip and clip this optimizer's next step: torch's fused Adam
    and AdamW read GradScaler's two device values in their kernel: `found_inf` (then they leave the
    parameters, moments and step count as they were, so the loop need not wait for the host's
    verdict before stepping) and `grad_scale` (they divide each gradient by it as they read it, so
    clipping costs no pass of its own over the gradients)."""
    ours = getattr(type(optimizer), "reads_scaler_values", False)  # optim.impl=triton (fused_adamw.py)
    if not ours and (type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or not optimizer.defaults.get("fused")):
        return False
    return all(p.device.type == device.type for g in optimizer.param_groups for p in g["params"])


def arm_device_step(optimizer: torch.optim.Optimizer, bad: Optional[torch.Tensor],
                    clip_divisor: Optional[torch.Tensor]) -> None:
    """The next `step()` (`skips_on_device` optimizers only) applies nothing where `bad` (a 0-d
    float32 tensor on the parameters' device) is 1.0, and divides the gradients by `clip_divisor`
    (the same kind of tensor; Engine.check_step(clip_in_step=True)). None: neither."""
    optimizer.found_inf = bad
    optimizer.grad_scale = clip_divisor


# ---------------------------------------------------------------------------------------------
# At a resume: the config's hyper-parameters and base LR win over the checkpoint's, so an LR change
# takes effect; counters (TE FusedAdam keeps Adam's "step" in the param group) come from the checkpoint.


def config_hparams(optimizer: torch.optim.Optimizer) -> List[dict]:
    """The param groups' configured hyper-parameters: taken before a checkpoint overwrites them."""
    return [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr", "step")}
            for g in optimizer.param_groups]


def _hp(v):
    """Comparable form of a hyper-parameter (one-element tensors -> numbers, tuples -> lists)."""
    if torch.is_tensor(v) and v.numel() == 1:
        return v.item()
    return list(v) if isinstance(v, tuple) else v


def keep_config_hparams(optimizer: torch.optim.Optimizer, fresh: List[dict]) -> List[str]:
    """Put the configured hyper-parameters (`config_hparams` before the load) back; one note each."""
    notes: List[str] = []
    if len(fresh) != len(optimizer.param_groups):
        return notes
    for i, (f, g) in enumerate(zip(fresh, optimizer.param_groups)):
        for k, v in f.items():
            if k in g and _hp(g[k]) != _hp(v):
                notes.append(f"optimizer group {i} {k}: {_hp(g[k])} in the checkpoint -> {_hp(v)} from the config")
                g[k] = v
    return notes


def load_schedule(scheduler, optimizer, state: dict) -> List[str]:
    """Load a scheduler's state, keeping the configured base LR; a LambdaLR's LR is recomputed at the
    restored step (identical to the saved LR when nothing changed). Returns notes on changes."""
    notes: List[str] = []
    # As floats: under capturable FusedAdam the LRs (and so the base LRs) are device tensors.
    fresh_base = [float(b) for b in getattr(scheduler, "base_lrs", []) or []]
    scheduler.load_state_dict(state)
    if not fresh_base or optimizer is None:
        return notes
    old_base = [float(b) for b in scheduler.base_lrs]
    if old_base != fresh_base:
        notes.append(f"base LR {old_base} in the checkpoint -> {fresh_base} from the config")
        scheduler.base_lrs = fresh_base
        for g, b in zip(optimizer.param_groups, fresh_base):
            g["initial_lr"] = b
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is not None and all(callable(f) for f in lambdas):
        lrs = [b * f(scheduler.last_epoch) for f, b in zip(lambdas, map(float, scheduler.base_lrs))]
        for g, lr in zip(optimizer.param_groups, lrs):
            set_lr(g, lr)
        scheduler._last_lr = list(lrs)
    elif old_base != fresh_base:
        notes.append(f"({type(scheduler).__name__}: the new base LR applies from the next schedule step)")
    return notes
