"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, whole.

Standard library only, so the launcher's CLI path can use it without importing torch or numpy.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, Optional


def atomic_write(final, write_fn: Callable, tmp: Optional[str] = None, mode: Optional[int] = None) -> None:
    """`write_fn(binary file)` into `tmp`, fsync, rename to `final`; `tmp` is removed on failure.

    The default `tmp` is unique per process: ranks or nodes sharing a directory may write the
    same file at once. `mode` is set before the rename, so the file never appears without it.
    """
    final = str(final)
    tmp = tmp or f"{final}.tmp.{os.getpid()}.{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(path: Path, text: str, mode: Optional[int] = None) -> None:
    atomic_write(path, lambda f: f.write(text.encode()), mode=mode)
