"""A prepared corpus directory: Megatron-format shards plus ``manifest.json``.

::

    DIR/manifest.json          format, version, tokenizer (sha256, vocab), eos_id, dtype,
                               token/document counts, one entry per shard with file checksums
    DIR/shard_000000.bin/.idx  tokens and index (see indexed.py); every document ends with EOS
    DIR/shard_000000.mask      chat data only (``prepare --chat``): one uint8 per token, 1 where
                               the token is a training target (the manifest's ``loss_mask``)

Checksums are xxh64 when ``xxhash`` is installed, else crc32 (zlib); the value carries its
algorithm (``"xxh64:..."``), so a directory checks out on any machine that has that algorithm.

Each file also records a *sampled* checksum: of SAMPLE_BLOCKS blocks of SAMPLE_BLOCK bytes at
fixed offsets (the first at 0, the last ending at the end of the file, the others evenly
between; a file of at most SAMPLE_BLOCKS blocks is hashed whole). The launcher checks sizes and
sampled checksums before spawning (`check_sampled`: a few KiB read per file, whatever the corpus
size); ``mfsdp-data verify DIR`` checks every byte (`verify`).
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core.atomic_io import atomic_write
from .indexed import MegatronShard, write_index

MANIFEST = "manifest.json"
FORMAT = "mfsdp-tokens"
FORMAT_VERSION = 1
READ_BLOCK = 1 << 22
SAMPLE_BLOCK = 1 << 12  # bytes per sampled block
SAMPLE_BLOCKS = 4


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def checksum_algo() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh64"


class Hasher:
    """Streaming checksum; ``str(h)`` is ``"<algo>:<hex>"``. The one place the algorithm is chosen."""

    def __init__(self, algo: str = ""):
        self.algo = algo or checksum_algo()
        if self.algo == "xxh64":
            import xxhash

            self._h = xxhash.xxh64()
        elif self.algo == "crc32":
            self._h = _Crc32()
        else:
            raise ValueError(f"unknown checksum algorithm {self.algo!r} (xxhash not installed?)")

    def update(self, data) -> "Hasher":
        self._h.update(data)
        return self

    def __str__(self) -> str:
        return f"{self.algo}:{self._h.hexdigest()}"


def file_checksum(path: str, algo: str = "") -> str:
    h = Hasher(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(READ_BLOCK), b""):
            h.update(block)
    return str(h)


def shard_name(i: int) -> str:
    return f"shard_{i:06d}"


def sample_offsets(size: int, block: int = SAMPLE_BLOCK, count: int = SAMPLE_BLOCKS) -> List[Tuple[int, int]]:
    """The (offset, length) blocks the sampled checksum of a `size`-byte file reads."""
    if size <= block * count:
        return [(0, size)]
    last = size - block
    return [(round(i * last / (count - 1)), block) for i in range(count)]


def sampled_checksum(path: str, algo: str = "", block: int = SAMPLE_BLOCK, count: int = SAMPLE_BLOCKS) -> str:
    """The checksum of the file's sampled blocks (sample_offsets), ``"<algo>:<hex>"``."""
    h = Hasher(algo)
    with open(path, "rb") as f:
        for offset, length in sample_offsets(os.fstat(f.fileno()).st_size, block, count):
            f.seek(offset)
            h.update(f.read(length))
    return str(h)


def file_entry(path: str, checksum: str) -> Dict[str, Any]:
    """A file's manifest entry: size, checksum and the sampled checksum (same algorithm)."""
    algo = checksum.partition(":")[0]
    return {"bytes": os.path.getsize(path), "checksum": checksum,
            "sample": {"block": SAMPLE_BLOCK, "blocks": SAMPLE_BLOCKS, "checksum": sampled_checksum(path, algo)}}


def check_file(path: str, entry: Dict[str, Any], full: bool = True) -> str:
    """'' when ``path`` matches its manifest entry, else what is wrong (size always, checksum if full)."""
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        return f"{path} has {size} bytes, manifest says {entry['bytes']}"
    if full:
        algo = str(entry["checksum"]).partition(":")[0]
        try:
            got = file_checksum(path, algo)
        except ValueError as e:
            return f"{path}: {e}"
        if got != entry["checksum"]:
            return f"{path} checksum {got} != manifest {entry['checksum']}"
    return ""


def check_sampled(path: str, entry: Dict[str, Any]) -> str:
    """'' when ``path`` has its manifest size and sampled checksum (when the manifest has one:
    corpora prepared before it have sizes only), else what is wrong, naming the file."""
    problem = check_file(path, entry, full=False)
    sample = entry.get("sample")
    if problem or not isinstance(sample, dict):
        return problem
    want = str(sample.get("checksum"))
    try:
        got = sampled_checksum(path, want.partition(":")[0], int(sample["block"]), int(sample["blocks"]))
    except (KeyError, TypeError, ValueError) as e:
        return f"{path}: unreadable sampled checksum in the manifest ({e})"
    if got != want:
        return f"{path} is damaged: its sampled checksum {got} differs from the manifest's {want}"
    return ""


def check_prepared(directory: str) -> str:
    """The first file of a prepared directory failing `check_sampled`, as one line ('' if none)."""
    m = read_manifest(directory)
    for s in m["shards"]:
        problem = _mask_size_problem(directory, s)
        for ext in shard_files(s):
            problem = problem or check_sampled(os.path.join(directory, f"{s['name']}.{ext}"), s["files"][ext])
        if problem:
            return problem
    return ""


def shard_files(entry: Dict[str, Any]) -> List[str]:
    """The file extensions of a shard's manifest entry: bin, idx, and mask for chat data."""
    return [ext for ext in ("bin", "idx", "mask") if ext in entry["files"]]


def _mask_size_problem(directory: str, entry: Dict[str, Any]) -> str:
    """'' unless the manifest's loss mask of a shard does not hold one byte per token."""
    mask = entry["files"].get("mask")
    if mask is None or int(mask["bytes"]) == int(entry["n_tokens"]):
        return ""
    return (f"{os.path.join(directory, entry['name'])}.mask holds {mask['bytes']} mask bytes for "
            f"{entry['n_tokens']} tokens: the loss mask does not match its tokens")


def read_manifest(directory: str) -> Dict[str, Any]:
    """The manifest of a prepared directory; ValueError (one line) when absent or not ours."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "r", encoding="utf-8") as f:
            m = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{directory} has no {MANIFEST} (not a prepared corpus)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path} is not an {FORMAT} manifest")
    if m.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format version {m.get('version')}, this reader knows {FORMAT_VERSION}")
    return m


def manifest_bytes(manifest: Dict[str, Any]) -> bytes:
    """Canonical serialisation (sorted keys): the same corpus gives the same bytes."""
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def build_manifest(entries: Sequence[Dict[str, Any]], meta: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest of shard ``entries`` (empty shards dropped) with ``meta`` (tokenizer, eos_id, dtype, ...)."""
    keys = ("name", "n_tokens", "n_documents", "files", "n_targets")
    kept = [{k: e[k] for k in keys if k in e} for e in entries if e.get("files")]
    skipped: Dict[str, int] = {}
    for e in entries:
        for k, v in e.get("skipped", {}).items():
            skipped[k] = skipped.get(k, 0) + v
    out = {"format": FORMAT, "version": FORMAT_VERSION, "index_format": "megatron-mmidx", **meta,
           "n_tokens": sum(s["n_tokens"] for s in kept), "n_documents": sum(s["n_documents"] for s in kept),
           "skipped": skipped, "shards": kept}
    if any("n_targets" in s for s in kept):  # chat data: the tokens its loss mask trains on
        out["n_targets"] = sum(int(s.get("n_targets", 0)) for s in kept)
    return out


def write_manifest(directory: str, manifest: Dict[str, Any]) -> None:
    payload = manifest_bytes(manifest)
    atomic_write(os.path.join(directory, MANIFEST), lambda f: f.write(payload))


def write_shard(directory: str, index: int, tokens: np.ndarray, lengths: Sequence[int],
                algo: str = "", mask: Optional[np.ndarray] = None) -> Dict[str, Any]:
    """Write in-memory ``tokens`` (documents of ``lengths``; ``mask``: their loss mask, one per
    token) as shard ``index``; its manifest entry.

    For token sets made without a tokenizer (benchmarks, tests); ``prepare`` streams instead.
    """
    name = shard_name(index)
    prefix = os.path.join(directory, name)
    atomic_write(prefix + ".bin", lambda f: f.write(memoryview(np.ascontiguousarray(tokens))))
    atomic_write(prefix + ".idx", lambda f: write_index(f, tokens.dtype, np.asarray(lengths)))
    exts = ("bin", "idx")
    extra: Dict[str, Any] = {}
    if mask is not None:
        mask = np.ascontiguousarray(mask, dtype=np.uint8)
        if len(mask) != len(tokens):
            raise ValueError(f"a loss mask of {len(mask)} entries for {len(tokens)} tokens")
        atomic_write(prefix + ".mask", lambda f: f.write(memoryview(mask)))
        exts += ("mask",)
        extra["n_targets"] = int(np.count_nonzero(mask))
    files = {ext: file_entry(f"{prefix}.{ext}", file_checksum(f"{prefix}.{ext}", algo)) for ext in exts}
    return {"index": index, "name": name, "n_tokens": int(len(tokens)), "n_documents": len(lengths), "files": files,
            **extra}


def open_prepared(directory: str) -> tuple:
    """(manifest, [MegatronShard]) of a prepared directory; shards open lazily."""
    m = read_manifest(directory)
    shards = []
    for s in m["shards"]:
        prefix = os.path.join(directory, s["name"])
        problem = _mask_size_problem(directory, s)
        for ext in shard_files(s):
            problem = problem or check_file(f"{prefix}.{ext}", s["files"][ext], full=False)
        if problem:
            raise ValueError(problem)
        shard = MegatronShard(prefix, s["n_tokens"], s["n_documents"], m["dtype"])
        if "mask" in s["files"]:
            shard.mask_path = prefix + ".mask"
        shards.append(shard)
    return m, shards


def verify(directory: str) -> List[str]:
    """Every problem found by checking each shard file's size and checksum against the manifest."""
    m = read_manifest(directory)
    problems = []
    for s in m["shards"]:
        problems += [p for p in [_mask_size_problem(directory, s)] if p]
        for ext in shard_files(s):
            p = check_file(os.path.join(directory, f"{s['name']}.{ext}"), s["files"][ext])
            if p:
                problems.append(p)
    return problems
