"""`model=hf`: a Hugging Face causal LM's config section (docs/models.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...core.schema import LossKernel, ModelConfig


@dataclass
class HFModelConfig(ModelConfig):
    # A local HF directory, or a config dict (a mapping, as model=custom's kwargs) plus the class name.
    path: Optional[str] = None
    hf_config: Any = None
    hf_class: Optional[str] = None
    pretrained: bool = False  # load model.path's safetensors into the sharded model
    # chunked: the head and cross-entropy a chunk of tokens at a time (models/chunked_loss.py)
    loss_kernel: LossKernel = LossKernel.torch
