"""The balancing loss and expert-load metrics of Hugging Face MoE models (`model=hf` with routed
experts), beside the launcher's loss.

Each experts block's router (the block's `gate`: in transformers 5 it returns (logits, weights,
top-k indices)) gets a forward hook that keeps the micro-batch's routing. `with_router_loss(base,
coef)` adds coef x the Switch balancing loss exactly as transformers' `load_balancing_loss_func`
computes it (over all MoE layers' tokens together), as `aux - aux.detach()`: the logged loss stays
the cross-entropy, as for the built-in MoE (models/llama/moe_stats.py), and the gradient is the one
transformers' own loss has. `coef` is the config's `router_aux_loss_coef` when it sets
`output_router_logits` (transformers adds the loss only then), else 0: the metrics alone.
`after_step` (every step, on every rank: one all-reduce) returns `moe_aux_loss` (that loss over
top_k, averaged over the step's micro-batches: 1.0 is balanced, as for the built-in MoE) and
`moe_load_max` (per MoE layer, max / mean tokens per expert; 1.0 is balanced), as device tensors
read at log steps only (components/metrics.host_values).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Union

import torch
import torch.nn.functional as F

from ..moe_metrics import in_recompute, load_max, sum_over_ranks
from .moe import EXPERTS_NAME

ROUTER_NAME = "gate"  # the experts block's router, beside its `experts`


def routers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The routers of the model's experts blocks, in module order."""
    cached = model.__dict__.get("_mfsdp_routers")
    if cached is None:
        cached = [m._modules[ROUTER_NAME] for m in model.modules()
                  if EXPERTS_NAME in m._modules and ROUTER_NAME in m._modules]
        model.__dict__["_mfsdp_routers"] = cached  # a plain attribute: no submodule, no state-dict entry
    return cached


def _keep_routing(router: torch.nn.Module, args, out) -> None:
    if not (router.training and torch.is_grad_enabled()) or in_recompute():
        return
    if not (isinstance(out, tuple) and len(out) == 3):
        return  # another router interface: nothing to count
    logits, _, chosen = out
    probs = F.softmax(logits.float(), dim=-1)
    experts, k = probs.shape[-1], chosen.shape[-1]
    slots = torch.zeros(k, experts, device=probs.device).scatter_add_(
        1, chosen.reshape(-1, k).t(), torch.ones(k, chosen.numel() // k, device=probs.device))
    router.__dict__.setdefault("_mfsdp_pending", []).append((probs.sum(0), slots, probs.shape[0]))


def attach(model: torch.nn.Module) -> torch.nn.Module:
    for router in routers(model):
        router.register_forward_hook(_keep_routing)
    return model


def with_router_loss(base: Callable, coef: float) -> Callable:
    """`base`'s loss, its value unchanged, with coef x the balancing loss's gradient."""

    def loss(model, batch):
        out = base(model, batch)
        pending = [p for r in routers(model) for p in r.__dict__.pop("_mfsdp_pending", [])]
        if not pending:
            return out
        n = sum(p[2] for p in pending)
        prob = sum(p[0] for p in pending) / n  # transformers: router_prob_per_expert
        tokens = sum(p[1] for p in pending) / n  # tokens_per_expert [top_k, E]
        aux = prob.shape[0] * (tokens * prob.unsqueeze(0)).sum()
        layer_loads = [p[1].sum(0) for p in pending]
        # On the first router, a submodule whatever wraps the model (compile, FSDP, peft).
        stats = routers(model)[0].__dict__.setdefault("_mfsdp_router_stats", {"aux": [], "loads": []})
        stats["aux"].append(aux.detach() / tokens.shape[0])  # / top_k: 1.0 is balanced, as for gpt's MoE
        stats["loads"].append(torch.stack(layer_loads))
        return out + (coef * (aux - aux.detach())).to(out.dtype) if coef else out

    return loss


def after_step(model: torch.nn.Module, applied: Union[bool, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The step's balancing loss and global expert loads; clears them. Collective. `applied`
    (a bool, or a device flag): unused, nothing here depends on the verdict."""
    n_layers = len(routers(model))
    if not n_layers:
        return {}
    stats = routers(model)[0].__dict__.pop("_mfsdp_router_stats", None)
    # Every rank sends the same shape: the experts count from a router's weight.
    experts = routers(model)[0].weight.shape[0]
    if stats:
        loads = torch.stack(stats["loads"]).sum(0).float()  # [micro-batches, layers, E] -> [layers, E]
        # a fill, not torch.tensor(n, device=...): a host-to-device copy waits for the stream
        aux = torch.stack([torch.stack(stats["aux"]).sum(), torch.full((), float(len(stats["aux"])),
                                                                       device=loads.device)])
    else:  # no training forward this step on this rank: it still joins the reduction
        device = next(model.parameters()).device
        loads, aux = torch.zeros(n_layers, experts, device=device), torch.zeros(2, device=device)
    flat = sum_over_ranks(torch.cat([loads.flatten(), aux.to(torch.float32)]))
    loads, aux = flat[:-2].view(n_layers, experts), flat[-2:]
    return {"moe_aux_loss": aux[0] / aux[1].clamp(min=1), "moe_load_max": load_max(loads)}
