"""`mfu_at_precision` (the FP8-weighted MFU, core/mfu.py) where people read MFU: the rank's
progress line, mfsdp-report's summary and MFU panel, the sweep summary. Labelled where it differs
from `mfu` (FP8 GEMMs), left out where the two are equal (bf16)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from mfsdp_launch.launcher import sweep_summary
from mfsdp_launch.rank.progress import RankProgress
from mfsdp_launch.tools import report

BF16 = dict(mfu=0.40, mfu_at_precision=0.40)
FP8 = dict(mfu=0.923, mfu_at_precision=0.523)


def rows(figures: dict, steps: int = 3) -> list:
    return [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s_per_gpu": 1000.0,
             "tflops_per_gpu": 900.0, "peak_mem_gib": 1.0, "step_time_s": 0.1, "tokens_seen": 128 * s,
             "ckpt_blocked_s": 0.0, **figures} for s in range(1, steps + 1)]


def run_dir(path: Path, figures: dict) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(figures)))
    return path


def test_progress_line_labels_both_figures_under_fp8(capsys):
    progress = RankProgress(types.SimpleNamespace(steps=3, progress=False), 0)
    progress.log(rows(FP8)[0])
    progress.log(rows(BF16)[0])
    fp8_line, bf16_line = capsys.readouterr().out.splitlines()[-2:]
    assert "MFU 92.3% of bf16 peak, 52.3% at precision" in fp8_line
    assert "MFU 40.0%  mem" in bf16_line and "precision" not in bf16_line


def test_report_summary_and_panel(tmp_path):
    runs = [run_dir(tmp_path / "bf16", BF16), run_dir(tmp_path / "fp8", FP8)]
    runs_rows = [rows(BF16), rows(FP8)]
    text = report.summary_text(runs, runs_rows, ["bf16", "fp8"])
    assert "bf16: " in text and "MFU 40.0%, peak mem" in text
    assert "MFU 92.3% (bf16 peak), 52.3% at precision" in text
    plt = report._import_pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots()
    report._draw(ax, runs_rows, ["bf16", "fp8"], "mfu", "MFU (%)", legend=True)
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["bf16", "fp8", "fp8 at precision"]  # the bf16 run's equal figure is not drawn twice
    assert ax.lines[2].get_linestyle() == "--" and list(ax.lines[2].get_ydata()) == pytest.approx([52.3] * 3)
    plt.close(fig)


def test_sweep_summary_cell_and_csv(tmp_path):
    jobs = [run_dir(tmp_path / "optim.lr=0.1", BF16), run_dir(tmp_path / "optim.lr=0.2", FP8)]
    got = sweep_summary.summarize(jobs, tmp_path)
    assert [r["mfu_at_precision"] for r in got] == [0.40, 0.523]
    md = (tmp_path / "sweep_summary.md").read_text()
    assert "| 40.0% |" in md and "| 92.3% (52.3% at precision) |" in md
    header = (tmp_path / "sweep_summary.csv").read_text().splitlines()[0].split(",")
    assert header[header.index("mfu") + 1] == "mfu_at_precision"
