"""`train.compile`: torch.compile per FSDP unit (transformer block), as torchtitan does.

Each unit's `forward` is replaced by its compiled version in place, so parameter names, the FSDP
hooks around each unit (they run outside the compiled region) and activation checkpointing (already
applied to `forward`) stay as they are; one block's graph is compiled once and reused by every
block of the same shapes. Models without plain-torch units (TE layers, the seed's toys) are
compiled whole. The cross-entropy on the logits, outside every unit, is compiled on its own
(models/losses.py), and so is each module the caller names in `also` (torchao's FP8 head: left
eager, its casts over [tokens, vocab] gradients run as separate kernels, about a tenth of the 8B
slice's step in session 24's profile).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .activation_checkpoint import is_te_module


def compile_model(model: nn.Module, unit_classes: Sequence[type],
                  also: Sequence[nn.Module] = ()) -> tuple[nn.Module, str]:
    """(the module to call for forward, one line saying what was compiled): `model` with its units
    and the modules `also` names (outside the units) compiled in place, or torch.compile(model)."""
    from .losses import compile_cross_entropy

    compile_cross_entropy()  # the loss outside the units: compiled too (losses.py says why)
    classes = tuple(unit_classes)
    units = [m for m in model.modules() if classes and isinstance(m, classes) and not is_te_module(m)]
    if not units:
        kind = "TE layers" if any(is_te_module(m) for m in model.modules()) else "no plain-torch units"
        return torch.compile(model), (f"train.compile: on: the whole {type(model).__name__} as one region "
                                      f"({kind}); the first step compiles it")
    for module in [*units, *also]:
        module.forward = torch.compile(module.forward)
    # The declared class, not FSDP2's per-class wrapper type (FSDPBlock).
    names = sorted({next(c.__name__ for c in classes if isinstance(u, c)) for u in units})
    extra = f", {len(also)} {'/'.join(sorted({type(m).__name__ for m in also}))} outside them" if also else ""
    return model, (f"train.compile: on: {len(units)} {'/'.join(names)} unit(s) compiled in place, one graph "
                   f"reused by units of the same shapes{extra}, and the cross-entropy on a GPU; the first step "
                   "compiles it")
