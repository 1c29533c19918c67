"""A small, readable LLaMA-style GPT (nanoGPT layout): RMSNorm, RoPE, SwiGLU, grouped-query
attention through `F.scaled_dot_product_attention`, tied or untied output head.

`Block` is the FSDP unit. The model holds no buffers: RoPE tables are computed in fp32 for the
actual sequence length once per forward (GPT.forward hands them to every Attention as an
attribute, not an argument), so meta-device init plus `to_empty()` leaves nothing uninitialized,
and FSDP's casting of forward inputs to bf16 never touches them.

`forward(input_ids, doc_ids=None)`: with `doc_ids` (data.doc_mask) a token attends only to earlier
tokens of its own document (models/doc_attention.py: varlen flash attention on a GPU, a dense
block-causal SDPA mask as the CPU fallback). Positions are not restarted per
document: RoPE scores depend only on the distance between two tokens, so a document attends
within itself exactly as it would alone.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..doc_attention import Documents
from .dims import GPTDims, RopeScaling

INIT_STD = 0.02


class Linear(nn.Linear):
    """Bias-free nn.Linear whose `reset_parameters` draws N(0, init_std).

    Megatron-FSDP's meta-device init calls `reset_parameters()` on every module that owns a
    parameter, so putting the GPT init here makes that path and `GPT.init_weights` agree.
    """

    def __init__(self, in_features: int, out_features: int, init_std: float, **kw):
        self.init_std = init_std  # set first: nn.Linear.__init__ calls reset_parameters
        super().__init__(in_features, out_features, bias=False, **kw)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class Embedding(nn.Embedding):
    """nn.Embedding initialized N(0, 0.02) instead of N(0, 1)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, **kw):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Fused kernel; it accumulates in fp32 for bf16 inputs.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None, device=None) -> torch.Tensor:
    """RoPE's fp32 inverse frequencies [head_dim // 2]; every RoPE here (gpt, its KV-cache and fused
    decoders, te_gpt's scaled table) takes them from this one function.

    With Llama-3 `scaling` (transformers' `_compute_llama3_parameters`, same ops in the same
    order): wavelengths past old_ctx / low_freq_factor are slowed by `factor`, those under
    old_ctx / high_freq_factor kept, and the band between blended linearly in old_ctx / wavelen."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    old, low, high, factor = (scaling.original_max_position_embeddings, scaling.low_freq_factor,
                              scaling.high_freq_factor, scaling.factor)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def rope_angles(positions, head_dim: int, theta: float, device,
                scaling: Optional[RopeScaling] = None) -> torch.Tensor:
    """fp32 angles [len(positions), head_dim], "rotate half" layout (as HF and TE's
    non-interleaved RotaryPositionEmbedding: the frequencies repeated over both halves).

    `positions`: a sequence length (positions 0..n-1) or the tokens' positions (context
    parallelism: a rank's tokens are not contiguous)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    if isinstance(positions, int):
        positions = torch.arange(positions, device=device)
    positions = positions.to(device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.cat((angles, angles), dim=-1)


def rope_cos_sin(positions, head_dim: int, theta: float, device,
                 scaling: Optional[RopeScaling] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len(positions), head_dim] in fp32 of `rope_angles`."""
    angles = rope_angles(positions, head_dim, theta, device, scaling)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, head_dim] by the positions' angles; math in fp32. On CUDA, outside
    torch.compile, one Triton kernel does it (rope_kernel.py: the same math, a tenth of the kernels)."""
    if x.is_cuda and not torch.compiler.is_compiling():  # (Dynamo folds the test: it traces plain_rope)
        from . import rope_kernel  # (Triton: imported only where a GPU runs the step)

        if rope_kernel.applies(x, cos, sin):
            return rope_kernel.fused_rope(x, cos, sin)
    return plain_rope(x, cos, sin)


def plain_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope in torch ops (the CPU's path, and what torch.compile fuses)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, d: GPTDims, out_std: float, **kw):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = d.n_heads, d.n_kv_heads, d.head_dim
        self.rope_theta, self.rope_scaling = d.rope_theta, d.rope_scaling
        # One GEMM for q, k and v.
        self.wqkv = Linear(d.dim, d.q_dim + 2 * d.kv_dim, INIT_STD, **kw)
        self.wo = Linear(d.q_dim, d.dim, out_std, **kw)
        # model.qk_norm (Qwen3): each query and key head RMS-normalized before RoPE.
        self.q_norm = RMSNorm(d.head_dim, d.norm_eps, **kw) if d.qk_norm else None
        self.k_norm = RMSNorm(d.head_dim, d.norm_eps, **kw) if d.qk_norm else None
        # Set by models/llama/context_parallel.py under mesh.cp > 1: this rank holds part of the sequence.
        self.context_parallel = None
        # (cos, sin) of this forward's positions, set by GPT.forward: one table for all layers. Not a
        # forward argument, so FSDP's input casting keeps it fp32; computed per layer, torch.compile
        # fused the cos/sin into the q/k kernels and spent 14 % of a 1.4B step on them.
        self.rope: Optional[tuple] = None

    def rope_tables(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        cp = self.context_parallel
        return rope_cos_sin(T if cp is None else cp.positions(T, device), self.head_dim, self.rope_theta, device,
                            self.rope_scaling)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x [B, T, dim] as [B, heads, T, head_dim], before RoPE (q and k normalized
        under qk_norm). The KV-cache decoder (models/llama/kv_cache.py) uses it too."""
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.wqkv(x).split(
            [self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=-1
        )
        q, k = q.view(B, T, self.n_heads, hd), k.view(B, T, self.n_kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(B, T, self.n_kv_heads, hd).transpose(1, 2)
        return q.transpose(1, 2), k.transpose(1, 2), v

    def forward(self, x: torch.Tensor, mask: Optional[Documents] = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.heads(x)
        cp = self.context_parallel
        shared = self.rope is not None and self.rope[0].shape[0] == T
        cos, sin = self.rope if shared else self.rope_tables(T, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cp is not None:
            if mask is not None:  # validation refuses data.doc_mask with mesh.cp > 1
                raise ValueError("a document mask with context parallelism is not supported")
            y = cp.attend(q, k, v)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        else:
            y = mask.attend(q, k, v)  # per document (Documents)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused in one GEMM."""

    def __init__(self, d: GPTDims, out_std: float, ffn_dim: Optional[int] = None, **kw):
        super().__init__()
        ffn = ffn_dim or d.ffn_dim
        self.w_gate_up = Linear(d.dim, 2 * ffn, INIT_STD, **kw)
        self.w_down = Linear(ffn, d.dim, out_std, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block; the FSDP unit. Block `layer`'s MLP is a mixture of experts
    (models/llama/moe.py) when the dims say that layer is one."""

    def __init__(self, d: GPTDims, layer: int = 0, **kw):
        super().__init__()
        # GPT-2 / Megatron scaling: residual-branch outputs shrink with depth.
        out_std = INIT_STD / math.sqrt(2 * d.n_layers)
        self.attn_norm = RMSNorm(d.dim, d.norm_eps, **kw)
        self.attn = Attention(d, out_std, **kw)
        self.mlp_norm = RMSNorm(d.dim, d.norm_eps, **kw)
        if d.is_moe_layer(layer):
            from .moe import MoE

            shared = MLP(d, out_std, ffn_dim=d.moe.shared_ffn_dim, **kw) if d.moe.shared_experts else None
            self.mlp = MoE(d, out_std, shared=shared, **kw)
        else:
            self.mlp = MLP(d, out_std, **kw)

    def forward(self, x: torch.Tensor, mask: Optional[Documents] = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """input_ids [B, T] (and doc_ids [B, T] for a block-causal mask) -> logits [B, T, vocab].

    With tied embeddings there is no `lm_head`: the head reads `tok_emb.weight` directly, so a
    single Parameter exists and nothing (to_empty, FSDP's parameter swapping) can untie it.
    """

    def __init__(self, dims: GPTDims, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.dims = dims
        kw = {"dtype": dtype} if dtype is not None else {}
        self.tok_emb = Embedding(dims.vocab_size, dims.dim, **kw)
        self.layers = nn.ModuleList(Block(dims, i, **kw) for i in range(dims.n_layers))
        self.norm = RMSNorm(dims.dim, dims.norm_eps, **kw)
        self.lm_head = None if dims.tie_embeddings else Linear(dims.dim, dims.vocab_size, INIT_STD, **kw)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.tok_emb(input_ids)
        mask = None if doc_ids is None else Documents(doc_ids, cu_seqlens)
        tables = self.layers[0].attn.rope_tables(input_ids.shape[1], x.device) if len(self.layers) else None
        for layer in self.layers:
            layer.attn.rope = tables  # every layer shares the positions (and the cp layout)
            x = layer(x) if mask is None else layer(x, mask)
        x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.tok_emb.weight)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize every parameter in place from the torch RNG, in a fixed module order:
        N(0, 0.02) weights, residual output projections N(0, 0.02/sqrt(2*n_layers)), norms ones.

        In-place `nn.init` ops only, so it works on real, meta-materialized (`to_empty`) and
        sharded DTensor parameters alike.
        """
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
