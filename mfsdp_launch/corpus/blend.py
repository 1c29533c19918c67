"""Weighted mixing of sources, deterministic in the global sample index.

A fixed interleave table of ``PERIOD`` slots gives source ``s`` exactly ``count[s]`` slots per
period (largest-remainder rounding of its weight), spread evenly: source ``s``'s ``j``-th slot
sits at its ideal time ``(j + 0.5) / count[s]`` and all slots are merged by that time (ties by
source number). Sample ``g`` then comes from ``table[g % PERIOD]`` and is that source's
``k``-th sample, ``k = (g // PERIOD) * count[s] + rank[g % PERIOD]``. So the mix is exact to
1/PERIOD over every period, regular within it, and O(1) per sample with a 512 KB table.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

PERIOD = 1 << 16


def slot_counts(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """Slots per period for each weight (largest remainder; every positive weight gets >= 1)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights must be finite and > 0, got {list(weights)}")
    if len(w) > period:
        raise ValueError(f"at most {period} sources")
    exact = w / w.sum() * period
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    order = np.argsort(-(exact - np.floor(exact)), kind="stable")
    i = 0
    while counts.sum() < period:
        counts[order[i % len(w)]] += 1
        i += 1
    while counts.sum() > period:  # only when the >= 1 floor over-filled
        j = int(np.argmax(counts))
        counts[j] -= 1
    return counts


class Blend:
    def __init__(self, weights: Sequence[float], period: int = PERIOD):
        self.period = int(period)
        self.counts = slot_counts(weights, self.period)
        src = np.repeat(np.arange(len(self.counts), dtype=np.int32), self.counts)
        rank = np.concatenate([np.arange(c, dtype=np.int64) for c in self.counts])
        when = (rank + 0.5) / self.counts[src]
        order = np.lexsort((src, when))  # by time, then by source number
        self.table = src[order]
        self.rank = rank[order]

    def __call__(self, g: int) -> Tuple[int, int]:
        """(source, k): sample ``g`` is the ``k``-th sample drawn from ``source``."""
        epoch, pos = divmod(int(g), self.period)
        s = int(self.table[pos])
        return s, epoch * int(self.counts[s]) + int(self.rank[pos])
