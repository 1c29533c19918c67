"""Is a step directory intact? Two depths of one answer.

* `inspect_checkpoint` (cheap, every listing): the manifest is readable and every file it lists is
  there with its recorded size.
* `verify_checksums` (reads every byte, before a resume or an export): each file's xxh3-64 matches
  the manifest. Manifests written before checksums existed have none: they get the size check only.

Checksums are stored per file as `"checksum": "xxh3_64:<16 hex digits>"`, so another algorithm can
follow without a format change. Pure Python (xxhash, no torch).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ..core import storage
from .layout import DCP_METADATA, MANIFEST, parse_step

CHECKSUM = "xxh3_64"
_CHUNK = 4 << 20
THREADS = 4  # file reads release the GIL: a few threads keep a disk (or a network FS) busy


def file_checksum(path: str | os.PathLike) -> Tuple[int, str]:
    """(bytes read, "xxh3_64:hexdigest") of one file, streamed in 4 MiB chunks."""
    import xxhash

    h = xxhash.xxh3_64()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    p = storage.path(path)
    with (open(p, "rb", buffering=0) if isinstance(p, Path) else p.open("rb")) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, f"{CHECKSUM}:{h.hexdigest()}"


def checksum_files(root: Path, rels: Iterable[str], threads: int = THREADS) -> Dict[str, Tuple[int, str]]:
    """{relative path: (bytes, checksum)} for the files `rels` under `root`, hashed in parallel."""
    rels = list(rels)
    if len(rels) <= 1 or threads <= 1:
        return {r: file_checksum(root / r) for r in rels}
    with ThreadPoolExecutor(max_workers=min(threads, len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda r: file_checksum(root / r), rels)))


def inspect_checkpoint(step_dir: str | os.PathLike) -> Tuple[Optional[dict], Optional[str]]:
    """(manifest, None) for a committed checkpoint whose files all have their recorded sizes,
    else (None, what is wrong)."""
    step_dir = storage.path(step_dir)
    mpath = step_dir / MANIFEST
    if not mpath.is_file():
        return None, f"missing {MANIFEST}"
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"unreadable {MANIFEST} ({type(exc).__name__})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("step"), int) \
            or not isinstance(manifest.get("files"), list):
        return None, f"{MANIFEST} lacks step/files"
    dir_step = parse_step(step_dir.name)
    if dir_step is not None and manifest["step"] != dir_step:
        return None, f"{MANIFEST} says step {manifest['step']}"
    names = set()
    sizes = dict(storage.walk_files(step_dir))  # one listing (on an object store, one request)
    for entry in manifest["files"]:
        try:
            rel, size = str(entry["path"]), int(entry["bytes"])
        except (KeyError, TypeError, ValueError):
            return None, f"{MANIFEST} has a malformed file entry"
        names.add(rel)
        actual = sizes.get(rel)
        if actual is None:
            return None, f"missing {rel}"
        if actual != size:
            return None, f"{rel} has {actual} bytes, the manifest says {size}"
    if DCP_METADATA not in names:
        return None, f"{MANIFEST} lists no DCP {DCP_METADATA}"
    return manifest, None


def has_checksums(manifest: dict) -> bool:
    return any(isinstance(e, dict) and e.get("checksum") for e in manifest.get("files", []))


def share(manifest: dict, index: int, count: int) -> List[str]:
    """The files (with a checksum) that verifier `index` of `count` reads: the largest first, each
    to the verifier with the fewest bytes so far, so every rank reads about the same amount."""
    load = [0] * max(1, count)
    mine = []
    entries = [e for e in manifest.get("files", []) if isinstance(e, dict) and e.get("checksum")]
    for e in sorted(entries, key=lambda e: (-int(e["bytes"]), str(e["path"]))):
        who = min(range(len(load)), key=lambda i: (load[i], i))
        load[who] += int(e["bytes"])
        if who == index:
            mine.append(str(e["path"]))
    return mine


def verify_checksums(step_dir: str | os.PathLike, manifest: dict, files: Optional[Iterable[str]] = None,
                     threads: int = THREADS) -> Optional[str]:
    """None when every file (of `files`, default all) matches its checksum, else what is wrong.

    Raises OSError when a file cannot be read: an unreadable disk is not a damaged checkpoint.
    """
    step_dir = storage.path(step_dir)
    expected = {str(e["path"]): str(e["checksum"]) for e in manifest.get("files", [])
                if isinstance(e, dict) and e.get("checksum")}
    rels = sorted(expected) if files is None else [r for r in files if r in expected]
    known = [r for r in rels if expected[r].startswith(CHECKSUM + ":")]  # others: a newer format
    for r in known:
        if not (step_dir / r).is_file():
            return f"missing {r}"
    got = checksum_files(step_dir, known, threads)
    for r in known:  # in path order: the same report whichever thread finished first
        if got[r][1] != expected[r]:
            return f"checksum mismatch in {r}"
    return None
