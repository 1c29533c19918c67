"""model=hf's attention without a device-to-host sync in every forward.

Before each forward, transformers (5.x) prepares the attention mask of an SDPA model. Given
position ids and no attention mask, it looks for packed sequences with a Python `if` over a
device tensor (`masking_utils.find_packed_sequence_indices`): one device-to-host sync per
forward, i.e. per micro-batch. The host then waits for the GPU to drain its queue, and the GPU
waits while the host launches the next layers; gpt's forward has none. (Session 33's profile of
the 8B HF slice idled 31 ms a step more than gpt's with the same kernels; this sync is the one
host-side difference found on the CPU.)

The launcher's forward passes input ids only (models/losses.py): no padding mask and positions
0..T-1, so the mask is causal. transformers builds no mask for an attention function it has no
mask function for (models/hf/context_parallel.py relies on the same rule), so SDPA registered
under a name of our own runs with `is_causal` and nothing before it. The result is the same as
transformers' SDPA path without a mask.

Only architectures whose SDPA mask is causal or nothing get it: a sliding window or per-layer
attention types keep transformers' SDPA and its masks. Context parallelism and document masks
replace it with their own attention functions, as they replaced SDPA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .context_parallel import sliding_window
from .model import use_attention

if TYPE_CHECKING:
    from torch import nn

ATTENTION = "mfsdp_causal"
# Decoder-only architectures whose attention takes transformers' causal mask and nothing else.
CAUSAL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def plainly_causal(config) -> bool:
    """Whether the architecture's SDPA mask is causal or nothing (see the module docstring)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) not in CAUSAL_TYPES or sliding_window(text):
        return False
    types = getattr(text, "layer_types", None)
    return not types or all(t == "full_attention" for t in types)


def use_causal_attention(model: "nn.Module") -> None:
    """Run a built SDPA model's attention through transformers' own SDPA function under `ATTENTION`
    where `plainly_causal`: without a mask, which transformers builds none for, SDPA runs causal
    (for a query longer than one token)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or not plainly_causal(config):
        return
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    use_attention(model, ATTENTION, sdpa_attention_forward)
