"""``prepare``'s inputs: which files, cut into which work items, read as which documents.

Kinds by extension: ``.jsonl``/``.ndjson`` (one JSON object per line, text in ``field``),
``.parquet`` (one row per document, text in column ``field``; needs pyarrow), anything else is
plain text (one file = one document). A directory is searched recursively for those
extensions (hidden directories and ``__pycache__`` skipped); a glob may match files and
directories. Files are sorted by path.

The plan cuts the inputs into work items of about ``shard_bytes`` each (one item = one output
shard): JSON-lines files at line boundaries, Parquet files at row groups, text files whole.
The cut depends only on the files and ``shard_bytes``, so the output does not depend on how
many workers run or in which order they finish.
"""

from __future__ import annotations

import glob as _glob
import json
import os
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

from ..core.errors import ConfigError

JSONL_EXT = (".jsonl", ".ndjson")
PARQUET_EXT = (".parquet",)
TEXT_EXT = (".txt", ".md", ".rst", ".py")
SEARCH_EXT = JSONL_EXT + PARQUET_EXT + TEXT_EXT
TEXT_PIECE = 1 << 20  # a long text document is tokenized in ~1 MB line-aligned pieces


@dataclass(frozen=True)
class Piece:
    path: str
    kind: str  # text | jsonl | parquet
    a: int  # bytes (text, jsonl) or row groups (parquet), [a, b)
    b: int
    weight: int  # bytes of input, for progress


def kind_of(path: str) -> str:
    low = path.lower()
    if low.endswith(JSONL_EXT):
        return "jsonl"
    if low.endswith(PARQUET_EXT):
        return "parquet"
    return "text"


def _walk(root: str) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        out += [os.path.join(dirpath, f) for f in filenames if f.lower().endswith(SEARCH_EXT)]
    return out


def expand(specs: Sequence[str]) -> List[str]:
    """Sorted absolute paths of the input files named by files, directories and globs."""
    found = set()
    for spec in specs:
        p = os.path.expanduser(spec)
        matches = [p] if os.path.exists(p) else sorted(_glob.glob(p, recursive=True))
        if not matches:
            raise ConfigError("INPUT", f"{spec!r} does not exist", "files, directories or globs")
        before = len(found)
        for m in matches:
            found.update(os.path.abspath(f) for f in (_walk(m) if os.path.isdir(m) else [m]))
        if len(found) == before and os.path.isdir(p):
            raise ConfigError("INPUT", f"directory {spec!r} has no input files",
                              ", ".join("*" + e for e in SEARCH_EXT))
    files = sorted(found)
    for f in files:
        check_readable(f)
    return files


def check_readable(path: str) -> None:
    """One line, before any work, for an input that cannot be read: a dangling symbolic link,
    something that is not a regular file (a FIFO would block), no permission, an I/O error."""
    if os.path.islink(path) and not os.path.exists(path):
        raise ConfigError("INPUT", f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist")
    if not os.path.isfile(path):
        raise ConfigError("INPUT", f"{path} is not a regular file", "files, directories or globs")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError("INPUT", f"cannot read {path}: {exc.strerror or exc}") from None


def _jsonl_cuts(path: str, size: int, shard_bytes: int) -> List[int]:
    """Byte offsets of line starts near every multiple of ``shard_bytes`` (0 and size included)."""
    cuts = [0]
    with open(path, "rb") as f:
        for target in range(shard_bytes, size, shard_bytes):
            if target <= cuts[-1]:
                continue
            f.seek(target - 1)
            f.readline()  # to the end of the line holding byte target - 1
            if f.tell() < size:
                cuts.append(f.tell())
    return cuts + [size]


def _parquet_pieces(path: str, field: str) -> List[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("INPUT", f"{path} is Parquet, which needs pyarrow (pip install pyarrow)") from None
    meta = pq.ParquetFile(path).metadata
    names = meta.schema.names
    if field not in names:
        raise ConfigError("--field", f"{field!r} is not a column of {path}", names)
    return [Piece(path, "parquet", i, i + 1, max(1, meta.row_group(i).total_byte_size))
            for i in range(meta.num_row_groups)]


def pieces_of(path: str, field: str, shard_bytes: int) -> List[Piece]:
    kind, size = kind_of(path), os.path.getsize(path)
    if kind == "parquet":
        return _parquet_pieces(path, field)
    if kind == "jsonl":
        cuts = _jsonl_cuts(path, size, shard_bytes)
        return [Piece(path, kind, a, b, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]
    return [Piece(path, kind, 0, size, size)] if size else []


def plan(files: Sequence[str], field: str, shard_bytes: int) -> List[List[Piece]]:
    """Consecutive pieces grouped into work items of about ``shard_bytes`` of input each."""
    items: List[List[Piece]] = []
    cur: List[Piece] = []
    weight = 0
    for f in files:
        for piece in pieces_of(f, field, shard_bytes):
            if cur and weight + piece.weight > shard_bytes:
                items.append(cur)
                cur, weight = [], 0
            cur.append(piece)
            weight += piece.weight
    if cur:
        items.append(cur)
    return items


# ------------------------------------------------------------------------------- reading
# Each reader yields (text, ends_document, input bytes consumed) and counts skipped records.


def _read_text(p: Piece, skipped: dict) -> Iterator[Tuple[str, bool, int]]:
    carry = b""
    with open(p.path, "rb") as f:
        while True:
            block = f.read(TEXT_PIECE)
            if not block:
                yield carry.decode("utf-8", errors="replace"), True, len(carry)
                return
            data = carry + block
            cut = data.rfind(b"\n") + 1  # after a newline: never inside a UTF-8 character
            carry = data[cut:]
            if cut:
                yield data[:cut].decode("utf-8", errors="replace"), False, cut


def _count(skipped: dict, what: str) -> str:
    skipped[what] = skipped.get(what, 0) + 1
    return ""


def _jsonl_lines(p: Piece) -> Iterator[bytes]:
    """The lines of a JSON-lines piece, newline included (their lengths are its input bytes)."""
    with open(p.path, "rb") as f:
        f.seek(p.a)
        pos = p.a
        while pos < p.b:
            line = f.readline()
            pos += len(line)
            yield line


def _read_jsonl(p: Piece, field: str, skipped: dict) -> Iterator[Tuple[str, bool, int]]:
    for line in _jsonl_lines(p):
        if not line.strip():
            yield "", True, len(line)
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            yield _count(skipped, "bad_json"), True, len(line)
            continue
        text = obj.get(field) if isinstance(obj, dict) else None
        yield (text if isinstance(text, str) else _count(skipped, "no_field")), True, len(line)


def _read_parquet(p: Piece, field: str, skipped: dict) -> Iterator[Tuple[str, bool, int]]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(p.path).read_row_groups(list(range(p.a, p.b)), columns=[field])
    texts = table.column(field).to_pylist()
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            text = _count(skipped, "no_field")
        yield text, True, p.weight if i == len(texts) - 1 else 0


def read_rows(p: Piece, skipped: dict) -> Iterator[Tuple[object, int]]:
    """(parsed JSON value, input bytes) of each non-blank line of a JSON-lines piece (``--chat``);
    a line that is not JSON comes as None (the caller counts it)."""
    for line in _jsonl_lines(p):
        if not line.strip():
            continue
        try:
            yield json.loads(line), len(line)
        except ValueError:
            yield None, len(line)


def read(p: Piece, field: str, skipped: dict) -> Iterator[Tuple[str, bool, int]]:
    if p.kind == "text":
        return _read_text(p, skipped)
    if p.kind == "jsonl":
        return _read_jsonl(p, field, skipped)
    return _read_parquet(p, field, skipped)
