"""Megatron's indexed dataset (MMIDIDX): tokens in ``PREFIX.bin``, one index ``PREFIX.idx``.

``mfsdp-data prepare`` writes its shards in this format, so Megatron-LM reads them too, and
the same reader opens the ``.bin``/``.idx`` pairs users already have. The index is::

    b"MMIDIDX\\x00\\x00"  <Q version=1  <B dtype code  <Q n_sequences  <Q n_doc_indices
    int32[n_sequences]  sequence lengths (tokens)
    int64[n_sequences]  sequence pointers (byte offsets into .bin)
    int64[n_doc_indices] document indices (sequence numbers; 0 first, n_sequences last)

Like Megatron's GPTDataset we treat every sequence as one document. Everything is memmapped:
opening a shard reads 34 bytes, whatever its size.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import BinaryIO, Optional

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER_LEN = len(HEADER) + 8 + 1 + 8 + 8
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class FormatError(ValueError):
    """A file that is not what its name or header says (the caller turns it into a ConfigError)."""


def read_header(idx_path: str):
    """(dtype, n_sequences, n_doc_indices) of an ``.idx`` file; FormatError when it is not one."""
    with open(idx_path, "rb") as f:
        raw = f.read(_HEADER_LEN)
    if len(raw) < _HEADER_LEN or raw[: len(HEADER)] != HEADER:
        raise FormatError(f"{idx_path} is not a Megatron index (no MMIDIDX header)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[len(HEADER):])
    if version != VERSION:
        raise FormatError(f"{idx_path} has index version {version}, expected {VERSION}")
    if code not in DTYPE_CODES or code in (6, 7):
        raise FormatError(f"{idx_path} has dtype code {code}, not an integer token type")
    return np.dtype(DTYPE_CODES[code]), int(n_seq), int(n_doc)


def write_index(f: BinaryIO, dtype, lengths: np.ndarray) -> None:
    """Write the ``.idx`` of contiguous sequences of ``lengths`` tokens (one document each)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    doc_idx = np.arange(len(lengths) + 1, dtype=np.int64)
    f.write(HEADER + struct.pack("<QBQQ", VERSION, _CODE_OF[dtype], len(lengths), len(doc_idx)))
    f.write(lengths.tobytes())
    f.write(pointers.tobytes())
    f.write(doc_idx.tobytes())


class DocStarts:
    """Document start offsets in tokens, over a memmapped array scaled by ``scale`` (bytes -> tokens).

    Megatron stores byte pointers; dividing them would copy the whole array, so lookups scale
    the query instead.
    """

    def __init__(self, arr: np.ndarray, scale: int = 1):
        self.arr = arr
        self.scale = int(scale)

    def __len__(self) -> int:
        return len(self.arr)

    def __getitem__(self, i):
        return self.arr[i] // self.scale

    def searchsorted(self, t: int, side: str = "right") -> int:
        return int(np.searchsorted(self.arr, int(t) * self.scale, side=side))


def _memmap(path: str, dtype, offset: int = 0, count: Optional[int] = None) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=None if count is None else (count,))


def map_tokens(path: str, dtype, offset: int, count: int) -> np.ndarray:
    """A read-only memmap of ``count`` tokens for random access.

    MADV_RANDOM turns off the kernel's read-ahead: samples are a few KB at random places, and
    read-ahead would pull (and map into this process) hundreds of KB around each one.
    """
    if count == 0:
        return np.zeros(0, dtype=dtype)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)


class Shard:
    """One token file and its document starts, memmapped on first use.

    ``n_tokens``/``n_docs`` are known without opening (from a manifest or a header), so a corpus
    of thousands of shards opens in milliseconds. Pickles without its maps (DataLoader workers).
    """

    kind = "shard"

    def __init__(self, path: str, n_tokens: int, n_docs: int, dtype):
        self.path = path
        self.n_tokens = int(n_tokens)
        self.n_docs = int(n_docs)
        self.dtype = np.dtype(dtype)
        self._tokens = None
        self._docs = None
        # A loss-mask stream beside the tokens (uint8, 1 = a target token; chat data from
        # `mfsdp-data prepare --chat`), or None: every token is a target.
        self.mask_path: Optional[str] = None
        self._mask = None

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None, "_docs": None, "_mask": None}

    @property
    def loss_mask(self) -> Optional[np.ndarray]:
        """The uint8 loss mask of every token (memmapped), or None when the shard has none."""
        if self.mask_path is None:
            return None
        if self._mask is None:
            self._mask = map_tokens(self.mask_path, np.uint8, 0, self.n_tokens)
        return self._mask

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens, self._docs = self._open()
        return self._tokens

    @property
    def doc_starts(self) -> DocStarts:
        if self._docs is None:
            self._tokens, self._docs = self._open()
        return self._docs

    def _open(self):  # pragma: no cover - subclasses
        raise NotImplementedError


class MegatronShard(Shard):
    """``PREFIX.bin`` + ``PREFIX.idx``. Sequences must be contiguous (as Megatron writes them)."""

    kind = "megatron"

    def __init__(self, prefix: str, n_tokens: Optional[int] = None, n_docs: Optional[int] = None,
                 dtype=None):
        if None not in (n_tokens, n_docs, dtype):  # from a manifest whose file sizes were checked
            super().__init__(prefix, n_tokens, n_docs, dtype)
            return
        dtype, n_seq, _ = read_header(prefix + ".idx")
        size = os.path.getsize(prefix + ".bin")
        super().__init__(prefix, size // dtype.itemsize if n_tokens is None else n_tokens,
                         n_seq if n_docs is None else n_docs, dtype)
        if self.n_docs != n_seq:
            raise FormatError(f"{prefix}.idx has {n_seq} sequences, expected {self.n_docs}")
        if size != self.n_tokens * dtype.itemsize:
            raise FormatError(f"{prefix}.bin has {size} bytes, expected {self.n_tokens * dtype.itemsize}")
        self._index()  # checks the layout now: a bad file fails the launcher's check, not a rank

    def _index(self):
        """(lengths, pointers) memmaps; refuses sequences that do not tile the .bin exactly."""
        idx, n, size = self.path + ".idx", self.n_docs, self.n_tokens * self.dtype.itemsize
        lengths = _memmap(idx, np.int32, _HEADER_LEN, n)
        pointers = _memmap(idx, np.int64, _HEADER_LEN + 4 * n, n)
        if n and (pointers[0] != 0 or int(pointers[-1]) + int(lengths[-1]) * self.dtype.itemsize != size):
            raise FormatError(f"{self.path}: sequences are not contiguous in .bin (pointers do not "
                              f"add up to its size)")
        return lengths, pointers

    def _open(self):
        _, pointers = self._index()
        tokens = map_tokens(self.path + ".bin", self.dtype, 0, self.n_tokens)
        return tokens, DocStarts(pointers if self.n_docs else np.zeros(1, np.int64), self.dtype.itemsize)
