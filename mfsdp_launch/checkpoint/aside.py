"""Keeping what an earlier run wrote: nothing a run trained or logged is deleted to make room for
another run in the same run dir. What would be replaced is moved (renamed, on the same disk)
into ``run.dir/previous/<n>/`` under its own relative path: n = 1, 2, ..., one folder per start.

* A run that starts over in a used run dir (``checkpoint.resume=never checkpoint.overwrite=true``,
  or a fresh start where an earlier run logged rows but saved nothing): every file of
  ``rundir.RUN_OUTPUTS`` there (checkpoints/, metrics.jsonl, config.yaml, logs/, ...).
* A run that continues from an earlier step than the dir's newest (``checkpoint.load_step``):
  the later step directories, with a copy of metrics.jsonl (the rows past the step are dropped).
* A save that replaces a ``step_<N>`` of such a timeline (commit.py): that directory.

Pure Python; the launcher calls `before_start` under the run lock, before it writes anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from ..core import rundir, storage
from .layout import checkpoints_dir, list_step_dirs


def _root(run_dir):
    """`run_dir` as checkpoints_dir spells it (absolute; a RemotePath for an object store)."""
    return checkpoints_dir(run_dir).parent


def aside_dir(run_dir: str | os.PathLike) -> Path:
    """A new, empty ``run_dir/previous/<n>`` (the next free n)."""
    base = _root(run_dir) / rundir.PREVIOUS
    base.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name) for p in base.iterdir() if p.name.isdigit()] if base.is_dir() else []
    n = 1 + max(taken, default=0)
    while True:
        try:
            (base / str(n)).mkdir()
            return base / str(n)
        except FileExistsError:  # another process took it meanwhile
            n += 1


def move_aside(run_dir: str | os.PathLike, paths: Iterable[Path], into: Optional[Path] = None) -> Optional[Path]:
    """Rename each existing path (under `run_dir`) to the same relative path in `into` (default: a
    new previous/<n>); returns that folder, None when none of `paths` exists."""
    root = _root(run_dir)
    present = [storage.path(p) for p in paths if storage.lexists(p)]
    if not present:
        return None
    dest = into or aside_dir(root)
    for p in present:
        target = dest / p.relative_to(root).as_posix()
        target.parent.mkdir(parents=True, exist_ok=True)
        storage.replace(p, target)
    storage.fsync_dir(root)
    return dest


def earlier_run(run_dir: str | os.PathLike) -> bool:
    """Whether `run_dir` holds an earlier run's work: a step directory or a logged metrics row."""
    root = _root(run_dir)
    if list_step_dirs(root / rundir.CHECKPOINTS):
        return True
    try:
        with (root / rundir.METRICS).open("rb") as f:
            for line in f:
                try:
                    if isinstance(json.loads(line), dict):
                        return True
                except ValueError:
                    continue
    except OSError:
        pass
    return False


def before_start(ck, run_dir: str | os.PathLike) -> Optional[str]:
    """Move aside what this run (checkpoint config `ck`) would replace in `run_dir`; the one line
    saying what moved where, or None. Raises the ConfigError that preflight raises."""
    from .manifest import cfg_get
    from .plan import plan_resume

    root = _root(run_dir)
    ckpt_dir = root / rundir.CHECKPOINTS
    plan = plan_resume(ck, ckpt_dir)
    if plan.kind == "resume" and plan.own:  # continuing this dir's own timeline
        later = [p for s, p in list_step_dirs(ckpt_dir) if s > plan.step]
        if not later:
            return None
        dest = move_aside(root, later)
        if (root / rundir.METRICS).is_file():
            storage.copy_file(root / rundir.METRICS, dest / rundir.METRICS)
        return (f"checkpoint.load_step={plan.step}: the later {', '.join(p.name for p in later)} moved to "
                f"{dest / rundir.CHECKPOINTS} (and a copy of {rundir.METRICS}); nothing is deleted")
    if not earlier_run(root):
        return None
    steps = [p.name for _, p in list_step_dirs(ckpt_dir)]
    names = [n for n in rundir.RUN_OUTPUTS if storage.lexists(root / n)]
    dest = move_aside(root, [root / n for n in names])
    what = ", ".join(f"{n}/ ({', '.join(steps)})" if n == rundir.CHECKPOINTS and steps else n for n in names)
    why = "checkpoint.overwrite=true" if cfg_get(ck, "overwrite", False) else "starting over in a used run.dir"
    return f"{why}: the earlier run's {what} moved to {dest}; nothing is deleted"
