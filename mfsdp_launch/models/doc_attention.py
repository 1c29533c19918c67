"""Attention per document of a packed sample (data.pack=documents, data.doc_mask=true), for `gpt`
and `model=hf`, with memory linear in the sequence length on a GPU.

`Documents(doc_ids[, cu_seqlens])` is built once per forward and shared by every layer (the
loader computes `cu_seqlens` on the host: on the device their count is a sync). On a CUDA device with
bf16/fp16 activations it runs torch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`, causal, GQA without expanding K/V): the [B, T] batch is
one flat stream of B * T tokens cut at every document boundary and row end (`cu_seqlens`), so
no T x T mask exists. Elsewhere (the CPU, fp32, a torch without varlen) it falls back to SDPA
with the dense block-causal [B, 1, T, T] mask (corpus/doc_mask.py), built once per forward.
`KERNELS` counts which path ran (the GPU test checks it), and each forward's positions restart
at 0 in every document (`position_ids`, for models that take them).

`model=hf`: `use_document_attention(model)` registers `document_attention` with transformers'
`AttentionInterface` (transformers then builds no mask of its own) and `hf_document_loss`
passes `Documents` and the per-document `position_ids` down the model's forward; without a
`Documents` in the call the registered function is plain SDPA.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Optional

from ..corpus.doc_mask import block_causal_mask, cu_seqlens, position_ids

if TYPE_CHECKING:
    import torch
    from torch import nn

ATTENTION = "mfsdp_documents"
KWARG = "mfsdp_documents"  # the keyword that carries Documents through an HF model's forward
KERNELS: Counter = Counter()  # "varlen" | "dense" | "te_thd" (te_modules.py): attention calls per path, in this process


def _varlen_causal_kwargs(flat: list, heads: int) -> dict:
    """varlen_attn's causal and grouped-query keywords for the installed torch: torch 2.11 has
    window_size but no enable_gqa (K/V heads are expanded in `flat` in place then), 2.10 is_causal."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if flat[1].shape[1] != heads:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            flat[1], flat[2] = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in flat[1:])
    return kwargs


def varlen_available(q: "torch.Tensor") -> bool:
    """Whether torch's varlen flash attention takes these queries ([B, H, T, D])."""
    import torch

    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] > 256 or q.shape[-1] % 8:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


class Documents:
    """The document layout of a [B, T] batch (`doc_ids`: non-decreasing document numbers per row)."""

    def __init__(self, doc_ids: "torch.Tensor", cu_seqlens: Optional["torch.Tensor"] = None):
        self.doc_ids = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)
        self.batch, self.length = self.doc_ids.shape
        # The loader's (computed on the host): from doc_ids on the device they cost a sync.
        self._cu_seqlens: Optional["torch.Tensor"] = cu_seqlens
        self._mask: Optional["torch.Tensor"] = None
        self._positions: Optional["torch.Tensor"] = None

    @property
    def position_ids(self) -> "torch.Tensor":
        """Long [B, T]: each token's position inside its own document."""
        if self._positions is None:
            self._positions = position_ids(self.doc_ids)
        return self._positions

    def cu_seqlens(self) -> "torch.Tensor":
        if self._cu_seqlens is None:
            self._cu_seqlens = cu_seqlens(self.doc_ids)
        return self._cu_seqlens

    def dense_mask(self) -> "torch.Tensor":
        if self._mask is None:
            self._mask = block_causal_mask(self.doc_ids)
        return self._mask

    def attend(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", scale: Optional[float] = None):
        """Causal attention inside each document: q [B, H, T, D], k/v [B, H_kv, T, D] -> [B, H, T, D]."""
        import torch.nn.functional as F

        B, H, T, D = q.shape
        if varlen_available(q):
            from torch.nn.attention.varlen import varlen_attn

            KERNELS["varlen"] += 1
            flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]
            cu = self.cu_seqlens()
            # max_q/max_k: T bounds every segment; a host-side maximum would cost a device sync.
            out = varlen_attn(*flat, cu, cu, T, T, scale=scale, **_varlen_causal_kwargs(flat, H))
            return out.view(B, T, H, D).transpose(1, 2)
        KERNELS["dense"] += 1
        if k.shape[1] != H:  # expanded: the masked (memory-efficient) SDPA kernels lack GQA
            k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense_mask(), scale=scale)


# --------------------------------------------------------------------------- model=hf


def document_attention(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function contract: (output [B, T, heads, head_dim], weights)."""
    docs = kwargs.get(KWARG)
    if docs is None:  # no document layout in this call (e.g. generation): transformers' SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return docs.attend(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None


def use_document_attention(model: "nn.Module") -> None:
    """Run an HF model's attention through `document_attention` from now on (idempotent)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) == ATTENTION:
        return
    from .hf.model import use_attention

    use_attention(model, ATTENTION, document_attention)


def hf_document_logits(model: "nn.Module", input_ids: "torch.Tensor", doc_ids: "torch.Tensor",
                       cu_seqlens: Optional["torch.Tensor"] = None) -> "torch.Tensor":
    """Logits [B, T, V] of an HF causal LM whose attention stays inside each document."""
    docs = Documents(doc_ids, cu_seqlens)
    use_document_attention(_hf_model(model))
    return model(input_ids=input_ids, position_ids=docs.position_ids, use_cache=False, **{KWARG: docs}).logits


def _hf_model(model: "nn.Module") -> "nn.Module":
    """The PreTrainedModel inside FSDP / Megatron-FSDP / torch.compile wrappers."""
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m, "set_attn_implementation"):
            return m
    return model
