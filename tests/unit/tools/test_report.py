"""mfsdp-report (PNG plots + summary of runs and sweeps) and the optional TensorBoard logging."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import ROOT, cli
from mfsdp_launch.tools import report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNGS = ("report.png", "loss.png", "throughput.png", "mfu.png", "memory.png", "lr.png", "grad_norm.png")


def fake_run(run_dir: Path, steps=10, mfu=None, lr=1e-3, overrides=None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "loss": 6.0 / (1 + lr * 100 * s), "lr": lr, "grad_norm": 1.0,
                                "tokens_per_s_per_gpu": 1000.0 + s, "tflops_per_gpu": None,
                                "mfu": None if mfu is None else mfu + 0.001 * s,
                                "peak_mem_gib": 0.3 + 0.01 * s, "step_time_s": 0.1,
                                "tokens_seen": 128 * s, "ckpt_blocked_s": 0.0}) + "\n")
        f.write('{"step": 11, "loss": 1.0, "lr"')  # a line cut by a crash is ignored
    if overrides is not None:
        (run_dir / "job_status.json").write_text(json.dumps({"status": "done", "overrides": overrides}))
    return run_dir


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] > 300 and im.size[1] > 200


def test_one_cpu_run_mfu_is_na(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    assert report.main([str(run)]) == 0
    out_dir = run / "report"
    for name in PNGS:
        assert_png(out_dir / name)
    text = (out_dir / "summary.txt").read_text()
    assert text in capsys.readouterr().out
    assert "step 10" in text and "final loss" in text and "MFU n/a (no device peak)" in text
    assert "tokens/s/GPU 1,006" in text  # median, without the first (warm-up) interval


def test_mfu_panel_says_na_when_mfu_is_null(tmp_path, monkeypatch):
    """The MFU axes get the 'n/a (no device peak)' text instead of a line (and no crash)."""
    texts = []
    import matplotlib.axes

    orig = matplotlib.axes.Axes.text

    def spy(self, x, y, s, *a, **kw):
        texts.append((self.get_title(), s))
        return orig(self, x, y, s, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "text", spy)
    assert report.main([str(fake_run(tmp_path / "run")), "--out", str(tmp_path / "o")]) == 0
    assert ("MFU (%)", "n/a (no device peak)") in texts
    assert all(t[0] == "MFU (%)" for t in texts)


def test_sweep_dir_expands_to_its_jobs_overlaid(tmp_path, capsys):
    sw = tmp_path / "sweep"
    for i, lr in enumerate((1e-3, 3e-3)):
        fake_run(sw / f"optim.lr={lr},train.steps=10", lr=lr, mfu=0.3 if i else None,
                 overrides=["+recipe=cpu_smoke", f"optim.lr={lr}", "train.steps=10"])
    (sw / "multirun.yaml").write_text("{}")
    other = fake_run(tmp_path / "other", steps=5, mfu=0.4)
    out = tmp_path / "out"
    assert report.main([str(sw), str(other), "--out", str(out)]) == 0
    for name in PNGS:
        assert_png(out / name)
    text = (out / "summary.txt").read_text()
    assert text.startswith("mfsdp-report: 3 run(s)")
    lines = text.splitlines()[1:]
    assert len(lines) == 3
    assert any("MFU 30.6%" in ln for ln in lines) and any("MFU 40.4%" in ln for ln in lines)
    assert any("MFU n/a (no device peak)" in ln for ln in lines)


def test_a_diverged_run_has_no_best_nan_and_rerun_points_read_done(tmp_path, capsys):
    """Issue 17: a nan first row made the best loss "nan"; a sweep point that was already
    finished when the sweep ran again read "skipped"."""
    run = tmp_path / "run"
    run.mkdir()
    losses = [float("nan"), 3.0, 2.5, float("inf"), float("nan")]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n"
                                               for i, v in enumerate(losses)))
    (run / "job_status.json").write_text(json.dumps({"status": "done", "already_finished": True}))
    old = fake_run(tmp_path / "old")
    (old / "job_status.json").write_text(json.dumps({"status": "skipped"}))  # an earlier version's record
    assert report.main([str(run), str(old), "--out", str(tmp_path / "o")]) == 0
    lines = (tmp_path / "o" / "summary.txt").read_text().splitlines()
    mine = next(ln for ln in lines if ln.strip().startswith("run:"))
    assert "best 2.5000 @ 3" in mine and "best nan" not in mine and "final loss nan" in mine
    assert "done (already finished)" in mine
    assert "skipped" not in "\n".join(lines) and "done (already finished)" in next(
        ln for ln in lines if ln.strip().startswith("old:"))


def test_labels_are_the_swept_values(tmp_path):
    runs = [fake_run(tmp_path / f"j{i}", overrides=["+recipe=cpu_smoke", f"optim.lr={lr}", "train.steps=3"])
            for i, lr in enumerate((0.1, 0.2))]
    assert report.labels_for(runs) == ["optim.lr=0.1", "optim.lr=0.2"]


def test_long_labels_are_numbered_with_a_legend_table_and_lr_and_grad_norm_are_drawn(tmp_path, monkeypatch):
    import matplotlib.figure

    saved = []  # per figure written: {panel title: [(line label, y values)]}, and its tables' cells
    orig = matplotlib.figure.Figure.savefig

    def spy(self, *a, **kw):
        panels = {ax.get_title(): [(ln.get_label(), list(ln.get_ydata())) for ln in ax.lines] for ax in self.axes}
        cells = [[[c.get_text().get_text() for (r, _), c in sorted(t.get_celld().items()) if r == row]
                  for row in range(1, len({r for r, _ in t.get_celld()}))] for ax in self.axes for t in ax.tables]
        saved.append((panels, cells))
        return orig(self, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    long = [["+recipe=cpu_smoke", f"optim.lr={lr}", f"data.path=/data/a/long/corpus/path/number_{i}"]
            for i, lr in enumerate((1e-3, 3e-3))]
    runs = [fake_run(tmp_path / f"j{i}", lr=(1e-3, 3e-3)[i], overrides=o) for i, o in enumerate(long)]
    assert report.main([str(r) for r in runs] + ["--out", str(tmp_path / "o")]) == 0
    full = report.labels_for(runs)
    assert all(len(f) > report.LABEL_MAX for f in full)
    panels, tables = saved[0]  # report.png
    assert [label for label, _ in panels["loss"]] == ["#1", "#2"]  # short in the plots
    assert tables == [[["#1", full[0]], ["#2", full[1]]]]  # the legend table names them
    assert [ys[0] for _, ys in panels["learning rate"]] == [1e-3, 3e-3] and len(panels["grad norm"]) == 2
    text = (tmp_path / "o" / "summary.txt").read_text()
    assert f"#1 {full[0]}: step 10" in text
    for name in PNGS:
        assert_png(tmp_path / "o" / name)
    assert report.short_labels(["a", "b"]) == (["a", "b"], [])  # short ones stay as they are


def test_not_a_run_dir_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mfsdp-report: error: ") and "no metrics.jsonl" in err[0]
    assert report.main([str(tmp_path / "missing")]) == 2


def test_missing_matplotlib_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path / "run")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert report.main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mfsdp-report: error: matplotlib is not installed (pip install 'mfsdp-launch[report]')"]
    assert not (run / "report").exists()


def test_console_script_entry_point_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'mfsdp-report = "mfsdp_launch.tools.report:main"' in text


@pytest.mark.slow
def test_tensorboard_event_file_beside_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    r = cli("+recipe=cpu_smoke", f"run.dir={run_dir}", "train.steps=2", "train.log_interval=1",
            "model.preset=tiny", "train.seq_len=64", "data.max_bytes=2000000", "train.micro_batch_size=2",
            "logging.tensorboard=true", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (run_dir / "metrics.jsonl").is_file()
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss", "tokens_per_s_per_gpu", "peak_mem_gib"} <= set(tags)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]
    # And the report reads the same run.
    assert report.main([str(run_dir)]) == 0
    assert_png(run_dir / "report" / "report.png")
