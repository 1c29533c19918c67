"""`train.compile`: torch.compile per FSDP unit (transformer block), as torchtitan does.

Each unit's `forward` is replaced by its compiled version in place, so parameter names, the FSDP
hooks around each unit (they run outside the compiled region) and activation checkpointing (already
applied to `forward`) stay as they are; one block's graph is compiled once and reused by every
block of the same shapes. Models without plain-torch units (TE layers, the seed's toys) are
compiled whole.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .activation_checkpoint import is_te_module


def compile_model(model: nn.Module, unit_classes: Sequence[type]) -> nn.Module:
    """The module to call for forward: `model` with its units compiled, or torch.compile(model)."""
    classes = tuple(unit_classes)
    units = [m for m in model.modules() if classes and isinstance(m, classes) and not is_te_module(m)]
    if not units:
        return torch.compile(model)
    for unit in units:
        unit.forward = torch.compile(unit.forward)
    return model
