"""`model=gpt` / `model=te_gpt`: the Llama family's config section (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ...core.choice import Choice
from ...core.schema import LossKernel, ModelConfig


class Router(Choice):
    """model.moe.router: how a token's expert scores are made (models/llama/moe.py)."""

    softmax = "softmax"  # softmax over all experts, top-k, weights renormalized (Qwen3-MoE, Mixtral)
    # sigmoid scores, top-k of score + a per-expert bias that balances the load without a loss
    # (DeepSeek-V3's auxiliary-loss-free balancing), weights renormalized
    sigmoid = "sigmoid"


@dataclass
class MoEConfig:
    """model.moe.*: mixture-of-experts MLPs (models/llama/moe_dims.py). Null values come from the
    preset; `experts` null or 0 there: a dense model, and every other key must stay unset."""

    experts: Optional[int] = None  # routed experts per MoE layer
    top_k: Optional[int] = None  # experts each token goes to
    shared_experts: Optional[int] = None  # always-on experts (one SwiGLU of shared_experts * ffn_dim)
    ffn_dim: Optional[int] = None  # each expert's SwiGLU hidden size; null: model.ffn_dim
    every: Optional[int] = None  # layer i is MoE when (i + 1) % every == 0 (HF's decoder_sparse_step)
    router: Optional[Router] = None  # null: softmax
    aux_loss_coef: Optional[float] = None  # load-balancing loss (Switch) weight; null: 0.001
    z_loss_coef: Optional[float] = None  # router z-loss weight; null: 0
    # router=sigmoid: the per-expert bias moves by this much per step toward equal loads; null: 0.001
    bias_update_rate: Optional[float] = None
    # null: dropless (every token reaches its experts); a number: each expert takes at most
    # capacity_factor * tokens * top_k / experts of a micro-batch's tokens, the rest are dropped
    capacity_factor: Optional[float] = None


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
    # Attention head size; null: the preset's, else dim / n_heads (Qwen3: 128 at dim 2048, 32 heads).
    head_dim: Optional[int] = None
    # RMSNorm over each query and key head before RoPE (Qwen3); null: the preset's, else false.
    qk_norm: Optional[bool] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3.1/3.2 RoPE scaling: null (plain RoPE) or {rope_type: llama3, factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings} (models/llama/dims.py RopeScaling). A
    # mapping, as HF writes it; null with init_from: its config.json's.
    rope_scaling: Any = None
    loss_kernel: LossKernel = LossKernel.torch
    # Start from a Llama-layout HF directory (dims from its config.json).
    init_from: Optional[str] = None
    moe: MoEConfig = field(default_factory=MoEConfig)
