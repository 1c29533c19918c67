"""`mfsdp-report RUN_DIR [RUN_DIR ...] [--out DIR]`: plots and a short summary of runs.

Reads each run's metrics.jsonl and draws loss, tokens/s/GPU, MFU and peak memory over steps,
all runs overlaid (a sweep dir expands to its job dirs). Writes report.png (the four panels),
one PNG per metric, and summary.txt (also printed). matplotlib is the optional `report` extra.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from ..core import rundir
from ..core.console import eprint
from ..launcher.runstate import read_metrics
from ..launcher.sweep_summary import (ALREADY_FINISHED, job_dirs_in, job_overrides, read_json, unescape_job_name, varying_overrides)

PANELS = (
    ("loss", "loss", "loss"),
    ("tokens_per_s_per_gpu", "tokens/s/GPU", "throughput"),
    ("mfu", "MFU (%)", "mfu"),
    ("peak_mem_gib", "peak memory (GiB)", "memory"),
)
NO_MFU = "n/a (no device peak)"


class ReportError(Exception):
    pass


def expand_runs(paths: List[str]) -> List[Path]:
    """Run dirs (holding metrics.jsonl); a sweep dir stands for the job dirs inside it."""
    runs: List[Path] = []
    for p in paths:
        d = Path(p).expanduser().resolve()
        if not d.is_dir():
            raise ReportError(f"{p}: not a directory")
        if (d / rundir.METRICS).is_file():
            runs.append(d)
            continue
        # job_dirs_in also finds the runs of a plain folder (no job_status.json, just metrics).
        jobs = [j for j in job_dirs_in(d) if (j / rundir.METRICS).is_file()]
        if not jobs:
            raise ReportError(f"{p}: no {rundir.METRICS} here or in its subdirectories (is it a run or sweep dir?)")
        runs.extend(jobs)
    return list(dict.fromkeys(runs))


def labels_for(runs: List[Path]) -> List[str]:
    """Short, distinct names: what differs between the runs' overrides (a sweep's swept values),
    else the path below their common parent."""
    if len(runs) == 1:
        return [runs[0].name]
    rows = [{"overrides": job_overrides(r, read_json(r / rundir.JOB_STATUS) or {})} for r in runs]
    _common, per_run = varying_overrides(rows)
    labels = [" ".join(o) for o in per_run]
    if all(labels) and len(set(labels)) == len(labels):
        return labels
    try:
        common = Path(os.path.commonpath([str(r) for r in runs]))
    except ValueError:
        return [str(r) for r in runs]
    return [unescape_job_name(str(r.relative_to(common)) if r != common else r.name) for r in runs]


def _series(rows: List[dict], key: str) -> Tuple[List[int], List[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)):
            xs.append(r["step"])
            ys.append(100 * v if key == "mfu" else v)
    return xs, ys


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _draw(ax, runs_rows, labels, key: str, ylabel: str, legend: bool) -> None:
    drawn = 0
    for rows, label in zip(runs_rows, labels):
        xs, ys = _series(rows, key)
        if xs:
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=label)
            drawn += 1
        vx, vy = _series(rows, "val_loss") if key == "loss" else ([], [])
        if vx:  # validation rows (train.val_interval): dashed, in the run's colour
            ax.plot(vx, vy, marker="s", markersize=4, linewidth=1.4, linestyle="--", label=f"{label} val",
                    color=ax.lines[-1].get_color() if xs else None)
            drawn += 1
    from matplotlib.ticker import MaxNLocator

    ax.set_title(ylabel)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if not drawn:
        text = NO_MFU if key == "mfu" else "no data"
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=13, color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])
    elif legend and (len(labels) > 1 or drawn > len(labels)):  # several runs, or train and val lines
        ax.legend(fontsize=7, loc="best")


def plot(runs_rows: List[List[dict]], labels: List[str], out: Path, plt) -> List[Path]:
    """The four panels in report.png, then one PNG each; one line per run."""
    written = []
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for ax, (key, ylabel, _) in zip(axes.flat, PANELS):
        _draw(ax, runs_rows, labels, key, ylabel, legend=False)
    handles, names = [], []
    for ax in axes.flat:
        h, n = ax.get_legend_handles_labels()
        if h:
            handles, names = h, n
            break
    if len(runs_rows) > 1 and handles:
        rows = (len(names) + 2) // 3
        fig.tight_layout(rect=(0, 0.03 * rows, 1, 0.97))
        fig.legend(handles, names, loc="lower center", ncol=min(3, len(names)), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, 0.0))
    else:
        fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.suptitle(f"mfsdp-report: {len(runs_rows)} run(s)", fontsize=10)
    target = out / rundir.REPORT_PNG
    fig.savefig(target, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(target)
    for key, ylabel, stem in PANELS:
        fig, ax = plt.subplots(figsize=(8, 5))
        _draw(ax, runs_rows, labels, key, ylabel, legend=True)
        fig.tight_layout()
        target = out / f"{stem}.png"
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    return written


def _num(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def summary_text(runs: List[Path], runs_rows: List[List[dict]], labels: List[str]) -> str:
    lines = []
    for run, rows, label in zip(runs, runs_rows, labels):
        status = _status(read_json(run / rundir.JOB_STATUS) or {})
        if not rows:
            lines.append(f"{label}: no metrics")
            continue
        last = rows[-1]
        # A diverged run's nan/inf rows are not its best loss (min() over nan is meaningless).
        losses = [(r["loss"], r["step"]) for r in rows
                  if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
        best = min(losses) if losses else None
        # The first logged interval includes start-up (compile, allocator warm-up): leave it out.
        steady = rows[1:] if len(rows) > 1 else rows
        tps = _num([r["tokens_per_s_per_gpu"] for r in steady if isinstance(r.get("tokens_per_s_per_gpu"), (int, float))])
        mfu = _num([r["mfu"] for r in steady if isinstance(r.get("mfu"), (int, float))])
        mem = max((r["peak_mem_gib"] for r in rows if isinstance(r.get("peak_mem_gib"), (int, float))), default=None)
        parts = [f"step {last['step']}"]
        if status:
            parts.append(status)
        if isinstance(last.get("loss"), (int, float)):
            parts.append(f"final loss {last['loss']:.4f}")
        if best is not None:
            parts.append(f"best {best[0]:.4f} @ {best[1]}")
        vals = [r for r in rows if isinstance(r.get("val_loss"), (int, float))]
        if vals:
            parts.append(f"val loss {vals[-1]['val_loss']:.4f} @ {vals[-1]['step']}")
        parts.append(f"tokens/s/GPU {tps:,.0f}" if tps is not None else "tokens/s/GPU n/a")
        parts.append(f"MFU {100 * mfu:.1f}%" if mfu is not None else f"MFU {NO_MFU}")
        parts.append(f"peak mem {mem:.2f} GiB" if mem is not None else "peak mem n/a")
        lines.append(f"{label}: " + ", ".join(parts))
    header = f"mfsdp-report: {len(runs)} run(s)"
    if len(runs) > 1:
        header += f" under {os.path.commonpath([str(r) for r in runs])}"
    return header + "\n" + "\n".join("  " + line for line in lines) + "\n"


def _status(job_status: dict) -> Optional[str]:
    status = job_status.get("status")
    if status == "skipped" or (status == "done" and job_status.get("already_finished")):
        return f"done ({ALREADY_FINISHED})"
    return status


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mfsdp-report",
        description="Plot loss, tokens/s/GPU, MFU and memory of runs (or a whole sweep dir) over steps, "
                    "overlaid, and summarize them.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run dirs or sweep dirs")
    parser.add_argument("--out", default=None,
                        help="where to write the PNGs and summary.txt (default: FIRST_RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        runs = expand_runs(args.runs)
    except ReportError as exc:
        eprint(f"mfsdp-report: error: {exc}")
        return 2
    plt = _import_pyplot()
    if plt is None:
        eprint("mfsdp-report: error: matplotlib is not installed (pip install 'mfsdp-launch[report]')")
        return 2
    out = Path(args.out).expanduser() if args.out else Path(args.runs[0]).expanduser() / "report"
    out.mkdir(parents=True, exist_ok=True)
    runs_rows = [read_metrics(r) for r in runs]
    labels = labels_for(runs)
    written = plot(runs_rows, labels, out, plt)
    text = summary_text(runs, runs_rows, labels)
    (out / rundir.REPORT_SUMMARY).write_text(text)
    print(text, end="")
    print(f"mfsdp-report: wrote {', '.join(p.name for p in written)} and summary.txt to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
