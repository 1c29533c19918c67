"""The ``prepare`` worker: tokenize one work item into one shard (runs in a pool process); with
``--chat``, render each conversation and write its loss mask beside the tokens.

Each worker loads the tokenizer once and runs it single-threaded (``--workers`` is the
parallelism). Text is encoded in batches of about ``BATCH_BYTES`` and written as it goes, so a
worker holds one batch, not a shard. Files are written under temporary names and renamed when
complete; the parent records the shard only after that, so a crash leaves nothing half-valid.
"""

from __future__ import annotations

import json
import os
import signal
from itertools import chain
from typing import Any, Dict, List, Optional

import numpy as np

from ..core.atomic_io import atomic_write
from . import inputs
from .indexed import write_index
from .shards import Hasher, file_checksum, file_entry, shard_name

BATCH_BYTES = 1 << 20

_tok = None
_queue = None


def init_worker(tokenizer_path: str, queue) -> None:
    """Pool initializer: one tokenizer per process; Ctrl-C is the parent's to handle."""
    global _tok, _queue
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # processes, not threads, are the parallelism
    from tokenizers import Tokenizer

    _tok = Tokenizer.from_file(tokenizer_path)
    _queue = queue


class _ShardBuilder:
    """Accumulates documents' token ids into the open .bin; remembers document lengths."""

    def __init__(self, f, dtype, eos_id: int, algo: str):
        self.f, self.dtype, self.eos_id = f, np.dtype(dtype), eos_id
        self.hasher = Hasher(algo)
        self.lengths: List[int] = []
        self.current = 0  # tokens of the open document
        self.batch: List[tuple] = []
        self.batch_bytes = 0

    def add(self, text: str, ends: bool, nbytes: int) -> None:
        self._push((text, ends), nbytes)

    def _push(self, item: tuple, nbytes: int) -> None:
        """Queue one row for the next batch encode, flushing once the batch holds BATCH_BYTES."""
        self.batch.append(item)
        self.batch_bytes += nbytes
        if self.batch_bytes >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.batch:
            return
        texts = [t for t, _ in self.batch]
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we do not use
        encode = getattr(_tok, "encode_batch_fast", _tok.encode_batch)
        encs = encode(texts, add_special_tokens=False)
        parts = []
        for (_, ends), enc in zip(self.batch, encs):
            ids = enc.ids
            self.current += len(ids)
            parts.append(ids)
            if ends and self.current:  # an empty document leaves no trace, not even an EOS
                parts.append([self.eos_id])
                self.lengths.append(self.current + 1)
                self.current = 0
        arr = np.array(list(chain.from_iterable(parts)), dtype=self.dtype)
        self.f.write(arr.tobytes())
        self.hasher.update(arr.tobytes())
        if _queue is not None:
            _queue.put((self.batch_bytes, int(arr.size)))
        self.batch, self.batch_bytes = [], 0


class _ChatShardBuilder(_ShardBuilder):
    """Conversations (``--chat``): each row rendered with the chat template, tokenized with
    character offsets, its loss mask (corpus/chat.py) written to the open .mask beside the .bin."""

    def __init__(self, f, mask_f, dtype, eos_id: int, algo: str, renderer, field: Optional[str], skipped: dict):
        super().__init__(f, dtype, eos_id, algo)
        self.mask_f, self.mask_hasher = mask_f, Hasher(algo)
        self.renderer, self.field, self.skipped = renderer, field, skipped
        self.n_targets = 0

    def add_row(self, row, nbytes: int) -> None:
        from .chat import RowProblem, conversation

        try:
            text, spans = self.renderer.spans(conversation(row, self.field))
        except RowProblem as p:
            self.skipped[p.kind] = self.skipped.get(p.kind, 0) + 1
            text, spans = "", []
        self._push((text, spans), nbytes)

    def flush(self) -> None:
        from .chat import token_mask

        if not self.batch:
            return
        kept = [(t, s) for t, s in self.batch if t]
        encs = _tok.encode_batch([t for t, _ in kept], add_special_tokens=False) if kept else []
        ids, masks = [], []
        for (_, spans), enc in zip(kept, encs):
            if not enc.ids:
                continue
            mask = token_mask(enc.offsets, spans)
            ids.append(enc.ids)
            masks.append(mask)
            if enc.ids[-1] != self.eos_id:  # the document's end: a boundary, not a turn (targets under "all" only)
                ids.append([self.eos_id])
                masks.append(np.full(1, self.renderer.train_on == "all", dtype=np.uint8))
            self.lengths.append(len(enc.ids) + (enc.ids[-1] != self.eos_id))
        arr = np.array(list(chain.from_iterable(ids)), dtype=self.dtype)
        mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
        self.n_targets += int(mask.sum())
        for f, h, data in ((self.f, self.hasher, arr.tobytes()), (self.mask_f, self.mask_hasher, mask.tobytes())):
            f.write(data)
            h.update(data)
        if _queue is not None:
            _queue.put((self.batch_bytes, int(arr.size)))
        self.batch, self.batch_bytes = [], 0


_renderers: Dict[str, Any] = {}


def _renderer(chat: Dict[str, Any]):
    """One compiled template per process and job settings."""
    key = json.dumps(chat, sort_keys=True)
    if key not in _renderers:
        from .chat import ChatTemplate, Renderer

        template = ChatTemplate(chat["template"], chat["source"], dict(chat["special"]))
        _renderers[key] = Renderer(template, chat["train_on"])
    return _renderers[key]


def write_shard(job: Dict[str, Any]) -> Dict[str, Any]:
    """Tokenize ``job['pieces']`` into ``shard_<index>.bin/.idx`` (and ``.mask`` for chat data);
    return the manifest entry."""
    name = shard_name(job["index"])
    prefix = os.path.join(job["out"], name)
    skipped: Dict[str, int] = {}
    state: Dict[str, Optional[_ShardBuilder]] = {"b": None}
    chat = job.get("chat")

    def write_bin(f):
        b = state["b"] = _ShardBuilder(f, job["dtype"], job["eos_id"], job["algo"])
        for piece in job["pieces"]:
            for text, ends, nbytes in inputs.read(piece, job["field"], skipped):
                b.add(text, ends, nbytes)
        b.flush()

    def write_chat(f):
        def write_mask(mask_f):
            b = state["b"] = _ChatShardBuilder(f, mask_f, job["dtype"], job["eos_id"], job["algo"], _renderer(chat),
                                               chat.get("field"), skipped)
            for piece in job["pieces"]:
                for row, nbytes in inputs.read_rows(piece, skipped):
                    b.add_row(row, nbytes)
            b.flush()

        atomic_write(prefix + ".mask", write_mask)

    atomic_write(prefix + ".bin", write_chat if chat else write_bin)
    b = state["b"]
    entry = {"index": job["index"], "name": name, "n_tokens": int(sum(b.lengths)),
             "n_documents": len(b.lengths), "skipped": skipped}
    if not b.lengths:  # nothing but empty documents: no files, no manifest entry
        for ext in (".bin", ".mask") if chat else (".bin",):
            os.unlink(prefix + ext)
        return entry
    atomic_write(prefix + ".idx", lambda f: write_index(f, job["dtype"], np.asarray(b.lengths)))
    entry["files"] = {"bin": file_entry(prefix + ".bin", str(b.hasher)),
                      "idx": file_entry(prefix + ".idx", file_checksum(prefix + ".idx", job["algo"]))}
    if chat:
        entry["files"]["mask"] = file_entry(prefix + ".mask", str(b.mask_hasher))
        entry["n_targets"] = b.n_targets
    return entry
