"""`model=gpt` / `model=te_gpt`: the Llama family's config section (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...core.schema import LossKernel, ModelConfig


@dataclass
class GPTModelConfig(ModelConfig):
    # A size preset (models/llama/dims.py); the dims below override it when set.
    preset: str = "tiny"
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    ffn_dim: Optional[int] = None
    vocab_size: Optional[int] = None
    tie_embeddings: Optional[bool] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    loss_kernel: LossKernel = LossKernel.torch
    # Start from a Llama-layout HF directory (dims from its config.json).
    init_from: Optional[str] = None
