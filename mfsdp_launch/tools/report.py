"""`mfsdp-report RUN_DIR [RUN_DIR ...] [--out DIR]`: plots and a short summary of runs.

Reads each run's metrics.jsonl and draws loss, tokens/s/GPU, MFU, peak memory, the learning
rate and the gradient norm over steps, all runs overlaid (a sweep dir expands to its job dirs;
MFU is against the bf16 peak, with `mfu_at_precision` dashed where FP8 GEMMs ran, core/mfu.py);
`mfsdp-eval`'s eval/* rows are drawn on the loss panel and named in the summary. Writes
report.png (the six panels), one PNG per metric, and summary.txt (also printed). Labels longer
than LABEL_MAX characters become #1, #2, ... in the plots, with a legend table under them naming
each. matplotlib is the optional `report` extra.
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
from ..launcher.runstate import read_metrics, training_rows
from ..launcher.sweep_summary import (ALREADY_FINISHED, job_dirs_in, job_overrides, read_json, unescape_job_name, varying_overrides)

PANELS = (
    ("loss", "loss", "loss"),
    ("tokens_per_s_per_gpu", "tokens/s/GPU", "throughput"),
    ("mfu", "MFU (%)", "mfu"),
    ("peak_mem_gib", "peak memory (GiB)", "memory"),
    ("lr", "learning rate", "lr"),
    ("grad_norm", "grad norm", "grad_norm"),
)
LABEL_MAX = 28  # longer labels (a sweep point's overrides) are shortened in the plots
NO_MFU = "n/a (no device peak)"
# `mfu` is against the dense bf16 peak; `mfu_at_precision` against the FP8-weighted one (core/mfu.py),
# drawn dashed on the MFU panel and named in the summary where it differs (FP8 GEMMs).
AT_PRECISION = "mfu_at_precision"
MFU_KEYS = ("mfu", AT_PRECISION)


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


def short_labels(labels: List[str]) -> Tuple[List[str], List[Tuple[str, str]]]:
    """The labels drawn in the plots, and the legend table's (short, full) rows: #1, #2, ... when
    any label is longer than LABEL_MAX (no table otherwise)."""
    if all(len(label) <= LABEL_MAX for label in labels):
        return list(labels), []
    short = [f"#{i + 1}" for i in range(len(labels))]
    return short, list(zip(short, labels))


def _legend_table(fig, pairs: List[Tuple[str, str]], height: float) -> None:
    """The table under the plots naming each short label: a bottom strip `height` of the figure."""
    import textwrap

    ax = fig.add_axes((0.04, 0.01, 0.92, height - 0.02))
    ax.axis("off")
    cells = [[s, "\n".join(textwrap.wrap(full, 110)) or full] for s, full in pairs]
    table = ax.table(cellText=cells, colLabels=["run", "label"], colWidths=[0.06, 0.94], cellLoc="left",
                     loc="upper center")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    for (row, _col), cell in table.get_celld().items():
        cell.set_height(cell.get_height() * max(1, cells[row - 1][1].count("\n") + 1) if row else cell.get_height())


def _table_height(pairs: List[Tuple[str, str]]) -> float:
    lines = sum(1 + len(full) // 110 for _, full in pairs) + 1
    return min(0.45, 0.025 * lines + 0.02) if pairs else 0.0


def _series(rows: List[dict], key: str) -> Tuple[List[int], List[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)):
            xs.append(r["step"])
            ys.append(100 * v if key in MFU_KEYS else v)
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
        px, py = _series(rows, AT_PRECISION) if key == "mfu" else ([], [])
        if px and py != _series(rows, "mfu")[1]:
            ax.plot(px, py, marker="o", markersize=3, linewidth=1.4, linestyle="--", label=f"{label} at precision",
                    color=ax.lines[-1].get_color() if xs else None)
            drawn += 1
        ex, ey = _series(rows, rundir.EVAL_LOSS) if key == "loss" else ([], [])
        if ex:  # mfsdp-eval rows (a checkpoint on a token set): diamonds, in the run's colour
            ax.plot(ex, ey, marker="D", markersize=5, linewidth=1.0, linestyle=":", label=f"{label} eval",
                    color=ax.lines[-1].get_color() if xs or vx else None)
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
    """The six panels in report.png, then one PNG each; one line per run."""
    written = []
    labels, pairs = short_labels(labels)
    table_h = _table_height(pairs)
    fig, axes = plt.subplots(3, 2, figsize=(13, 12.5 / (1 - table_h)))
    for ax, (key, ylabel, _) in zip(axes.flat, PANELS):
        _draw(ax, runs_rows, labels, key, ylabel, legend=False)
    handles, names = [], []
    for ax in axes.flat:
        h, n = ax.get_legend_handles_labels()
        if h:
            handles, names = h, n
            break
    if len(runs_rows) > 1 and handles:
        rows = (len(names) + 5) // 6
        fig.tight_layout(rect=(0, table_h + 0.02 * rows, 1, 0.97))
        fig.legend(handles, names, loc="lower center", ncol=min(6, len(names)), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, table_h))
    else:
        fig.tight_layout(rect=(0, table_h, 1, 0.97))
    if pairs:
        _legend_table(fig, pairs, table_h)
    fig.suptitle(f"mfsdp-report: {len(runs_rows)} run(s)", fontsize=10)
    target = out / rundir.REPORT_PNG
    fig.savefig(target, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(target)
    for key, ylabel, stem in PANELS:
        fig, ax = plt.subplots(figsize=(8, 5 / (1 - table_h)))
        _draw(ax, runs_rows, labels, key, ylabel, legend=True)
        fig.tight_layout(rect=(0, table_h, 1, 1))
        if pairs:
            _legend_table(fig, pairs, table_h)
        target = out / f"{stem}.png"
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    return written


def _num(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def summary_text(runs: List[Path], runs_rows: List[List[dict]], labels: List[str]) -> str:
    lines = []
    _, pairs = short_labels(labels)
    if pairs:  # the plots name the runs #1, #2, ...
        labels = [f"{s} {full}" for s, full in pairs]
    for run, rows, label in zip(runs, runs_rows, labels):
        status = _status(read_json(run / rundir.JOB_STATUS) or {})
        evals = [r for r in rows if isinstance(r.get(rundir.EVAL_LOSS), (int, float))]
        rows = training_rows(rows)
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
        at = _num([r[AT_PRECISION] for r in steady if isinstance(r.get(AT_PRECISION), (int, float))])
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
        if evals:  # the newest evaluation (mfsdp-eval appends in order)
            e = evals[-1]
            parts.append(f"eval loss {e[rundir.EVAL_LOSS]:.4f} (ppl {e.get(rundir.EVAL_PPL, math.nan):.2f}) @ {e['step']}")
        parts.append(f"tokens/s/GPU {tps:,.0f}" if tps is not None else "tokens/s/GPU n/a")
        parts.append(f"MFU {100 * mfu:.1f}%" if mfu is not None else f"MFU {NO_MFU}")
        if mfu is not None and at is not None and at != mfu:
            parts[-1] += f" (bf16 peak), {100 * at:.1f}% at precision"
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
