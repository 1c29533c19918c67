"""What a run directory says about its run: its metrics rows, its newest committed checkpoint, the
step it reached, how a launch ended (the exit code) and the one-line summary printed at the end.

Used by the launcher, the sweep, mfsdp-report and the sbatch script (`python -m
mfsdp_launch.launcher.runstate CONFIG TORCHRUN_RC [--stop-requested]` prints the summary line and exits with
the launch's exit code). Pure Python: never imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from ..core import exit_codes, rundir


def read_metrics(run_dir: Path) -> List[dict]:
    """The metrics rows of a run dir (a directory, or an object store's URL)."""
    from ..core import storage

    rows = []
    try:
        text = (storage.path(run_dir) / rundir.METRICS).read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def training_rows(rows: List[dict]) -> List[dict]:
    """The rows the training wrote: without the eval/* rows mfsdp-eval appends."""
    return [r for r in rows if not any(k.startswith(rundir.EVAL_PREFIX) for k in r)]


def last_metrics(run_dir: Path) -> Optional[dict]:
    rows = training_rows(read_metrics(run_dir))
    return rows[-1] if rows else None


def newest_checkpoint(run_dir: Path):
    """The newest intact committed checkpoint (checkpoint.Found: the resume point), or None."""
    from ..checkpoint import checkpoints_dir, find_latest

    found, _damaged = find_latest(checkpoints_dir(run_dir))
    return found


def final_checkpoint_step(run_dir: Path) -> Optional[int]:
    found = newest_checkpoint(run_dir)
    return found.step if found is not None else None


def reached_step(run_dir: Path, last_row: Optional[dict] = None) -> Optional[int]:
    """How far a run got: its last logged step or its newest checkpoint, whichever is later.
    `last_row`: its last metrics row, when the caller has read it already ({} for none)."""
    row = last_metrics(run_dir) if last_row is None else last_row
    steps = [s for s in ((row or {}).get("step"), final_checkpoint_step(run_dir)) if s is not None]
    return max(steps) if steps else None


# --- how a launch ended -------------------------------------------------------------------------


@dataclass
class Ending:
    code: int
    step: Optional[int]  # the step the run reached
    checkpoint: Optional[str]  # the newest committed checkpoint's directory name
    loss: Optional[float] = None
    val_loss: Optional[float] = None
    tokens: Optional[int] = None  # tokens trained on, all steps of the run (its last row's tokens_seen)
    epochs: Optional[float] = None  # passes over the training data that makes (the last row's epochs)


def _number(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def rows_of_this_run(rows: List[dict], after: Optional[int], before: Optional[List[dict]] = None) -> List[dict]:
    """The metrics rows a launch wrote: those past `after`, the step it resumed from (None: every
    row), unless they are exactly `before`, the rows past it when it started (its ranks never got
    to drop them: an earlier attempt's)."""
    if after is None:
        return rows
    mine = [r for r in rows if r["step"] > after]
    return [] if before is not None and mine == before else mine


def ending(run_dir: Path, train_steps: int, rc: int, *, stop_requested: bool = False, aborted: bool = False,
           rank_exit_code: Optional[int] = None, after: Optional[int] = None,
           before: Optional[List[dict]] = None) -> Ending:
    """The exit code for a launch whose torchrun exited `rc`, judged by what it left on disk.

    A rank returns 0 both at train.steps and after a graceful stop (which always saves), so a
    clean torchrun exit short of train.steps is an interruption. A stop request whose checkpoint
    was committed at the last logged step is an interruption even when torchrun itself did not
    exit 0 (it was signalled too). `after`, `before`: see rows_of_this_run; the loss and val loss
    shown are this launch's, never another run's.
    """
    rows = training_rows(rows_of_this_run(read_metrics(run_dir), after, before))
    last = rows[-1] if rows else {}
    found = newest_checkpoint(run_dir)
    ck_step = found.step if found is not None else None
    step = max([s for s in (last.get("step"), ck_step) if s is not None], default=None)
    if aborted:
        code = exit_codes.ABORTED
    elif rc == 0:
        code = exit_codes.OK if step is not None and step >= train_steps else exit_codes.INTERRUPTED
    elif rank_exit_code in (exit_codes.CONFIG, exit_codes.DIVERGED):
        code = rank_exit_code
    elif stop_requested and ck_step is not None and ck_step >= (last.get("step") or 0):
        code = exit_codes.INTERRUPTED
    else:
        code = exit_codes.FAILED
    val = next((_number(r.get("val_loss")) for r in reversed(rows) if _number(r.get("val_loss")) is not None),
               None)
    return Ending(code, step, found.name if found is not None else None, _number(last.get("loss")), val,
                  tokens=last.get("tokens_seen"), epochs=_number(last.get("epochs")))


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(round(seconds)), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _count(n: int) -> str:
    """12,345 -> 12.3k; 1.5e9 -> 1.50B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _loss(v: Optional[float]) -> str:
    return "nan" if v is not None and math.isnan(v) else f"{v:.4f}"


def summary_line(end: Ending, train_steps: int, wall_s: float, run_dir: Path, why: Optional[str] = None) -> str:
    """`mfsdp-train: finished step 40/40 in 12.3 s: loss 2.7512, checkpoint step_40; logs in ...`"""
    head = {exit_codes.OK: "finished", exit_codes.INTERRUPTED: "interrupted",
            exit_codes.ABORTED: "aborted", exit_codes.CONFIG: "refused", exit_codes.FAILED: "failed",
            exit_codes.DIVERGED: "diverged"}[end.code]
    step = "no step" if end.step is None else f"step {end.step}/{train_steps}"
    parts = [f"{head} at {step} after {_duration(wall_s)}" if end.code else f"finished {step} in {_duration(wall_s)}"]
    if why:
        parts[0] += f" ({why})"
    details = []
    if end.loss is not None:
        val = f" (val {_loss(end.val_loss)})" if end.val_loss is not None else ""
        details.append(f"loss {_loss(end.loss)}{val}")
    if isinstance(end.tokens, int) and end.tokens > 0:
        epochs = f" ({end.epochs:.3g} epochs of the data)" if end.epochs is not None else ""
        details.append(f"{_count(end.tokens)} tokens{epochs}")
    details.append(f"last checkpoint {end.checkpoint}" if end.checkpoint else "no checkpoint")
    tail = f"; exit code {end.code}"
    if end.code in (exit_codes.INTERRUPTED, exit_codes.ABORTED):
        tail += ", run the same command to " + ("resume" if end.checkpoint else "start again")
    logs = Path(run_dir) / rundir.LOGS
    return f"mfsdp-train: {parts[0]}: {', '.join(details)}{tail}; logs in {logs}"


def main(argv: Optional[List[str]] = None) -> int:
    """For the sbatch script: judge a finished torchrun from the run dir, print the summary line,
    exit with the launch's code."""
    p = argparse.ArgumentParser(prog="python -m mfsdp_launch.launcher.runstate")
    p.add_argument("config", help="the run's frozen config.yaml")
    p.add_argument("rc", type=int, help="torchrun's (srun's) exit code")
    p.add_argument("--stop-requested", action="store_true")
    p.add_argument("--wall-s", type=float, default=0.0)
    args = p.parse_args(argv)
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(args.config)
    run_dir, steps = Path(args.config).resolve().parent, int(cfg.train.steps)
    end = ending(run_dir, steps, args.rc, stop_requested=args.stop_requested)
    print(summary_line(end, steps, args.wall_s, run_dir), flush=True)
    return end.code


if __name__ == "__main__":
    sys.exit(main())
