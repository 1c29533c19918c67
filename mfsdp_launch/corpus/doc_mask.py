"""Attention that stays inside documents when a sample packs several of them.

``doc_ids[b, t]`` numbers the documents of row ``b`` (non-decreasing; equal ids = same
document). From it: a block-causal boolean mask for
``F.scaled_dot_product_attention(attn_mask=...)`` (True = may attend), positions that restart
at 0 in every document, and the ``cu_seqlens`` that variable-length (THD) kernels such as
Transformer Engine's or flash-attn's take. torch is imported only inside the torch functions.
"""

from __future__ import annotations

import numpy as np


def doc_ids_from_boundaries(n: int, boundaries) -> np.ndarray:
    """int32 ``[n]`` document numbers given the offsets where documents start (0 implied)."""
    step = np.zeros(n, dtype=np.int32)
    step[np.asarray(boundaries, dtype=np.int64)] = 1
    return np.cumsum(step, dtype=np.int32)


def doc_ids_from_eos(tokens, eos_id: int):
    """Document numbers of ``tokens [..., T]`` when each document ends with ``eos_id``.

    Works on numpy arrays and torch tensors (returns the same kind).
    """
    ends = tokens == eos_id
    if isinstance(tokens, np.ndarray):
        starts = np.zeros(tokens.shape, dtype=np.int32)
        starts[..., 1:] = ends[..., :-1]
        return np.cumsum(starts, axis=-1, dtype=np.int32)
    import torch

    starts = torch.zeros_like(tokens, dtype=torch.int32)
    starts[..., 1:] = ends[..., :-1].to(torch.int32)
    return torch.cumsum(starts, dim=-1, dtype=torch.int32)


def _tensor(doc_ids):
    import torch

    t = torch.as_tensor(doc_ids)
    return t.unsqueeze(0) if t.dim() == 1 else t


def block_causal_mask(doc_ids):
    """Bool ``[B, 1, T, T]``: query ``i`` attends key ``j`` iff ``j <= i`` and same document."""
    import torch

    d = _tensor(doc_ids)
    t = d.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=d.device).tril()
    same = d.unsqueeze(-1) == d.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


def position_ids(doc_ids):
    """Long ``[B, T]``: position of each token inside its own document."""
    import torch

    d = _tensor(doc_ids)
    idx = torch.arange(d.shape[-1], device=d.device).expand_as(d)
    new = torch.ones_like(d, dtype=torch.bool)
    new[:, 1:] = d[:, 1:] != d[:, :-1]
    first = torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), dim=1).values
    return idx - first


def cu_seqlens(doc_ids):
    """Int32 ``[n_segments + 1]``: segment boundaries of the flattened ``[B * T]`` batch.

    A segment is one document inside one row (rows never join), as varlen attention wants.
    """
    import torch

    d = _tensor(doc_ids)
    new = torch.ones_like(d, dtype=torch.bool)
    new[:, 1:] = d[:, 1:] != d[:, :-1]
    starts = torch.nonzero(new.reshape(-1)).flatten()
    end = torch.tensor([d.numel()], device=d.device)
    return torch.cat([starts, end]).to(torch.int32)


def flex_block_mask(doc_ids):
    """The same block-causal rule as a flex-attention ``BlockMask`` (skips whole masked blocks).

    Use with ``torch.nn.attention.flex_attention.flex_attention(q, k, v, block_mask=...)``
    (compiled, on GPU, for speed); the mask is built on ``doc_ids``' device.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    d = _tensor(doc_ids)

    def same_doc_causal(b, h, q, kv):
        return (d[b, q] == d[b, kv]) & (q >= kv)

    b, t = d.shape
    return create_block_mask(same_doc_causal, B=b, H=None, Q_LEN=t, KV_LEN=t, device=str(d.device))
