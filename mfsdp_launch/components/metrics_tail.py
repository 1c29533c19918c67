"""The last rows of metrics.jsonl kept a second time, in `metrics.tail.json` (replaced atomically
at every row), so that a torn last line of metrics.jsonl (a crash or a full disk mid-write, a
file cut by hand) loses no row: on resume the file is cut back to its last complete line and the
rows the tail has past it, up to the resumed step, are written again. Pure Python."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

from ..core import rundir
from ..core.atomic_io import swap_text

KEEP = 8  # rows: more than a checkpoint interval's worth of torn lines never happens


class MetricsTail:
    def __init__(self, run_dir, keep: int = KEEP):
        self.path = Path(run_dir) / rundir.METRICS_TAIL
        self.keep = keep
        self.rows: List[dict] = _read(self.path)

    def add(self, row: dict) -> None:
        # A step written again (after a resume or a rollback) replaces the rows from it on.
        step = row.get("step")
        kept = [r for r in self.rows if not (isinstance(step, int) and isinstance(r.get("step"), int)
                                             and r["step"] >= step)]
        self.rows = (kept + [row])[-self.keep:]
        try:
            swap_text(self.path, json.dumps(self.rows) + "\n")
        except OSError:
            pass  # a second copy: metrics.jsonl itself is the record

    def repair(self, metrics: Path, up_to_step: int) -> List[int]:
        """Cut `metrics` back to its last complete line when its last line is torn, and append the
        tail's rows after the last intact row, up to `up_to_step`. Returns the steps written again."""
        try:
            data = Path(metrics).read_bytes()
        except OSError:
            return []
        body = data[:-1] if data.endswith(b"\n") else data
        if not body or _parses(body.rsplit(b"\n", 1)[-1]):
            if data and not data.endswith(b"\n"):  # only the newline is missing
                Path(metrics).write_bytes(data + b"\n")
            return []
        complete = data[: body.rfind(b"\n") + 1]
        steps = [r.get("step") for r in map(_row, complete.splitlines()) if r is not None]
        last = max((s for s in steps if isinstance(s, int)), default=0)
        again = [r for r in self.rows if isinstance(r.get("step"), int) and last < r["step"] <= up_to_step]
        text = complete + "".join(json.dumps(r) + "\n" for r in again).encode()
        Path(metrics).write_bytes(text)
        return [r["step"] for r in again]


def _row(line: bytes):
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def _parses(line: bytes) -> bool:
    return _row(line) is not None


def _read(path: Path) -> List[dict]:
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
