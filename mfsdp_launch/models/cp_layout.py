"""Which tokens of a sequence a context-parallel rank holds: the load-balanced ("head-tail") layout.

The sequence is cut into 2*cp equal chunks; cp rank r holds chunks r and 2*cp-1-r. Under a causal
mask an early chunk attends to few keys and a late chunk to many, so pairing them gives every rank
the same attention work. This is the layout Transformer Engine's context-parallel attention expects
and the one Megatron uses, so `gpt` and `te_gpt` shard their batches with this one rule.
"""

from __future__ import annotations

from typing import Tuple

import torch


def chunks_of(cp_rank: int, cp: int) -> Tuple[int, int]:
    """The two chunk indices (of 2*cp) that cp rank `cp_rank` holds, in sequence order."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp - 1}")
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(t: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's part of `t` along `dim` (length seq/cp): its two chunks, concatenated."""
    if cp == 1:
        return t
    if t.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {t.shape[dim]} is not divisible by 2*cp={2 * cp}")
    parts = t.chunk(2 * cp, dim=dim)
    first, second = chunks_of(cp_rank, cp)
    return torch.cat((parts[first], parts[second]), dim=dim)


def positions(seq_len: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """The global token positions (int64) of this rank's part of a `seq_len` sequence, in order."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, cp_rank, cp)


def unshard_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full tensor from every cp rank's part (index = cp rank)."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    chunks: list = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = chunks_of(rank, cp)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
