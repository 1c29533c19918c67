"""Flat token files as users already have them: nanoGPT's headerless uint16 ``.bin`` and the
llm.c / modded-nanogpt ``.bin`` with a 256 x int32 header (magic 20240520).

Neither records document boundaries. Without an EOS id a flat file is one long document; with
one, a document ends after each EOS token, found by one chunked scan and cached as an int64
``.npy`` of start offsets (memmapped afterwards, so memory does not grow with the corpus).
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

import numpy as np

from ..core.atomic_io import atomic_write
from .indexed import DocStarts, FormatError, Shard, map_tokens

LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
LLMC_DTYPES = {1: np.uint16, 2: np.uint32}  # header[1]: 1 = GPT-2 (uint16), 2 = LLaMA-3 (uint32)
SCAN_CHUNK = 1 << 26  # tokens per step of the EOS scan


def flat_layout(path: str):
    """(dtype, header bytes, n_tokens) of a flat ``.bin``: llm.c header if present, else raw uint16."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(12).ljust(12, b"\0"), dtype="<i4")
    if head[0] == LLMC_MAGIC and size >= LLMC_HEADER_BYTES:
        if int(head[1]) not in LLMC_DTYPES:
            raise FormatError(f"{path}: llm.c header version {int(head[1])} (expected 1 or 2)")
        dtype = np.dtype(LLMC_DTYPES[int(head[1])])
        n = int(head[2])
        if LLMC_HEADER_BYTES + n * dtype.itemsize > size:
            raise FormatError(f"{path}: header says {n} tokens but the file is {size} bytes")
        return dtype, LLMC_HEADER_BYTES, n
    if size % 2:
        raise FormatError(f"{path}: {size} bytes is not a whole number of uint16 tokens")
    return np.dtype(np.uint16), 0, size // 2


def _doc_index_path(path: str, eos_id: int, cache_dir: str) -> str:
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{eos_id}".encode()
    return os.path.join(cache_dir, f"docs-{hashlib.sha256(key).hexdigest()[:24]}.npy")


def _scan_eos(tokens: np.ndarray, eos_id: int):
    """Document starts (0, then the position after each EOS but the last token), chunk by chunk."""
    yield np.zeros(1, np.int64)
    n = len(tokens)
    for a in range(0, n, SCAN_CHUNK):
        hit = np.flatnonzero(tokens[a : a + SCAN_CHUNK] == eos_id).astype(np.int64) + (a + 1)
        yield hit[hit < n]


def build_doc_index(tokens: np.ndarray, eos_id: int, out: str) -> None:
    """Write the document starts of ``tokens`` as an int64 ``.npy`` (atomic: ranks may race)."""
    parts = list(_scan_eos(tokens, eos_id))  # one int64 per document, written then memmapped
    count = sum(len(p) for p in parts)

    def write(f):
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<i8", "fortran_order": False, "shape": (count,)})
        for p in parts:
            f.write(p.tobytes())

    os.makedirs(os.path.dirname(out), exist_ok=True)
    atomic_write(out, write)


class FlatShard(Shard):
    """A nanoGPT / llm.c flat ``.bin``; documents split after ``eos_id`` when given."""

    kind = "flat"

    def __init__(self, path: str, eos_id: Optional[int] = None, cache_dir: Optional[str] = None):
        dtype, self.offset, n = flat_layout(path)
        super().__init__(path, n, 1, dtype)
        self.eos_id = eos_id
        self.cache_dir = cache_dir
        if eos_id is not None:
            self.n_docs = len(self._doc_index())

    def _raw_tokens(self) -> np.ndarray:
        return map_tokens(self.path, self.dtype, self.offset, self.n_tokens)

    def _doc_index(self) -> np.ndarray:
        if self.cache_dir is None:
            raise FormatError(f"{self.path}: splitting at eos_id needs a cache directory for its index")
        out = _doc_index_path(self.path, self.eos_id, self.cache_dir)
        if not os.path.exists(out):
            build_doc_index(self._raw_tokens(), int(self.eos_id), out)
        return np.load(out, mmap_mode="r")

    def _open(self):
        docs = self._doc_index() if self.eos_id is not None else np.zeros(1, np.int64)
        return self._raw_tokens(), DocStarts(docs)
