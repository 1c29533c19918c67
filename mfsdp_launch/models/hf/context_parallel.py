"""Context parallelism for `model=hf`: the sequence is split over the mesh's `cp` dim in the
load-balanced layout of `gpt` (models/cp_layout.py: cp rank r holds chunks r and 2*cp-1-r of
2*cp), and attention all-gathers keys and values over cp (models/llama/context_parallel.py's
`ContextParallel`, the same code as `gpt`'s).

Two hooks into transformers, nothing patched: the model's attention runs through an attention
function registered with transformers' `AttentionInterface` (its queries, keys and values come in
[B, heads, T/cp, head_dim] after RoPE, as for SDPA), and a pre-forward hook passes the local
tokens' global `position_ids`, from which the model computes its RoPE tables. transformers builds
no mask for an attention function it does not know, so each chunk's causal mask is ours.
Sliding-window attention is refused before anything is spawned (the family's check).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

ATTENTION = "mfsdp_context_parallel"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function contract: (output [B, T, heads, head_dim], weights)."""
    out = module.context_parallel.attend(query, key, value, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _positions(cp):
    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is None:
            ids = args[0] if args else kwargs["input_ids"]
            kwargs = dict(kwargs, position_ids=cp.positions(ids.shape[1], ids.device).unsqueeze(0))
        return args, kwargs

    return hook


def apply_context_parallel(model: "nn.Module", cp_mesh) -> None:
    """Run a built HF causal LM's attention over `cp_mesh` (a 1-D DeviceMesh), in place."""
    import torch.distributed as dist

    from ..llama.context_parallel import ContextParallel
    from .model import use_attention

    group = cp_mesh.get_group()
    cp = ContextParallel(group, dist.get_rank(group), dist.get_world_size(group))
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not attention:
        raise ValueError(f"{type(model).__name__} has no *Attention modules to run over cp")
    for module in attention:
        module.context_parallel = cp
    use_attention(model, ATTENTION, _attention)
    model.register_forward_pre_hook(_positions(cp), with_kwargs=True)


def sliding_window(config) -> int:
    """The config's sliding attention window (0: none), which all-gather CP does not apply."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "use_sliding_window", True) is False:
        return 0
    return int(getattr(text, "sliding_window", None) or 0)
