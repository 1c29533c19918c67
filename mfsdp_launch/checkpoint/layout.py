"""Where checkpoints live: step directories, saves in progress (`.tmp`), the `latest` pointer and
pruning. Pure Python (no torch)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from ..core import storage
from ..core.rundir import CHECKPOINTS

LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER = "trainer.json"
SCHEDULER_FILE = "scheduler.pt"
DCP_METADATA = ".metadata"
FORMAT = "mfsdp-launch-checkpoint/1"
TMP_SUFFIX = ".tmp"

_STEP_RE = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{int(step)}"


def parse_step(name: str) -> Optional[int]:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def rank_file(rank: int) -> str:
    """Rank r's own file in a step directory (its RNG states)."""
    return f"extra_rank{int(rank)}.pt"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    """run.dir/checkpoints: a Path, or a storage.RemotePath for an object-store run.dir."""
    return storage.path(run_dir).expanduser().absolute() / CHECKPOINTS


def list_step_dirs(ckpt_dir: str | os.PathLike) -> List[Tuple[int, Path]]:
    """(step, path) of every `step_<N>` directory (committed or damaged, never `.tmp`), by step."""
    ckpt_dir = storage.path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        step = parse_step(p.name)
        if step is not None and p.is_dir():
            out.append((step, p))
    return sorted(out)


def list_files(root: Path) -> List[dict]:
    """{"path", "bytes"} of every file under `root` but the manifest, by path."""
    return [{"path": rel, "bytes": size} for rel, size in storage.walk_files(root) if rel != MANIFEST]


def read_latest_pointer(ckpt_dir: str | os.PathLike) -> Optional[str]:
    try:
        return (storage.path(ckpt_dir) / LATEST).read_text().strip() or None
    except OSError:
        return None


def stale_tmp_entries(ckpt_dir: str | os.PathLike) -> List[Path]:
    """Leftovers of crashed saves/commits: every `*.tmp` entry (never a committed directory)."""
    ckpt_dir = storage.path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.name.endswith(TMP_SUFFIX))


def clean_stale(run_dir: str | os.PathLike) -> List[Path]:
    """Remove the leftovers of crashed or failed saves in `run_dir/checkpoints`; returns them.

    The launcher calls it (as the run dir's owner) before it writes anything, so a rerun on a
    full disk first frees the space a killed save left behind. Committed steps are never touched.
    """
    removed = stale_tmp_entries(checkpoints_dir(run_dir))
    for p in removed:
        if p.is_dir() and not p.is_symlink():
            storage.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return removed


def write_atomic(path: Path, write) -> None:
    """`write(file)` into `<path>.tmp`, fsync, rename to `path`, fsync the directory."""
    # The fixed `.tmp` name: a crash's leftover is one that clean_stale removes.
    storage.atomic_write(path, write, tmp=str(path) + TMP_SUFFIX, sync_dir=True)


def prune_plan(entries: Iterable[Tuple[int, Path, bool]], keep_last: int,
               protect: Iterable[Path] = ()) -> List[Path]:
    """Which step directories to delete: all below the `keep_last` newest intact ones.

    `entries` are (step, path, intact). The newest intact one is always kept (keep_last >= 1);
    `protect` (the checkpoint this run resumed from) is never deleted. Damaged directories newer
    than the oldest kept one stay, for inspection.
    """
    entries = sorted(entries, key=lambda e: e[0], reverse=True)
    protect = {storage.path(p) for p in protect}
    kept, cutoff = 0, None
    for step, _path, intact in entries:
        if intact:
            kept += 1
            if kept >= max(1, keep_last):
                cutoff = step
                break
    if cutoff is None:
        return []
    return [storage.path(p) for s, p, _ in entries if s < cutoff and storage.path(p) not in protect]
