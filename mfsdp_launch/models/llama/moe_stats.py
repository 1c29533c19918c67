"""What a mixture-of-experts model adds to the training step: the balancing losses' gradient in the
loss, and after each step the expert load (metrics) and the sigmoid router's bias update.

`moe_loss(base)` returns `base`'s value unchanged and adds the MoE layers' stashed `aux_loss`
(models/llama/moe.py) as `aux - aux.detach()`: exactly 0 in value, its gradient in backward. So
the logged `loss` stays the language-model cross-entropy (comparable with a dense run), whatever
the loop does with it (the 1/grad_accum or per-token weights scale the aux gradient alike), and
the aux loss goes to the metrics on its own.

`after_step(model, applied)` (every step, on every rank alike: one all-reduce of the loads) sums
each MoE layer's routed tokens per expert over all ranks, and returns the metrics, as device
tensors (the host reads them at log steps only: components/metrics.host_values)
  moe_aux_loss      the mean load-balancing loss of the step's micro-batches (1.0: balanced)
  moe_load_max      per MoE layer, max / mean tokens per expert (1.0: balanced)
For router=sigmoid it then moves each expert's bias by bias_update_rate toward the mean load
(sign of mean - load; DeepSeek-V3), on applied steps only, identically on every rank. `applied`
is a bool, or a 0-d device flag (1.0: applied) when the loop reads the step's verdict late
(rank/loop.defers_verdict): the bias then moves by rate x flag, nothing waiting for the host.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Union

import torch

from ..moe_metrics import load_max, sum_over_ranks
from .moe import MoE, moe_layers


def _layers(model) -> List[MoE]:
    cached = getattr(model, "_moe_layers", None)
    if cached is None:
        cached = moe_layers(model)
        object.__setattr__(model, "_moe_layers", cached)  # not a submodule list: no state-dict entries
    return cached


def moe_loss(base: Callable) -> Callable:
    """The family's loss with the MoE layers' balancing-loss gradients added (value unchanged)."""

    def loss(model, batch):
        out = base(model, batch)
        aux = None
        for layer in _layers(model):
            if layer.aux_loss is not None:
                aux = layer.aux_loss if aux is None else aux + layer.aux_loss
                layer.aux_loss = None
        return out if aux is None else out + (aux - aux.detach()).to(out.dtype)

    return loss


def after_step(model, applied: Union[bool, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Global expert loads of the step just taken, the balancing bias moved (router=sigmoid,
    applied steps), this step's accumulators cleared. Collective (every rank, every step)."""
    layers = _layers(model)
    if not layers:
        return {}
    routers = [layer.router for layer in layers]
    stats = torch.cat([torch.stack([r.load for r in routers]).flatten(),
                       torch.stack([r.aux_sum for r in routers]).flatten()])
    sum_over_ranks(stats)
    n, E = len(routers), routers[0].experts
    loads, aux = stats[: n * E].view(n, E), stats[n * E:].view(n, 2)
    with torch.no_grad():
        for layer, r, load in zip(layers, routers, loads):
            rate = layer.cfg.bias_update_rate
            if applied is not False and r.kind == "sigmoid" and rate > 0:
                # no tokens routed: every sign is 0, the bias stays; a skipped step: x 0.0
                move = rate * torch.sign(load.mean() - load)
                r.expert_bias += move if applied is True else move * applied
            r.load.zero_()
            r.aux_sum.zero_()
    counted = aux[:, 1].clamp(min=1)
    return {"moe_aux_loss": (aux[:, 0] / counted).mean(), "moe_load_max": load_max(loads)}
