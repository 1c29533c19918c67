"""Activation checkpointing of a built model's transformer blocks (`model.activation_checkpointing`).

Applied after the model is built and before any engine shards it. Each chosen block's `forward` is
wrapped IN PLACE: the module tree, its parameter names (checkpoints) and its classes (the FSDP unit
modules of FSDP2 and Megatron-FSDP) stay exactly as they were, which `checkpoint_wrapper` would not
give (it inserts a `_checkpoint_wrapped_module` level). The engine's hooks then run around the
checkpointed forward, as torchtitan's FSDP-outside, checkpoint-inside order.

Modes: `none`; `full` checkpoints every block (only block inputs stay alive); `selective` checkpoints
every `model.ac_every`-th block (blocks 0, N, 2N, ...), trading memory for less recompute.

`gpt` blocks use `torch.utils.checkpoint` (non-reentrant). `te_gpt` TransformerLayers use Transformer
Engine's own `transformer_engine.pytorch.distributed.checkpoint(function, *args, use_reentrant=False,
**kwargs)` (TE 2.x; its own options are keywords, popped before the forward's kwargs), which
re-enters the forward's FP8 autocast and recipe in the recompute. The wrapped callable is the
layer's bound `forward`, not an nn.Module, so TE takes its own path rather than falling back to
torch's. tests/gpu/test_te_parallel_gpu.py compares `full` with `none` on a GPU.

`hf` and `custom` checkpoint their FSDP unit modules (an HF model's `_no_split_modules` decoder
layers, or `model.fsdp_unit_modules`): `checkpoint_units` takes the outermost instances in module
order, so a unit nested in another unit is never checkpointed twice.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, List, Sequence

from ..core.schema import ACMode

if TYPE_CHECKING:  # torch-free at import: the memory estimate counts blocks with checkpointed_blocks
    import torch.nn as nn


def checkpointed_blocks(n_blocks: int, mode: ACMode, every: int) -> List[int]:
    """Indices of the blocks that recompute their forward in backward."""
    mode = ACMode(mode)
    if mode is ACMode.none:
        return []
    if mode is ACMode.full:
        return list(range(n_blocks))
    return list(range(0, n_blocks, max(int(every), 1)))


def apply_activation_checkpointing(model: nn.Module, mode, every: int = 1) -> List[int]:
    """Checkpoint the blocks of `model.layers` (gpt, te_gpt) per `mode`; returns their indices."""
    return checkpoint_blocks(list(model.layers), mode, every)


def checkpoint_blocks(blocks: Sequence[nn.Module], mode, every: int = 1) -> List[int]:
    """Checkpoint `blocks` (in forward order) per `mode`; returns the indices checkpointed."""
    indices = checkpointed_blocks(len(blocks), mode, every)
    for i in indices:
        block = blocks[i]
        block.forward = _checkpointed(block.forward, te=is_te_module(block))
    return indices


def outermost_units(model: nn.Module, unit_classes: Sequence[type]) -> List[nn.Module]:
    """The instances of `unit_classes` below the root that no other such instance contains."""
    classes = tuple(unit_classes)
    found: List[nn.Module] = []
    inside = set()
    for module in model.modules():
        if module is model or id(module) in inside or not isinstance(module, classes):
            continue
        found.append(module)
        inside.update(id(m) for m in module.modules())
    return found


def checkpoint_units(model: nn.Module, unit_classes: Sequence[type], mode, every: int = 1) -> List[int]:
    """Checkpoint the model's FSDP unit modules (hf, custom) per `mode`; returns the indices."""
    return checkpoint_blocks(outermost_units(model, unit_classes), mode, every)


def is_te_module(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformer_engine") or any(
        c.__module__.startswith("transformer_engine") for c in type(module).__mro__)


def _checkpointed(forward, *, te: bool):
    if te:
        from transformer_engine.pytorch.distributed import checkpoint as te_checkpoint

        @functools.wraps(forward)
        def run_te(*args, **kwargs):
            return te_checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return run_te

    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args, **kwargs):
        # Non-reentrant: works with inputs that need no grad and with FSDP2/DTensor parameters;
        # preserve_rng_state keeps any randomness in the block identical in the recompute.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
