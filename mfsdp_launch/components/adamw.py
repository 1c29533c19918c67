"""AdamW's update, written once for the optimizers the launcher runs itself: Muon's AdamW part
(components/muon.py) and `optim.state_dtype=bf16`, AdamW with its two moments stored in bf16.

bf16 moments halve Adam's state (4 bytes a parameter instead of 8): an 8B model's offloaded state
(train.cpu_offload) is ~90 GiB of host memory instead of ~120. The arithmetic stays fp32: each chunk
of parameters gets fp32 working copies of its moments, is updated exactly as torch.optim.AdamW's
foreach path updates it, and the moments are rounded back to nearest. bf16 keeps 8 bits of
mantissa, so an exp_avg_sq update smaller than ~0.4 % of its value is lost: with beta2 = 0.95
(our default) each step moves it by 5 %, with 0.999 by 0.1 % and the second moment stalls."""

from __future__ import annotations

from itertools import chain
from typing import Iterator, List, Optional, Sequence

import torch

# The fp32 working copies of narrower moments cover at most this many elements at a time (two
# moments and the denominator of 32M elements: 384 MiB; a larger tensor is cut into pieces), so the
# copies never cost what the narrow moments saved.
WORK_CHUNK_ELEMENTS = 1 << 25
MOMENTS = ("exp_avg", "exp_avg_sq")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters, gradients and states); else `t`."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _pieces(tensors: Sequence[Sequence[torch.Tensor]], limit: float) -> List[tuple]:
    """(index, start, end) pieces of the flattened tensors, none over `limit` elements where every
    tensor of an index is contiguous (a larger one is cut; a non-contiguous one stays whole)."""
    out = []
    for i, group in enumerate(zip(*tensors)):
        n = group[0].numel()
        if n <= limit or not all(t.is_contiguous() for t in group):
            out.append((i, 0, n))
        else:
            out += [(i, a, min(a + int(limit), n)) for a in range(0, n, int(limit))]
    return out


def _chunks(pieces: List[tuple], limit: float) -> Iterator[List[tuple]]:
    chunk, total = [], 0
    for piece in pieces:
        size = piece[2] - piece[1]
        if chunk and total + size > limit:
            yield chunk
            chunk, total = [], 0
        chunk.append(piece)
        total += size
    if chunk:
        yield chunk


def _view(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return t if start == 0 and end == t.numel() else t.view(-1)[start:end]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def adamw_update(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                 exp_avg_sqs: List[torch.Tensor], steps: List[float], *, lr: float, betas, eps: float,
                 weight_decay: float) -> None:
    """Decoupled weight decay and Adam's step on local tensors, in place; `steps`: each parameter's
    step count including this one. fp32 moments are updated where they are; narrower ones in fp32
    copies, WORK_CHUNK_ELEMENTS at a time (a larger tensor in pieces)."""
    if not params:
        return
    beta1, beta2 = betas
    narrow = any(m.dtype != torch.float32 or v.dtype != torch.float32 for m, v in zip(exp_avgs, exp_avg_sqs))
    limit = WORK_CHUNK_ELEMENTS if narrow else float("inf")
    for chunk in _chunks(_pieces((params, grads, exp_avgs, exp_avg_sqs), limit), limit):
        p = [_view(params[i], a, b) for i, a, b in chunk]
        g = [_fp32(_view(grads[i], a, b)) for i, a, b in chunk]
        m_store = [_view(exp_avgs[i], a, b) for i, a, b in chunk]
        v_store = [_view(exp_avg_sqs[i], a, b) for i, a, b in chunk]
        m, v = [_fp32(t) for t in m_store], [_fp32(t) for t in v_store]
        if weight_decay:
            torch._foreach_mul_(p, 1 - lr * weight_decay)
        torch._foreach_lerp_(m, g, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [(1 - beta2 ** steps[i]) ** 0.5 for i, _, _ in chunk])
        torch._foreach_add_(denom, eps)
        # addcdiv with a narrower parameter (bf16 weights) computes in fp32 and rounds once.
        torch._foreach_addcdiv_(p, m, denom, [-lr / (1 - beta1 ** steps[i]) for i, _, _ in chunk])
        for work, store in ((m, m_store), (v, v_store)):
            for w, t in zip(work, store):
                if w is not t:
                    t.copy_(w)


def closure_loss(closure):
    """An optimizer step's `closure` (torch's contract: it recomputes the loss, with gradients
    enabled), run; None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def torch_adamw_defaults(*, lr: float, betas, eps: float, weight_decay: float) -> dict:
    """torch.optim.AdamW's param-group keys (amsgrad, foreach, ...; unused by our own kernels) with
    these values: a checkpoint of torch's AdamW and of ours then loads into the other."""
    return {**torch.optim.AdamW([torch.zeros(1)]).defaults, "lr": lr, "betas": tuple(betas), "eps": eps,
            "weight_decay": weight_decay}


def step_group(state: dict, group: dict, state_dtype: Optional[torch.dtype] = None) -> None:
    """One param group's AdamW step (an optimizer's `state` and param group): the states are made
    at a parameter's first step, the moments in `state_dtype` (None: the parameter's)."""
    live = [p for p in group["params"] if p.grad is not None]
    for p in live:
        s = state[p]
        if not s:
            s["step"] = torch.tensor(0.0)
            s["exp_avg"] = torch.zeros_like(p, dtype=state_dtype)
            s["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype)
        s["step"] += 1
    states = [state[p] for p in live]
    adamw_update([local(p) for p in live], [local(p.grad) for p in live], [local(s["exp_avg"]) for s in states],
                 [local(s["exp_avg_sq"]) for s in states], [s["step"].item() for s in states],
                 lr=float(group["lr"]), betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with its moments stored in `state_dtype` (see the module's
    docstring). States are made like the parameters (DTensors of their layout under FSDP2), so DCP
    saves them in global shapes and a checkpoint of either state dtype resumes into the other."""

    def __init__(self, groups, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 state_dtype: torch.dtype = torch.bfloat16):
        # (optim.state_dtype can change at a resume)
        super().__init__(groups, torch_adamw_defaults(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            step_group(self.state, group, self.state_dtype)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, except that the moments keep `state_dtype`: torch casts every floating state
        to its parameter's dtype, which would widen them (and, on a resume of a run that needed the
        narrow moments, hold both copies at once)."""
        moments, rest = {}, {}
        for pid, state in state_dict["state"].items():
            moments[pid] = {k: v for k, v in state.items() if k in MOMENTS}
            rest[pid] = {k: v for k, v in state.items() if k not in MOMENTS}
        super().load_state_dict({**state_dict, "state": rest})
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            for key, value in moments.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=self.state_dtype)
