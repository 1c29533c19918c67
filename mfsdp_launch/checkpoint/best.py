"""checkpoint.keep_best=val_loss: the `best` pointer to the committed step with the lowest
validation loss, protected from keep_last's rotation, and `mfsdp-export RUN --step best`.
Pure Python.

A step's validation loss goes into its manifest (`val_loss`) when the loop validated at that step;
the manager saves a checkpoint at every validation that beats the best so far, and rank 0, when it
commits one, rewrites `checkpoints/best` (the step directory's name, like `latest`). The pointer is
read back from that manifest, so it never claims a loss the files do not record.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..core import storage
from ..core.errors import ConfigError
from .find import Found, _inspect, resolve_checkpoint
from .layout import CHECKPOINTS, write_atomic

BEST = "best"
VAL_LOSS = "val_loss"  # the manifest's key


def read_best(ckpt_dir: str | os.PathLike) -> Optional[Found]:
    """The intact checkpoint `checkpoints/best` names (with a val_loss in its manifest), or None."""
    ckpt_dir = storage.path(ckpt_dir)
    try:
        name = (ckpt_dir / BEST).read_text().strip()
    except OSError:
        return None
    path = ckpt_dir / name
    if not name or not path.is_dir():
        return None
    manifest, problem = _inspect(path, None)
    if problem is not None or manifest.get(VAL_LOSS) is None:
        return None
    return Found(path, int(manifest["step"]), manifest)


def best_loss(ckpt_dir: str | os.PathLike) -> float:
    """The validation loss of the best checkpoint; inf when there is none."""
    found = read_best(ckpt_dir)
    return float(found.manifest[VAL_LOSS]) if found is not None else float("inf")


def update_best(ckpt_dir: Path, committed: Path, val_loss: Optional[float]) -> bool:
    """After `committed` is in place: point `best` at it when its val_loss beats the best's.
    Returns whether the pointer moved."""
    if val_loss is None or not val_loss < best_loss(ckpt_dir):
        return False
    write_atomic(storage.path(ckpt_dir) / BEST, lambda f: f.write((committed.name + "\n").encode()))
    return True


def resolve_step(path: str | os.PathLike, step: Optional[str], key: str = "--step") -> Found:
    """The checkpoint of a run (or checkpoints, or step) directory at `step`: a number, "best"
    (the `best` pointer), or None (the newest intact)."""
    if step is None:
        return resolve_checkpoint(path, key="CKPT_DIR")
    if str(step) != BEST:
        try:
            number = int(step)
        except ValueError:
            raise ConfigError(key, f"{step!r} is not a step", "a step number, or best") from None
        return resolve_checkpoint(path, step=number, key="CKPT_DIR")
    p = storage.path(path).expanduser().absolute()
    root = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
    found = read_best(root)
    if found is None:
        raise ConfigError(key, f"best: {root} has no best checkpoint (it needs a run with "
                          "checkpoint.keep_best=val_loss that validated)", "a step number")
    return found
