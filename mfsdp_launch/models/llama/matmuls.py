"""The matmuls of a `gpt` and a `te_gpt` token, by the module each runs in (core/fp8_flops.py):
what decides the FP8 share of `mfu_at_precision`. Their FLOPs sum to dims.flops_per_token
(6 x the active matmul weights + the attention core's 12 x q_dim x seq_len per layer)."""

from __future__ import annotations

from typing import List

from ...core.fp8_flops import GROUPED, HIGH, LINEAR, TE_ATTENTION, TE_LAYER, Matmul
from .dims import GPTDims


def _linear(module: str, n_in: int, n_out: int, fp8_by: str = LINEAR) -> Matmul:
    return Matmul(module, 6.0 * n_in * n_out, fp8_by, (n_in, n_out))


def gpt_matmuls(d: GPTDims, seq_len: int) -> List[Matmul]:
    """models/llama/gpt_modules.py's: nn.Linear layers (torchao converts them), SDPA, and in a
    mixture of experts the router (high precision) and the grouped experts (FP8 under torchao)."""
    out = []
    for i in range(d.n_layers):
        p = f"layers.{i}"
        out += [_linear(f"{p}.attn.wqkv", d.dim, d.q_dim + 2 * d.kv_dim), _linear(f"{p}.attn.wo", d.q_dim, d.dim),
                Matmul(f"{p}.attn", 12.0 * d.q_dim * seq_len, HIGH)]
        if d.is_moe_layer(i):
            m = d.moe
            out += [Matmul(f"{p}.mlp.router", 6.0 * d.dim * m.experts, HIGH),
                    Matmul(f"{p}.mlp.experts", 6.0 * m.top_k * 3 * d.dim * m.ffn_dim, GROUPED, (d.dim, m.ffn_dim))]
            if m.shared_experts:
                out += [_linear(f"{p}.mlp.shared.w_gate_up", d.dim, 2 * m.shared_ffn_dim),
                        _linear(f"{p}.mlp.shared.w_down", m.shared_ffn_dim, d.dim)]
        else:
            out += [_linear(f"{p}.mlp.w_gate_up", d.dim, 2 * d.ffn_dim), _linear(f"{p}.mlp.w_down", d.ffn_dim, d.dim)]
    return out + [_head(d, LINEAR)]


def te_gpt_matmuls(d: GPTDims, seq_len: int) -> List[Matmul]:
    """models/llama/te_modules.py's TEGPT: each TransformerLayer's fused QKV (layernorm_qkv),
    output projection (proj) and SwiGLU MLP (layernorm_mlp) are TE linears; its attention core
    (core_attention) runs in FP8 only under fp8.attention; the head is a te.Linear unless tied."""
    out = []
    for i in range(d.n_layers):
        p = f"layers.{i}"
        out += [_linear(f"{p}.self_attention.layernorm_qkv", d.dim, d.q_dim + 2 * d.kv_dim, TE_LAYER),
                Matmul(f"{p}.self_attention.core_attention", 12.0 * d.q_dim * seq_len, TE_ATTENTION),
                _linear(f"{p}.self_attention.proj", d.q_dim, d.dim, TE_LAYER),
                Matmul(f"{p}.layernorm_mlp", 6.0 * 3 * d.dim * d.ffn_dim, TE_LAYER)]
    return out + [_head(d, TE_LAYER)]


def _head(d: GPTDims, fp8_by: str) -> Matmul:
    """The output head: its own linear, or F.linear on the tied embedding (never in FP8)."""
    if d.tie_embeddings:
        return Matmul("tok_emb", 6.0 * d.dim * d.vocab_size, HIGH)
    return _linear("lm_head", d.dim, d.vocab_size, fp8_by)
