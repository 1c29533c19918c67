"""A sweep's summary: one row per job (from each job dir's files), written as CSV and Markdown and
printed as a table. Read-only over the job dirs, so it also summarizes jobs that ran elsewhere."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from ..core import rundir
from .runstate import final_checkpoint_step, last_metrics, reached_step

ALREADY_FINISHED = "already finished"


def unescape_job_name(name: str) -> str:
    """Undo `job_dir`'s escapes of '/' and '%'."""
    return name.replace("%2F", "/").replace("%25", "%")



# --- what a run directory holds (also used by mfsdp-report) ------------------------------------


def read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def finished_step(run_dir: Path, train_steps: int) -> Optional[int]:
    """The step a finished job reached, or None if it must (still) run. See the module doc."""
    done = read_json(Path(run_dir) / rundir.JOB_DONE)
    if done is not None and isinstance(done.get("step"), int) and done["step"] >= train_steps:
        return done["step"]
    ckpt = final_checkpoint_step(run_dir)
    if ckpt is not None and ckpt >= train_steps:
        return ckpt
    return None


def job_dirs_in(sweep_dir: Path) -> List[Path]:
    """The job directories directly under a sweep dir: those with a job_status.json or metrics."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    found = [d for d in sweep_dir.iterdir()
             if d.is_dir() and ((d / rundir.JOB_STATUS).is_file() or (d / rundir.METRICS).is_file())]

    def key(d: Path):
        num = (read_json(d / rundir.JOB_STATUS) or {}).get("job_num")
        return (num if isinstance(num, int) else 1 << 30, d.name)

    return sorted(found, key=key)


# --- the summary -------------------------------------------------------------------------------

COLUMNS = ("job", "overrides", "status", "exit_code", "step", "final_loss", "tokens_per_s_per_gpu",
           "mfu", "mfu_at_precision", "peak_mem_gib", "run_dir")


def job_row(jdir: Path) -> dict:
    jdir = Path(jdir)
    st = read_json(jdir / rundir.JOB_STATUS) or {}
    last = last_metrics(jdir) or {}
    status = st.get("status") or ("unknown" if last else "not_run")
    steps = st.get("train_steps")
    step = reached_step(jdir, last) if jdir.is_dir() else None
    if status in ("running", "submitted", "written", "unknown") and steps and step is not None and step >= steps:
        status = "done"  # finished after this record was written (a plugin or SLURM ran it)
    already = status == "skipped" or (status == "done" and st.get("already_finished"))
    return {
        "job": st.get("job_num"),
        "overrides": job_overrides(jdir, st),
        "status": "done" if already else status,
        "label": f"done ({ALREADY_FINISHED})" if already else status,
        "exit_code": st.get("exit_code"),
        "step": step,
        "train_steps": steps,
        "final_loss": last.get("loss"),
        "tokens_per_s_per_gpu": last.get("tokens_per_s_per_gpu"),
        "mfu": last.get("mfu"),  # against the dense bf16 peak
        "mfu_at_precision": last.get("mfu_at_precision"),  # against the FP8-weighted peak (core/mfu.py)
        "peak_mem_gib": last.get("peak_mem_gib"),
        "error": st.get("error"),
        "run_dir": str(jdir),
    }


def job_overrides(jdir: Path, status: dict) -> List[str]:
    """A job's overrides: those its status file records, else those its run dir was frozen
    with, else those its directory name spells."""
    if status.get("overrides") is not None:
        return list(status["overrides"])
    try:
        from omegaconf import OmegaConf


        return [str(o) for o in OmegaConf.load(str(jdir / rundir.OVERRIDES))]
    except Exception:
        return [unescape_job_name(p) for p in jdir.name.split(",")]


def _split_override(o: str):
    key, _, value = o.partition("=")
    return key.lstrip("+~"), value


def varying_overrides(rows: List[dict]) -> tuple[List[str], List[List[str]]]:
    """(overrides common to every row, per-row overrides that differ between rows)."""
    if len(rows) < 2:
        return [], [r["overrides"] for r in rows]
    maps = [dict(_split_override(o) for o in r["overrides"]) for r in rows]
    keys = set().union(*maps)
    common_keys = {k for k in keys if all(m.get(k, None) == maps[0].get(k, None) for m in maps)}
    common = [o for o in rows[0]["overrides"] if _split_override(o)[0] in common_keys]
    per_row = [[o for o in r["overrides"] if _split_override(o)[0] not in common_keys] for r in rows]
    return common, per_row


def _fmt(key: str, value) -> str:
    if value is None:
        return "n/a" if key == "mfu" else "-"
    if key == "final_loss":
        return f"{value:.4f}"
    if key == "tokens_per_s_per_gpu":
        return f"{value:,.0f}"
    if key == "mfu":
        return f"{100 * value:.1f}%"
    if key == "peak_mem_gib":
        return f"{value:.2f}"
    return str(value)


def _mfu_cell(r: dict) -> str:
    """MFU against the bf16 peak, and against the FP8-weighted peak where that differs (FP8 GEMMs)."""
    cell, at = _fmt("mfu", r.get("mfu")), r.get("mfu_at_precision")
    return cell if at is None or at == r.get("mfu") else f"{cell} ({100 * at:.1f}% at precision)"


DISPLAY = (("overrides", "overrides"), ("status", "status"), ("step", "step"), ("final_loss", "final loss"),
           ("tokens_per_s_per_gpu", "tokens/s/GPU"), ("mfu", "MFU"), ("peak_mem_gib", "peak mem GiB"))


def _display_rows(rows: List[dict]) -> tuple[List[str], List[List[str]]]:
    common, per_row = varying_overrides(rows)
    table = []
    for r, ovr in zip(rows, per_row):
        step = "-" if r["step"] is None else (f"{r['step']}/{r['train_steps']}" if r["train_steps"] else str(r["step"]))
        cells = {"overrides": " ".join(ovr) or "(none)", "step": step, "status": r.get("label", r["status"]),
                 "mfu": _mfu_cell(r)}
        table.append([cells.get(k, _fmt(k, r.get(k))) for k, _ in DISPLAY])
    return common, table


def summarize(job_dirs: Iterable[Path], sweep_dir: Path) -> List[dict]:
    """Rows for these job dirs; printed as a table and written to sweep_summary.csv/.md."""
    rows = [job_row(Path(d)) for d in job_dirs]
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_csv(rows, sweep_dir / rundir.SWEEP_SUMMARY)
    common, table = _display_rows(rows)
    (sweep_dir / rundir.SWEEP_SUMMARY_MD).write_text(to_markdown(rows, common, table, sweep_dir))
    print_table(rows, common, table, sweep_dir)
    return rows


def write_csv(rows: List[dict], path: Path) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow(["" if r.get(c) is None else (" ".join(r[c]) if c == "overrides" else r[c])
                         for c in COLUMNS])
    path.write_text(buf.getvalue())


def to_markdown(rows: List[dict], common: List[str], table: List[List[str]], sweep_dir: Path) -> str:
    lines = [f"# Sweep summary: {sweep_dir}", ""]
    if common:
        lines += ["Common overrides: `" + " ".join(common) + "`", ""]
    lines.append("| " + " | ".join(h for _, h in DISPLAY) + " |")
    lines.append("|" + "|".join("---" if k in ("overrides", "status") else "---:" for k, _ in DISPLAY) + "|")
    for cells in table:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", _counts(rows), ""]
    return "\n".join(lines)


def _counts(rows: List[dict]) -> str:
    counts: Dict[str, int] = {}
    for r in rows:
        label = r.get("label", r["status"])
        counts[label] = counts.get(label, 0) + 1
    return f"{len(rows)} job(s): " + ", ".join(f"{n} {s}" for s, n in counts.items())


def print_table(rows: List[dict], common: List[str], table: List[List[str]], sweep_dir: Path) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    t = Table(title=f"sweep summary ({sweep_dir})", box=box.SIMPLE_HEAD)
    for key, header in DISPLAY:
        t.add_column(header, justify="left" if key in ("overrides", "status") else "right")
    styles = {"done": "green", "skipped": "cyan", "failed": "red", "invalid": "red", "stopped": "yellow"}
    for r, cells in zip(rows, table):
        t.add_row(*cells, style=styles.get(r["status"]))
    console.print(t)
    if common:
        console.print("common overrides: " + " ".join(common), markup=False)
    for r in rows:
        if r["status"] in ("failed", "invalid") and r.get("error"):
            console.print(f"{r['status']}: {' '.join(r['overrides'])}: {r['error']}", markup=False,
                          style="red")
    console.print(_counts(rows) + f"; summary in {sweep_dir / rundir.SWEEP_SUMMARY} and {rundir.SWEEP_SUMMARY_MD}", markup=False)
