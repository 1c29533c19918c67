"""Inference for the `gpt` model with a key/value cache, reusing its modules' weights (the training
forward in gpt_modules.py stays as it is).

    cache = KVCache.for_model(model, batch=1, max_len=prompt_len + new_tokens)
    logits = prefill(model, prompt_ids, cache)        # [B, T, vocab]; fills cache[:, :, :T]
    logits = decode_step(model, next_ids, pos, cache)  # [B, 1, vocab] for the token at `pos`

The cache is preallocated ([B, kv_heads, max_len, head_dim] per layer) and `decode_step` has
static shapes: it writes position `pos` (a 0-d LongTensor on the model's device) and attends over
the whole cache with a mask hiding the positions after `pos`, so it can be captured whole
(`torch.compile(mode="reduce-overhead")`, a CUDA graph) and replayed for every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.nn.functional as F

from .gpt_modules import GPT, Attention, apply_rope, rope_cos_sin


def supports(model) -> bool:
    """Whether this module decodes `model` (the built-in gpt, unwrapped)."""
    return isinstance(model, GPT)


@dataclass
class KVCache:
    keys: List[torch.Tensor]  # per layer [B, kv_heads, max_len, head_dim]
    values: List[torch.Tensor]

    @classmethod
    def for_model(cls, model: GPT, batch: int, max_len: int) -> "KVCache":
        d, w = model.dims, model.tok_emb.weight
        shape = (batch, d.n_kv_heads, max_len, d.head_dim)
        return cls([torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(d.n_layers)],
                   [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(d.n_layers)])

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


def _qkv(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k, v of `x` [B, T, dim] as [B, heads, T, head_dim], q and k rotated."""
    q, k, v = attn.heads(x)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _attend(attn: Attention, q, k, v, mask=None) -> torch.Tensor:
    """SDPA over k, v (grouped-query heads expanded when a mask is given, as in training)."""
    if mask is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.n_kv_heads != attn.n_heads)
    else:
        if attn.n_kv_heads != attn.n_heads:
            k, v = (t.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    B, _, T, _ = q.shape
    return attn.wo(y.transpose(1, 2).reshape(B, T, attn.n_heads * attn.head_dim))


def _head(model: GPT, x: torch.Tensor) -> torch.Tensor:
    x = model.norm(x)
    return model.lm_head(x) if model.lm_head is not None else F.linear(x, model.tok_emb.weight)


@torch.no_grad()
def prefill(model: GPT, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, T, vocab] of the prompt (causal, as the training forward); its keys and values
    go to cache positions 0..T-1."""
    T = input_ids.shape[1]
    if T > cache.max_len:
        raise ValueError(f"prompt of {T} tokens exceeds the cache's {cache.max_len}")
    x = model.tok_emb(input_ids)
    cos, sin = rope_cos_sin(T, model.dims.head_dim, model.dims.rope_theta, x.device, model.dims.rope_scaling)
    for i, layer in enumerate(model.layers):
        q, k, v = _qkv(layer.attn, layer.attn_norm(x), cos, sin)
        cache.keys[i][:, :, :T] = k
        cache.values[i][:, :, :T] = v
        x = x + _attend(layer.attn, q, k, v)
        x = x + layer.mlp(layer.mlp_norm(x))
    return _head(model, x)


@torch.no_grad()
def decode_step(model: GPT, input_ids: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, 1, vocab] of one new token per sequence at position `pos` (0-d LongTensor):
    its key and value are written there, and it attends to cache positions 0..pos."""
    x = model.tok_emb(input_ids)
    cos, sin = rope_cos_sin(pos.view(1), model.dims.head_dim, model.dims.rope_theta, x.device, model.dims.rope_scaling)
    visible = (torch.arange(cache.max_len, device=x.device) <= pos).view(1, 1, 1, -1)
    at = pos.view(1)
    for i, layer in enumerate(model.layers):
        q, k, v = _qkv(layer.attn, layer.attn_norm(x), cos, sin)
        cache.keys[i].index_copy_(2, at, k)
        cache.values[i].index_copy_(2, at, v)
        x = x + _attend(layer.attn, q, cache.keys[i], cache.values[i], mask=visible)
        x = x + layer.mlp(layer.mlp_norm(x))
    return _head(model, x)
