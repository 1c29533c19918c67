"""``data=tokens``: samples from memmapped token corpora, mixed by weight, pure in ``(seed, g)``.

Sample ``g`` (the global sample index, see ``mfsdp_launch.data``) is drawn from source
``s, k = blend(g)`` as that source's ``k``-th sample, whose start comes from the packer
(``windows`` or ``documents``, see packing.py) over the source's range for this split. Nothing
depends on what was sampled before, so a resume at any data-parallel size continues bitwise.

Splits: with ``val_fraction = f > 0`` each source is cut at the document boundary nearest to
``(1 - f)`` of its tokens; ``split="train"`` samples before the cut, ``split="val"`` after it
(disjoint documents). ``split="all"`` uses everything (e.g. for ``data.val_sources``).

Loss masks: a source prepared from chat data (``prepare --chat``) carries one per token; a
sample's mask says which of its tokens are training targets (sources without one: all).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..core.errors import ConfigError
from .blend import Blend
from .doc_mask import doc_ids_from_boundaries
from .packing import PACKERS, key_of, split_point
from .sources import check_sources, resolve
from .stream import TokenStream

SPLITS = ("train", "val", "all")


class TokenDataset:
    def __init__(self, sources: Sequence[Any], *, seq_len: int, seed: int, pack: str = "windows",
                 split: str = "train", val_fraction: float = 0.0, eos_id: Optional[int] = None,
                 cache_dir: Optional[str] = None, model_vocab: Optional[int] = None,
                 key: str = "data.sources"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "val" and not val_fraction:
            raise ConfigError("data.val_fraction", "is 0, so there is no validation split; "
                              "set it or data.val_sources")
        infos = check_sources(sources, key=key, seq_len=seq_len, model_vocab=model_vocab, pack=pack,
                              val_fraction=val_fraction if split != "all" else 0.0, eos_id=eos_id)
        self.seq_len, self.seed, self.pack, self.split = int(seq_len), int(seed), pack, split
        self.n = self.seq_len + 1
        self.paths = [s.spec for s in infos]
        self.weights = [s.weight for s in infos]
        self.vocab_size = max((s.vocab_size for s in infos if s.vocab_size), default=None)
        self.eos_id = next((s.eos_id for s in infos if s.eos_id is not None), eos_id)
        self.streams: List[TokenStream] = []
        self.packers = []
        for i, info in enumerate(infos):
            if "flat" in info.kinds and eos_id is not None:  # now split flat files at EOS
                info = resolve(info.spec, key=f"{key}[{i}].path", eos_id=eos_id, cache_dir=_cache(cache_dir))
            stream = TokenStream(info.shards)
            self.streams.append(stream)
            self.packers.append(self._packer(i, stream, split, float(val_fraction), key))
        self.blend = Blend(self.weights)
        self.has_loss_mask = any(st.has_mask for st in self.streams)

    def _packer(self, i: int, stream: TokenStream, split: str, f: float, key: str):
        lo, hi = 0, stream.n_tokens
        if split != "all" and f > 0:
            cut = split_point(stream, f)
            lo, hi = (0, cut) if split == "train" else (cut, hi)
        if self.pack == "documents" and stream.n_docs < 2:
            raise ConfigError("data.pack", f"documents needs document boundaries, but {key}[{i}] "
                              f"({self.paths[i]!r}) is a single document", "windows")
        try:
            return PACKERS[self.pack](stream, lo, hi, self.n, key_of(self.seed, i))
        except ValueError as e:
            where = "data.val_fraction" if split != "all" and f > 0 else f"{key}[{i}].path"
            raise ConfigError(where, f"the {split} part of {self.paths[i]!r}: {e}") from None

    def locate(self, g: int) -> Tuple[int, int]:
        """(source, first token in that source's stream) of sample ``g``."""
        if g < 0:
            raise ValueError(f"sample index must be >= 0, got {g}")
        s, k = self.blend(g)
        return s, self.packers[s].start(k)

    def sample(self, g: int) -> np.ndarray:
        """``seq_len + 1`` int64 tokens (inputs ``[:-1]``, labels ``[1:]``)."""
        s, start = self.locate(g)
        return self.streams[s].read(start, self.n)

    def sample_with_docs(self, g: int) -> Tuple[np.ndarray, np.ndarray]:
        """(tokens, doc_ids): ``doc_ids[i]`` numbers the documents inside the sample from 0."""
        s, start = self.locate(g)
        stream = self.streams[s]
        return stream.read(start, self.n), doc_ids_from_boundaries(self.n, stream.boundaries(start, self.n))

    def sample_parts(self, g: int, docs: bool, mask: bool) -> Tuple[np.ndarray, ...]:
        """(tokens[, doc_ids][, loss mask (bool)]) of sample ``g``, read at one location."""
        s, start = self.locate(g)
        stream = self.streams[s]
        out = (stream.read(start, self.n),)
        if docs:
            out += (doc_ids_from_boundaries(self.n, stream.boundaries(start, self.n)),)
        if mask:
            out += (stream.read_mask(start, self.n),)
        return out

    def batch_numpy(self, start: int, mbs: int, with_docs: bool = False):
        """Samples ``start .. start + mbs - 1`` as ``[mbs, seq_len + 1]`` (and doc ids when asked)."""
        rows = [self.sample_with_docs(start + i) if with_docs else (self.sample(start + i),)
                for i in range(mbs)]
        toks = np.stack([r[0] for r in rows])
        return (toks, np.stack([r[1] for r in rows])) if with_docs else toks


def _cache(cache_dir: Optional[str]) -> str:
    from .cache import cache_dir as resolve_cache_dir

    return resolve_cache_dir(cache_dir)
