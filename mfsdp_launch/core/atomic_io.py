"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, whole.

Standard library only, so the launcher's CLI path can use it without importing torch or numpy.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, Optional


def atomic_write(final, write_fn: Callable, tmp: Optional[str] = None, mode: Optional[int] = None,
                 sync_dir: bool = False) -> None:
    """`write_fn(binary file)` into `tmp`, fsync, rename to `final`; `tmp` is removed on failure.

    The default `tmp` is unique per process: ranks or nodes sharing a directory may write the
    same file at once. `mode` is set before the rename, so the file never appears without it.
    `sync_dir` also fsyncs the directory, so the rename itself survives a power loss.
    """
    final = str(final)
    tmp = tmp or _unique_tmp(final)
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        _finish(tmp, final, mode, sync_dir)
    except BaseException:
        _discard(tmp)
        raise


def atomic_write_path(final, write_fn: Callable[[str], None], mode: Optional[int] = None) -> None:
    """`write_fn(path)` for writers that only take a path (and may replace that file, as
    safetensors does): the file is reopened and fsynced by name, given `mode` (default: what
    `open` gives under the umask), renamed to `final`, and the directory is fsynced."""
    final = str(final)
    tmp = _unique_tmp(final)
    try:
        write_fn(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the file now at `tmp`: a writer that replaced it made a new inode
        finally:
            os.close(fd)
        _finish(tmp, final, default_file_mode() if mode is None else mode, sync_dir=True)
    except BaseException:
        _discard(tmp)
        raise


def atomic_write_text(path: Path, text: str, mode: Optional[int] = None) -> None:
    atomic_write(path, lambda f: f.write(text.encode()), mode=mode)


def swap_text(path, text: str) -> None:
    """Replace `path` with `text` through a rename, without fsync: a reader sees the old file or
    the new one, whole; cheap enough for files rewritten every second (progress, a metrics tail)
    that need not survive a power loss."""
    path = str(path)
    tmp = _unique_tmp(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


def default_file_mode() -> int:
    """The mode `open()` gives a new file here: 0o666 less the umask (0o644 under umask 022)."""
    mask = os.umask(0o022)  # reading the umask means setting it; put it back at once
    os.umask(mask)
    return 0o666 & ~mask


def fsync_dir(path) -> None:
    """Persist a directory's entries (a rename in it); best effort where a filesystem can't."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unique_tmp(final: str) -> str:
    return f"{final}.tmp.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def _finish(tmp: str, final: str, mode: Optional[int], sync_dir: bool) -> None:
    if mode is not None:
        os.chmod(tmp, mode)
    os.replace(tmp, final)
    if sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(final)))


def _discard(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass
