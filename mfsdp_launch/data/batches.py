"""Micro-batches of one rank, addressed by global sample index (layout.py), for every dataset.

``synthetic``
    Sample ``g`` is ``seq_len + 1`` tokens drawn uniformly from ``[0, vocab_size)`` by
    ``numpy.random.default_rng([seed, g])``. There are no documents and no validation split.
``text``
    The cached corpus of text.py, read like a one-source ``tokens`` config.
``tokens``
    ``data.sources`` mixed by weight (corpus/dataset.py); validation reads ``data.val_sources``
    or the held-out tail (``data.val_fraction``) of each source.

In every case ``input_ids = window[:-1]`` and ``labels = window[1:]``; with ``data.doc_mask``
the batch also holds ``doc_ids`` (the document number of each input token) and ``cu_seqlens``
(the boundaries of its documents in the flattened batch), which the model turns into attention
per document. A corpus with a loss mask (chat data, ``mfsdp-data prepare
--chat``) sets ``labels`` to -100 where the predicted token is not a target
(``masked_labels``; the loop then weighs micro-batches per token, rank/token_weights.py).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ..core.errors import ConfigError
from .layout import microbatch_start, sample_rng
from .text import build_token_cache, cfg_get, describe_path

SPLITS = ("train", "val")


def open_dataset(data_cfg: Any, *, seq_len: int, seed: int, split: str = "train",
                 model_vocab: Optional[int] = None):
    """The corpus TokenDataset of a text or tokens config for ``split`` (builds the text cache)."""
    from ..corpus import TokenDataset

    name = str(cfg_get(data_cfg, "name"))
    f = float(cfg_get(data_cfg, "val_fraction", 0.0) or 0.0)
    kw = dict(seq_len=seq_len, seed=seed, pack=str(cfg_get(data_cfg, "pack", "windows")),
              cache_dir=cfg_get(data_cfg, "cache_dir"), model_vocab=model_vocab)
    if name == "text":
        path, manifest = build_token_cache(data_cfg)
        if int(manifest["n_tokens"]) < seq_len + 1:
            raise ConfigError("data.path", f"corpus {describe_path(data_cfg)} has {manifest['n_tokens']} tokens "
                              f"(data.max_bytes={cfg_get(data_cfg, 'max_bytes')}), fewer than "
                              f"train.seq_len + 1 = {seq_len + 1}")
        return TokenDataset([path], split=split, val_fraction=f, key="data.path", **kw)
    eos_id = cfg_get(data_cfg, "eos_id")
    val_sources = list(cfg_get(data_cfg, "val_sources") or [])
    if split == "val" and val_sources:
        return TokenDataset(val_sources, split="all", eos_id=eos_id, key="data.val_sources", **kw)
    return TokenDataset(list(cfg_get(data_cfg, "sources")), split=split, val_fraction=f, eos_id=eos_id, **kw)


class TokenBatches:
    """Micro-batches ``{"input_ids", "labels"[, "doc_ids"]}`` (LongTensor ``[mbs, seq_len]``, CPU).

    ``batch(g)`` returns global samples ``g .. g + mbs - 1`` of ``split``; use
    :func:`microbatch_start` (or :meth:`microbatch`) for ``g``. ``vocab_size`` is the model's.
    """

    def __init__(self, data_cfg: Any, *, seq_len: int, micro_batch_size: int, vocab_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, split: str = "train"):
        if seq_len < 1:
            raise ConfigError("train.seq_len", f"must be >= 1, got {seq_len}")
        if micro_batch_size < 1:
            raise ConfigError("train.micro_batch_size", f"must be >= 1, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        from .check import check_data_config, has_validation

        check_data_config(data_cfg, vocab_size=vocab_size)
        self.name = str(cfg_get(data_cfg, "name", "synthetic"))
        if split == "val" and not has_validation(data_cfg):
            raise ConfigError("data.val_fraction", f"data={self.name} holds out no validation data",
                              "> 0, or data.val_sources")
        self.seq_len, self.micro_batch_size = int(seq_len), int(micro_batch_size)
        self.model_vocab_size, self.seed = int(vocab_size), int(seed)
        self.dp_rank, self.dp_size, self.split = int(dp_rank), int(dp_size), split
        self.doc_mask = bool(cfg_get(data_cfg, "doc_mask", False))
        self.dataset = None
        self.vocab_size = self.model_vocab_size
        self.path: Optional[str] = None  # text: the cache directory, and its manifest
        self.meta: Optional[Dict[str, Any]] = None
        if self.name == "text":
            self.path, self.meta = build_token_cache(data_cfg)
        if self.name != "synthetic":
            self.dataset = open_dataset(data_cfg, seq_len=self.seq_len, seed=self.seed, split=split,
                                        model_vocab=self.model_vocab_size)
            self.vocab_size = int(self.dataset.vocab_size or self.model_vocab_size)

    @property
    def n_tokens(self) -> int:
        return 0 if self.dataset is None else sum(s.n_tokens for s in self.dataset.streams)

    def sample(self, g: int) -> np.ndarray:
        """Global sample ``g`` as ``seq_len + 1`` int64 tokens (inputs are [:-1], labels [1:])."""
        if g < 0:
            raise ValueError(f"sample index must be >= 0, got {g}")
        if self.dataset is None:
            return sample_rng(self.seed, g).integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int64)
        return self.dataset.sample(g)

    def batch_numpy(self, global_sample_start: int, with_docs: bool = False):
        """``[mbs, seq_len + 1]`` tokens (and their document numbers when ``with_docs``)."""
        start, mbs = int(global_sample_start), self.micro_batch_size
        if self.dataset is None:
            toks = np.stack([self.sample(start + i) for i in range(mbs)])
            return (toks, np.zeros_like(toks, dtype=np.int32)) if with_docs else toks
        out = self.dataset.batch_numpy(start, mbs, with_docs=with_docs)
        self._check_vocab(out[0] if with_docs else out, start)
        return out

    def _check_vocab(self, toks: np.ndarray, start: int) -> None:
        top = int(toks.max())
        if top >= self.model_vocab_size:  # formats without a recorded vocab are caught here
            raise ValueError(f"model.vocab_size: {self.model_vocab_size}, but samples {start}.."
                             f"{start + self.micro_batch_size - 1} of the {self.split} data hold token id {top}")

    @property
    def masked_labels(self) -> bool:
        """Whether labels can be -100: the data carries a loss mask."""
        return self.dataset is not None and self.dataset.has_loss_mask

    def batch(self, global_sample_start: int) -> Dict[str, Any]:
        import torch

        if not self.masked_labels:
            if not self.doc_mask:
                w = torch.from_numpy(self.batch_numpy(global_sample_start))
                return {"input_ids": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous()}
            toks, docs = self.batch_numpy(global_sample_start, with_docs=True)
            w = torch.from_numpy(toks)
            return {"input_ids": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous(),
                    **_documents(docs[:, :-1])}
        return masked_batch(self.dataset, int(global_sample_start), self.micro_batch_size, self.doc_mask,
                            check=self._check_vocab)

    def microbatch(self, step: int, micro: int, *, grad_accum_steps: int, **base) -> Dict[str, Any]:
        """This rank's batch for optimizer step ``step``, micro-batch ``micro``."""
        return self.batch(microbatch_start(step, micro, micro_batch_size=self.micro_batch_size,
                                           grad_accum_steps=grad_accum_steps, dp_rank=self.dp_rank,
                                           dp_size=self.dp_size, **base))


def masked_batch(dataset, start: int, mbs: int, doc_mask: bool, check=None) -> Dict[str, Any]:
    """Samples ``start .. start + mbs - 1`` of a loss-masked corpus TokenDataset as a batch whose
    labels are -100 where the mask says the predicted token is no target (training and mfsdp-eval
    read masked data through this one rule). `check(tokens, start)`: a vocabulary check."""
    import torch

    from ..models.losses import IGNORE_INDEX

    rows = [dataset.sample_parts(start + i, docs=doc_mask, mask=True) for i in range(mbs)]
    toks = np.stack([r[0] for r in rows])
    if check is not None:
        check(toks, start)
    mask = np.stack([r[-1] for r in rows])
    labels = np.where(mask[:, 1:], toks[:, 1:], IGNORE_INDEX)  # the mask is of the predicted token
    out = {"input_ids": torch.from_numpy(np.ascontiguousarray(toks[:, :-1])), "labels": torch.from_numpy(labels)}
    if doc_mask:
        out.update(_documents(np.stack([r[1] for r in rows])[:, :-1]))
    return out


def _documents(doc_ids: np.ndarray) -> Dict[str, Any]:
    """{"doc_ids", "cu_seqlens"} of a batch's input tokens: the segment boundaries are computed here,
    on the host, because on the device their count would cost a sync every forward."""
    import torch

    from ..corpus.doc_mask import cu_seqlens

    ids = torch.from_numpy(np.ascontiguousarray(doc_ids))
    return {"doc_ids": ids, "cu_seqlens": cu_seqlens(ids)}
