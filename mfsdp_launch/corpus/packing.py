"""Where a source's ``k``-th sample starts, for ``pack=windows`` and ``pack=documents``.

Both walk the source in epochs without keeping any per-sample state: epoch ``e = k // count``
visits every candidate start once, in the order of a keyed pseudo-random permutation of
``[0, count)`` (a Feistel network with cycle walking: O(1) memory and time whatever the corpus
size). The key is a hash of ``(seed, source, epoch)``, so each epoch has its own order.

``windows``: non-overlapping windows of ``n = seq_len + 1`` tokens on a grid shifted by a
per-epoch random offset, so later epochs cut the text at other places.

``documents``: samples start at document starts and run on through the following documents
(each ends with EOS in a prepared corpus); a document qualifies when ``n`` tokens fit between
its start and the end of the range, so no sample needs padding.

A range ``[lo, hi)`` is the part of the source a split (train/val) may use; samples never leave it.
"""

from __future__ import annotations

import math

from .stream import TokenStream

_M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def key_of(*parts: int) -> int:
    k = 0
    for p in parts:
        k = mix64(k ^ (int(p) & _M64))
    return k


def permute(i: int, n: int, key: int, rounds: int = 4) -> int:
    """Image of ``i`` under a keyed bijection of ``[0, n)``."""
    if not 0 <= i < n:
        raise IndexError(f"{i} outside [0, {n})")
    half = max(1, math.ceil(math.log2(n) / 2)) if n > 1 else 1
    mask = (1 << half) - 1
    x = i
    while True:  # cycle walking: the domain 4**half < 4n, so a few steps on average
        left, right = x >> half, x & mask
        for r in range(rounds):
            left, right = right, left ^ (mix64(key ^ (r << 56) ^ right) & mask)
        x = (left << half) | right
        if x < n:
            return x


class Windows:
    def __init__(self, stream: TokenStream, lo: int, hi: int, n: int, key: int):
        if hi - lo < n:
            raise ValueError(f"range of {hi - lo} tokens is shorter than a sample ({n})")
        self.stream, self.lo, self.n, self.key = stream, lo, n, key
        length = hi - lo
        # With >= 2 windows' room the grid shifts by < n per epoch and holds length // n - 1 windows.
        self.count = length // n - 1 if length >= 2 * n else 1
        self.slack = n if length >= 2 * n else length - n + 1

    def start(self, k: int) -> int:
        epoch, j = divmod(int(k), self.count)
        ekey = key_of(self.key, epoch)
        shift = mix64(ekey) % self.slack
        return self.lo + shift + permute(j, self.count, ekey) * self.n


class Documents:
    def __init__(self, stream: TokenStream, lo: int, hi: int, n: int, key: int):
        if hi - lo < n:
            raise ValueError(f"range of {hi - lo} tokens is shorter than a sample ({n})")
        self.stream, self.key = stream, key
        self.first = stream.doc_at(lo)
        if stream.doc_start(self.first) < lo:  # a token-level split inside a document
            self.first += 1
        self.count = stream.doc_at(hi - n) - self.first + 1
        if self.count < 1:
            raise ValueError(f"no document in tokens [{lo}, {hi}) starts {n} tokens before the end")

    def start(self, k: int) -> int:
        epoch, j = divmod(int(k), self.count)
        return self.stream.doc_start(self.first + permute(j, self.count, key_of(self.key, epoch)))


PACKERS = {"windows": Windows, "documents": Documents}


def split_point(stream: TokenStream, val_fraction: float) -> int:
    """Token offset where a source's validation tail starts.

    The document boundary nearest to ``(1 - val_fraction) * n_tokens``; a source that is one
    document (a flat .bin without eos_id) is cut at that token.
    """
    target = int(round(stream.n_tokens * (1.0 - float(val_fraction))))
    target = min(max(target, 1), stream.n_tokens - 1)
    d = stream.doc_at(target)
    candidates = [c for c in (stream.doc_start(d), stream.doc_start(d + 1)) if 0 < c < stream.n_tokens]
    if not candidates:
        return target
    return min(candidates, key=lambda c: (abs(c - target), c))
