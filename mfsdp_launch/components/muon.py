"""Muon (`optim.name=muon`): Newton-Schulz orthogonalized momentum for the 2-D weight matrices,
AdamW for embeddings, the output head, norms and biases; one optimizer, so the schedule, the
checkpoint (DCP) and the loop treat it like AdamW.

Update of a matrix W with gradient G (Keller Jordan's Muon, Nesterov momentum, with Moonshot's
scaling so that optim.lr and optim.weight_decay tuned for AdamW carry over):

    B <- mu * B + (1 - mu) * G          (the momentum buffer, `momentum_buffer`)
    U <- NS5((1 - mu) * G + mu * B)     (five quintic Newton-Schulz steps: ~ U V^T of the SVD)
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(rows, cols)) * U

Sharded (FSDP2, DTensor parameters): the momentum and the AdamW moments are elementwise, so each
rank updates its own shard. Newton-Schulz needs the whole matrix: each rank all-gathers the
matrix's momentum-mixed gradient (`full_tensor()`, one matrix at a time), orthogonalizes it and
keeps its own rows (a Replicate -> shard redistribute, no communication). Every rank repeats the
same Newton-Schulz, which is exact and simple, not the cheapest split of the work. The states are
DTensors of the parameter's layout, so DCP saves them in their global shapes and a checkpoint
resumes at any world size. Newton-Schulz runs in bf16 on CUDA (as the reference implementations)
and in fp32 elsewhere. A fused matrix (wqkv, w_gate_up) is orthogonalized as one matrix.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Set

import torch
import torch.nn as nn

from .adamw import closure_loss, local as _local, step_group

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: steep at 0
NS_STEPS = 5
NS_EPS = 1e-7
# Leaf module names of an output head: its weight goes to AdamW (as the embeddings).
HEAD_NAMES = ("lm_head", "output", "head", "embed_out")


def orthogonalize(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The Newton-Schulz iteration towards U V^T of `g`'s SVD (2-D), in fp32 (bf16 on CUDA)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def update_scale(shape) -> float:
    """Moonshot's factor: the update's RMS matches AdamW's, so AdamW's lr and wd carry over."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def muon_parameters(model: nn.Module) -> Set[int]:
    """ids of the parameters Muon updates: trainable 2-D weights that are not an nn.Embedding's
    or an output head's (a module named lm_head, output, head or embed_out) and not named *norm*."""
    aux: Set[int] = set()
    for mod_name, mod in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Embedding) or leaf in HEAD_NAMES:
            aux.update(id(p) for p in mod.parameters(recurse=False))
    return {id(p) for name, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and id(p) not in aux and "norm" not in name.lower()}


def _full(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole matrix of which `local` is this rank's shard (shard layout of DTensor `like`)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride()).full_tensor()


def _shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` in DTensor `like`'s layout (every rank holds the same `full`)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(like, DTensor):
        return full
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()


class Muon(torch.optim.Optimizer):
    """Param groups with `muon=True` get the Muon update, the others AdamW (decoupled decay)."""

    def __init__(self, groups: Iterable[dict], *, lr: float, weight_decay: float, momentum: float,
                 betas=(0.9, 0.95), eps: float = 1e-8):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, betas=tuple(betas), eps=eps,
                        muon=False)
        super().__init__(list(groups), defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon groups take 2-D parameters only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            (self._muon if group["muon"] else self._adamw)(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            g, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(g, 1 - mu)
            mixed = g.lerp(buf, mu)  # Nesterov
            update = orthogonalize(_full(mixed, p.grad)) * update_scale(p.shape)
            w = _local(p)
            w.mul_(1 - lr * wd)
            w.add_(_shard_of(update, p).to(w.dtype), alpha=-lr)

    def _adamw(self, group: dict) -> None:
        step_group(self.state, group)


def muon_groups(model: nn.Module, weight_decay: float, no_decay: Set[int]) -> List[dict]:
    """Muon's matrices, then AdamW's decaying and non-decaying parameters (`no_decay`: ids)."""
    muon_ids = muon_parameters(model)
    mats, decay, rest = [], [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (mats if id(p) in muon_ids else rest if id(p) in no_decay else decay).append(p)
    groups = [{"params": mats, "weight_decay": weight_decay, "muon": True}] if mats else []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, "muon": False})
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0, "muon": False})
    return groups
