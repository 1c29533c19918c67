"""Finding a committed checkpoint: the newest intact one of a directory, a given step, or whatever
a user's path names. Pure Python.

`damaged` maps step directories found damaged by a deeper check (a checksum) to the reason; they
count as damaged here although their sizes are right.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

from ..core import storage
from ..core.errors import ConfigError
from .integrity import inspect_checkpoint
from .layout import (CHECKPOINTS, LATEST, MANIFEST, TMP_SUFFIX, list_step_dirs, parse_step, stale_tmp_entries, step_name)

Damaged = Optional[Mapping[Path, str]]


@dataclass
class Found:
    """An intact committed checkpoint."""

    path: Path
    step: int
    manifest: dict

    @property
    def name(self) -> str:
        return self.path.name


def _inspect(path: Path, damaged: Damaged) -> Tuple[Optional[dict], Optional[str]]:
    if damaged and storage.path(path) in damaged:
        return None, damaged[storage.path(path)]
    return inspect_checkpoint(path)


def find_latest(ckpt_dir: str | os.PathLike, damaged: Damaged = None) -> Tuple[Optional[Found], List[Tuple[Path, str]]]:
    """The highest intact committed checkpoint, and the damaged step directories above it."""
    bad: List[Tuple[Path, str]] = []
    for step, path in reversed(list_step_dirs(ckpt_dir)):
        manifest, problem = _inspect(path, damaged)
        if problem is None:
            return Found(path, step, manifest), bad
        bad.append((path, problem))
    return None, bad


def committed_steps(ckpt_dir: str | os.PathLike) -> List[int]:
    """Steps of the intact committed checkpoints, ascending."""
    return [s for s, p in list_step_dirs(ckpt_dir) if inspect_checkpoint(p)[1] is None]


def steps_text(steps: List[int]) -> str:
    return ", ".join(str(s) for s in steps) if steps else "none"


def resolve_checkpoint(path: str | os.PathLike, *, step: Optional[int] = None,
                       key: str = "checkpoint.load_path", damaged: Damaged = None) -> Found:
    """A committed checkpoint from a step directory, a checkpoints directory or a run directory.

    Without `step`, a checkpoints/run directory gives its newest intact checkpoint. Raises
    ConfigError under `key` when there is none, naming the directory.
    """
    p = storage.path(path).expanduser().absolute()
    if not p.exists():
        raise ConfigError(key, f"{p} does not exist")
    if parse_step(p.name) is not None or (p / MANIFEST).exists() or p.name.endswith(TMP_SUFFIX):
        if p.name.endswith(TMP_SUFFIX):
            raise ConfigError(key, f"{p} is an uncommitted save (.tmp), not a checkpoint")
        manifest, problem = _inspect(p, damaged)
        if problem:
            raise ConfigError(key, f"{p} is damaged ({problem})")
        if step is not None and manifest["step"] != step:
            raise ConfigError("checkpoint.load_step", f"{step} but checkpoint.load_path {p} is step "
                              f"{manifest['step']}", str(manifest["step"]))
        return Found(p, manifest["step"], manifest)
    root = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
    if not list_step_dirs(root) and not stale_tmp_entries(root) and not (root / LATEST).exists():
        raise ConfigError(key, f"{p} is not a checkpoint (no {MANIFEST}, no step_<N> directories)")
    if step is not None:
        return require_step(root, step, key="checkpoint.load_step", damaged=damaged)
    found, bad = find_latest(root, damaged)
    if found is None:
        why = "; ".join(f"{d.name} is damaged ({w})" for d, w in bad) or "no committed checkpoint"
        raise ConfigError(key, f"{root} has no intact checkpoint: {why}")
    return found


def require_step(ckpt_dir: Path, step: int, *, key: str = "checkpoint.load_step", damaged: Damaged = None) -> Found:
    """The committed checkpoint `step` of `ckpt_dir`, or a ConfigError saying what is there."""
    target = storage.path(ckpt_dir) / step_name(step)
    if target.is_dir():
        manifest, problem = _inspect(target, damaged)
        if problem is None:
            return Found(target, step, manifest)
        state = f"{target} exists but is damaged ({problem})"
    elif (storage.path(ckpt_dir) / (step_name(step) + TMP_SUFFIX)).exists():
        state = f"{target} was never committed (only {target.name}{TMP_SUFFIX}, an interrupted save)"
    else:
        state = f"{target} does not exist"
    # Every step directory is checked: only for the message.
    available = [s for s, p in list_step_dirs(ckpt_dir) if _inspect(p, damaged)[1] is None]
    raise ConfigError(key, f"{step}: {state}; committed steps in {ckpt_dir}: {steps_text(available)}",
                      steps_text(available) if available else None)
