"""One source's shards seen as a single token stream with global token and document numbers.

Token ``t`` of the stream is token ``t - tok_off[i]`` of shard ``i``; document ``d`` is document
``d - doc_off[i]`` of shard ``i``. Every shard starts with a document, so shard boundaries are
document boundaries. Reads copy only what is asked for; the rest stays memmapped.
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .indexed import Shard


class TokenStream:
    def __init__(self, shards: Sequence[Shard]):
        self.shards: List[Shard] = [s for s in shards if s.n_tokens > 0]
        self.tok_off = np.zeros(len(self.shards) + 1, dtype=np.int64)
        self.doc_off = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([s.n_tokens for s in self.shards], out=self.tok_off[1:])
        np.cumsum([s.n_docs for s in self.shards], out=self.doc_off[1:])
        self.n_tokens = int(self.tok_off[-1])
        self.n_docs = int(self.doc_off[-1])
        self.has_mask = any(s.mask_path is not None for s in self.shards)

    def _shard_of_token(self, t: int) -> int:
        return int(np.searchsorted(self.tok_off, t, side="right")) - 1

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens ``[start, start + n)`` as int64 (may span shards)."""
        if start < 0 or start + n > self.n_tokens:
            raise IndexError(f"tokens [{start}, {start + n}) outside [0, {self.n_tokens})")
        out = np.empty(n, dtype=np.int64)
        i, done = self._shard_of_token(start), 0
        while done < n:
            a = start + done - int(self.tok_off[i])
            b = min(self.shards[i].n_tokens, a + n - done)
            out[done : done + b - a] = self.shards[i].tokens[a:b]
            done += b - a
            i += 1
        return out

    def read_mask(self, start: int, n: int) -> np.ndarray:
        """The loss mask of tokens ``[start, start + n)`` as bool (True where a shard has none)."""
        if start < 0 or start + n > self.n_tokens:
            raise IndexError(f"tokens [{start}, {start + n}) outside [0, {self.n_tokens})")
        out = np.ones(n, dtype=bool)
        i, done = self._shard_of_token(start), 0
        while done < n:
            a = start + done - int(self.tok_off[i])
            b = min(self.shards[i].n_tokens, a + n - done)
            mask = self.shards[i].loss_mask
            if mask is not None:
                out[done : done + b - a] = mask[a:b] != 0
            done += b - a
            i += 1
        return out

    def doc_start(self, d: int) -> int:
        """Global token offset where document ``d`` starts (``n_tokens`` for ``d == n_docs``)."""
        if d == self.n_docs:
            return self.n_tokens
        i = int(np.searchsorted(self.doc_off, d, side="right")) - 1
        return int(self.tok_off[i]) + int(self.shards[i].doc_starts[d - int(self.doc_off[i])])

    def doc_at(self, t: int) -> int:
        """The document holding token ``t``."""
        i = self._shard_of_token(t)
        local = self.shards[i].doc_starts.searchsorted(t - int(self.tok_off[i]), side="right") - 1
        return int(self.doc_off[i]) + local

    def boundaries(self, start: int, n: int) -> np.ndarray:
        """Offsets ``p`` in ``(0, n)`` where a document starts at ``start + p``."""
        d, last = self.doc_at(start) + 1, self.doc_at(start + n - 1)
        parts = [np.zeros(0, np.int64)]
        while d <= last:  # one slice per shard: windows may hold many short documents
            i = int(np.searchsorted(self.doc_off, d, side="right")) - 1
            end = min(last, int(self.doc_off[i + 1]) - 1)
            lo = int(self.doc_off[i])
            local = np.asarray(self.shards[i].doc_starts[d - lo : end - lo + 1], dtype=np.int64)
            parts.append(local + (int(self.tok_off[i]) - start))
            d = end + 1
        return np.concatenate(parts)
