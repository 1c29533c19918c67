"""Sweeps: Hydra multirun, one torchrun launch per job, deterministic job dirs, skip/resume on
re-run, failures recorded, summary table. Fast tests swap launch() for a fake; the slow ones
run the real acceptance sweep on CPU."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest

from helpers import cli, read_metrics
from mfsdp_launch.launcher import launch as launch_mod
from mfsdp_launch.core import exit_codes, rundir
from mfsdp_launch.launcher import sweep, sweep_summary

# The real sweeps run each job on 1 rank: what they prove is the sweep (one launch per job, job
# dirs, summary, skip and resume), which does not depend on a job's world size.
SMALL = ["model.preset=tiny", "train.seq_len=64", "data.max_bytes=2000000", "train.log_interval=1",
         "train.grad_accum_steps=1", "launcher.nproc_per_node=1"]


# --- fast: launch() replaced by a fake that writes what a run writes ---------------------------


class FakeLaunch:
    """Writes config + metrics (+ a committed checkpoint) like a real run; rc per lr."""

    def __init__(self, fail_lr=None, stop_at=None):
        self.calls = []
        self.fail_lr = fail_lr
        self.stop_at = stop_at

    def __call__(self, cfg, overrides):
        config_path = launch_mod.prepare_run_dir(cfg, overrides)
        run_dir = config_path.parent
        self.calls.append(run_dir)
        if self.fail_lr is not None and abs(cfg.optim.lr - self.fail_lr) < 1e-12:
            return 1
        last = self.stop_at or cfg.train.steps
        with open(run_dir / "metrics.jsonl", "a") as f:
            for step in range(1, last + 1):
                f.write(json.dumps({"step": step, "loss": 5.0 - step * cfg.optim.lr * 100, "lr": cfg.optim.lr,
                                    "tokens_per_s_per_gpu": 1000.0 * cfg.train.micro_batch_size, "mfu": None,
                                    "peak_mem_gib": 0.5, "step_time_s": 0.1}) + "\n")
        fake_checkpoint(run_dir, last)
        return 0


def fake_checkpoint(run_dir: Path, step: int, committed: bool = True) -> Path:
    """A step dir the checkpoint module counts as intact (manifest listing files that exist)."""
    ck = run_dir / "checkpoints" / f"step_{step}"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / ".metadata").write_bytes(b"x")
    if committed:
        (ck / "manifest.json").write_text(json.dumps({"step": step, "files": [{"path": ".metadata", "bytes": 1}]}))
    (run_dir / "checkpoints" / "latest").write_text(f"step_{step}\n")
    return ck


@pytest.fixture
def fake(monkeypatch):
    def install(**kw):
        f = FakeLaunch(**kw)
        monkeypatch.setattr(launch_mod, "launch", f)
        monkeypatch.setattr(launch_mod, "_preflight", lambda cfg: None)
        return f
    return install


def sweep_args(tmp_path, *points, name="t"):
    return ["-m", "+recipe=cpu_smoke", *points, "train.steps=3", f"run.name={name}",
            f"hydra.sweep.dir={tmp_path / 'sw'}"]


def rows_of(csv_path: Path):
    with open(csv_path) as f:
        return list(csv.DictReader(f))


def test_four_jobs_summary_then_rerun_skips_all(tmp_path, fake, capsys):
    f = fake()
    rc = sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3", "train.micro_batch_size=2,4"))
    out = capsys.readouterr().out
    assert rc == 0
    assert len(f.calls) == 4 and len(set(f.calls)) == 4
    sw = tmp_path / "sw"
    names = sorted(p.name for p in f.calls)
    # Deterministic: from the overrides (not a time, not the job number alone).
    assert names == ["optim.lr=0.001,train.micro_batch_size=2,train.steps=3",
                     "optim.lr=0.001,train.micro_batch_size=4,train.steps=3",
                     "optim.lr=0.003,train.micro_batch_size=2,train.steps=3",
                     "optim.lr=0.003,train.micro_batch_size=4,train.steps=3"]
    rows = rows_of(sw / rundir.SWEEP_SUMMARY)
    assert len(rows) == 4 and {r["status"] for r in rows} == {"done"}
    assert rows[0]["overrides"] == "+recipe=cpu_smoke optim.lr=0.001 train.micro_batch_size=2 train.steps=3 run.name=t"
    assert float(rows[0]["tokens_per_s_per_gpu"]) == 2000.0 and rows[0]["mfu"] == ""
    md = (sw / rundir.SWEEP_SUMMARY_MD).read_text()
    assert md.count("| optim.lr=") == 4 and "tokens/s/GPU" in md and "MFU" in md
    assert "sweep summary" in out and "4 job(s): 4 done" in out
    for d in f.calls:
        st = json.loads((d / rundir.JOB_STATUS).read_text())
        assert st["status"] == "done" and st["exit_code"] == 0 and st["final_step"] == 3
        assert (d / rundir.JOB_DONE).is_file()
        assert (d / "config.yaml").is_file() and (d / "overrides.yaml").is_file()
    # No Hydra extras: no .hydra dirs, no log files, only Hydra's multirun.yaml in the sweep dir.
    assert not list(sw.rglob(".hydra")) and not list(sw.rglob("*.log"))
    assert sorted(p.name for p in sw.iterdir() if p.is_file()) == ["multirun.yaml", "sweep_summary.csv",
                                                                   "sweep_summary.md"]

    f2 = fake()
    rc = sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3", "train.micro_batch_size=2,4"))
    out = capsys.readouterr().out
    assert rc == 0 and f2.calls == []
    assert out.count("already finished (step 3/3): done, nothing to run") == 4
    assert {r["status"] for r in rows_of(sw / rundir.SWEEP_SUMMARY)} == {"done"}
    assert "4 job(s): 4 done (already finished)" in out and "skipped" not in out
    assert all(json.loads((d / rundir.JOB_STATUS).read_text())["already_finished"] for d in f.calls)


def test_failed_and_invalid_jobs_are_recorded_and_the_sweep_goes_on(tmp_path, fake, capsys):
    f = fake(fail_lr=3e-3)
    rc = sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3", "train.micro_batch_size=2,0"))
    captured = capsys.readouterr()
    assert rc == 1
    rows = {r["overrides"].split(" ")[1] + " " + r["overrides"].split(" ")[2]: r
            for r in rows_of(tmp_path / "sw" / rundir.SWEEP_SUMMARY)}
    assert len(rows) == 4
    assert rows["optim.lr=0.001 train.micro_batch_size=2"]["status"] == "done"
    assert rows["optim.lr=0.003 train.micro_batch_size=2"]["status"] == "failed"
    assert rows["optim.lr=0.003 train.micro_batch_size=2"]["exit_code"] == "1"
    for lr in ("0.001", "0.003"):
        r = rows[f"optim.lr={lr} train.micro_batch_size=0"]
        assert r["status"] == "invalid" and r["exit_code"] == "2"
    assert "train.micro_batch_size: must be >= 1, got 0" in captured.err
    assert len(f.calls) == 2  # the invalid points never launched
    bad = Path(rows["optim.lr=0.001 train.micro_batch_size=0"]["run_dir"])
    assert json.loads((bad / rundir.JOB_STATUS).read_text())["error"] == "train.micro_batch_size: must be >= 1, got 0"

    # Re-run: the finished job is skipped, the failed one is launched again.
    f2 = fake()
    rc = sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3", "train.micro_batch_size=2,0"))
    assert rc == 1  # the invalid points are still invalid
    assert [p.name for p in f2.calls] == ["optim.lr=0.003,train.micro_batch_size=2,train.steps=3"]


def test_unfinished_job_runs_again_and_a_final_checkpoint_counts_as_finished(tmp_path, fake, capsys):
    sw = tmp_path / "sw"
    a = sw / "optim.lr=0.001,train.steps=3"
    b = sw / "optim.lr=0.003,train.steps=3"
    fake_checkpoint(a, 3)  # finished outside the sweep (no DONE marker)
    fake_checkpoint(b, 2)  # stopped at step 2 of 3
    fake_checkpoint(b, 3, committed=False)  # a save that never committed does not count
    f = fake()
    assert sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3")) == 0
    assert f.calls == [b]
    assert json.loads((a / rundir.JOB_STATUS).read_text())["status"] == "done"
    assert json.loads((a / rundir.JOB_DONE).read_text())["step"] == 3


def test_a_stopped_job_stops_the_sweep(tmp_path, fake, capsys):
    f = fake(stop_at=1)  # exits 0 before train.steps: a graceful stop on request
    rc = sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3"))
    assert rc == exit_codes.INTERRUPTED and len(f.calls) == 1
    statuses = [r["status"] for r in rows_of(tmp_path / "sw" / rundir.SWEEP_SUMMARY)]
    assert statuses == ["stopped", "not_run"]
    assert "stopping the sweep" in capsys.readouterr().err


def test_slash_in_a_value_is_one_job_dir(tmp_path, capsys):
    corpus = tmp_path / "x" / "y.txt"  # data paths are checked before a job runs: it must exist
    corpus.parent.mkdir()
    corpus.write_text("text " * 1000)
    rc = sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3", f"data.path={corpus}", "launcher.dry_run=true"))
    assert rc == 0
    sw = tmp_path / "sw"
    quoted = str(corpus).replace("/", "%2F")
    assert sorted(p.name for p in sw.iterdir() if p.is_dir()) == [
        f"data.path={quoted},optim.lr=0.001,train.steps=3", f"data.path={quoted},optim.lr=0.003,train.steps=3"]
    assert {r["status"] for r in rows_of(sw / rundir.SWEEP_SUMMARY)} == {"dry_run"}


def test_summary_from_disk_counts_jobs_finished_elsewhere(tmp_path, capsys):
    """Jobs run by a launcher plugin (or SLURM): the summary reads their dirs."""
    sw = tmp_path / "sw"
    d = sw / "optim.lr=0.1"
    d.mkdir(parents=True)
    (d / rundir.JOB_STATUS).write_text(json.dumps({"status": "running", "train_steps": 2, "job_num": 0,
                                                    "overrides": ["optim.lr=0.1"]}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "mfu": 0.25,
                                                         "tokens_per_s_per_gpu": 10.0,
                                                         "peak_mem_gib": 1.5}) + "\n" for s in (1, 2)))
    rows = sweep_summary.summarize(sweep_summary.job_dirs_in(sw), sw)
    assert rows[0]["status"] == "done" and rows[0]["final_loss"] == 0.5 and rows[0]["step"] == 2
    assert "25.0%" in (sw / rundir.SWEEP_SUMMARY_MD).read_text()


def test_a_job_that_dies_under_a_launcher_aborts_with_exit_1(tmp_path, monkeypatch, capsys):
    """A plugin's job killed from outside (timeout, preemption) comes back as a failed JobReturn,
    which Hydra's sweeper raises: the sweep ends with exit 1 and a summary, not a config error."""
    def killed(cfg):
        raise RuntimeError("job 123 was killed (timeout)")

    monkeypatch.setattr(sweep, "sweep_job", killed)
    rc = sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3"))
    err = capsys.readouterr().err
    assert rc == 1
    assert "mfsdp-train: sweep aborted: RuntimeError: job 123 was killed (timeout)" in err
    assert (tmp_path / "sw" / rundir.SWEEP_SUMMARY).is_file()


@pytest.mark.parametrize("args,key", [
    (["optim.lrr=1,2"], "optim.lrr: unknown key"),
    (["train.steps=2,x"], "train.steps: Value 'x'"),
    (["+recipe=nope", "optim.lr=1,2"], "+recipe: no option 'nope'"),
    (["optim.lr=1,2", "--cfg"], "--cfg: not supported with -m/--multirun"),
])
def test_bad_sweep_overrides_are_one_line_exit_2(tmp_path, args, key):
    r = cli("-m", *args, f"hydra.sweep.dir={tmp_path / 'sw'}", cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mfsdp-train: error: ") and key in lines[0], r.stderr
    assert not (tmp_path / "sw").exists()  # nothing written for a sweep that cannot run


def test_slurm_sweep_writes_one_script_per_job(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch_mod, "_preflight", lambda cfg: None)
    rc = sweep.run_sweep(sweep_args(tmp_path, "optim.lr=1e-3,3e-3", "launcher=slurm", "launcher.nnodes=2"))
    assert rc == 0
    rows = rows_of(tmp_path / "sw" / rundir.SWEEP_SUMMARY)
    assert [r["status"] for r in rows] == ["written", "written"]
    for r in rows:
        script = (Path(r["run_dir"]) / "sbatch.sh").read_text()
        assert "#SBATCH --nodes=2" in script and f"--config {r['run_dir']}/config.yaml" in script.replace("'", "")


# --- slow: the real thing ----------------------------------------------------------------------


@pytest.mark.slow
def test_acceptance_sweep_four_jobs_then_rerun_skips(tmp_path):
    sw = tmp_path / "sweeps" / "acc"
    args = ["-m", "+recipe=cpu_smoke", "optim.lr=1e-3,3e-3", "train.micro_batch_size=2,4", "train.steps=2",
            *SMALL, f"run.name=acc_{tmp_path.name}", f"hydra.sweep.dir={sw}"]
    r = cli(*args, cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = rows_of(sw / rundir.SWEEP_SUMMARY)
    assert len(rows) == 4 and {x["status"] for x in rows} == {"done"}
    for x in rows:
        assert float(x["final_loss"]) > 0 and float(x["tokens_per_s_per_gpu"]) > 0
        assert float(x["peak_mem_gib"]) > 0 and x["mfu"] == ""  # CPU: no device peak
        assert x["step"] == "2"
        run_dir = Path(x["run_dir"])
        assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "config.yaml").is_file()
        assert (run_dir / rundir.JOB_DONE).is_file()
    md = (sw / rundir.SWEEP_SUMMARY_MD).read_text()
    assert md.count("| optim.lr=") == 4
    assert "sweep summary" in r.stdout and "4 job(s): 4 done" in r.stdout
    assert not list(sw.rglob(".hydra"))
    # No Hydra log files; the only logs are each run's own (run.dir/logs: launcher and ranks).
    assert all("logs" in p.relative_to(sw).parts for p in sw.rglob("*.log"))
    assert all((Path(x["run_dir"]) / "logs" / "launcher.log").is_file() for x in rows)
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()

    t0 = time.monotonic()
    r = cli(*args, cwd=tmp_path, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("already finished") >= 4 and "4 job(s): 4 done (already finished)" in r.stdout
    assert "ranks, run.dir=" not in r.stdout  # nothing launched
    assert took < 30, took
    assert {x["status"] for x in rows_of(sw / rundir.SWEEP_SUMMARY)} == {"done"}


@pytest.mark.slow
def test_sweep_with_an_invalid_point_finishes_the_others_and_resumes_unfinished(tmp_path):
    import shutil

    sw = tmp_path / "sw"
    args = ["-m", "+recipe=cpu_smoke", "mesh.dp_shard=1,3", "train.steps=4", "checkpoint.interval=2", *SMALL,
            f"run.name=bad_{tmp_path.name}", f"hydra.sweep.dir={sw}"]
    r = cli(*args, cwd=tmp_path, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {x["overrides"].split(" ")[1]: x for x in rows_of(sw / rundir.SWEEP_SUMMARY)}
    good, bad = rows["mesh.dp_shard=1"], rows["mesh.dp_shard=3"]  # 3 does not fit the 1 rank
    assert good["status"] == "done" and float(good["final_loss"]) > 0 and good["step"] == "4"
    assert bad["status"] == "invalid" and bad["exit_code"] == "2"
    assert "mesh: dp_outer*dp_shard*cp*tp" in r.stderr
    assert "1 done, 1 invalid" in r.stdout

    # Make the good job unfinished (as if it was killed after its step-2 checkpoint): it resumes.
    job = Path(good["run_dir"])
    (job / rundir.JOB_DONE).unlink()
    shutil.rmtree(job / "checkpoints" / "step_4")
    r = cli(*args, cwd=tmp_path, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "resuming from step 2" in r.stdout, r.stdout[-3000:]
    steps = [r["step"] for r in read_metrics(job)]
    assert steps == [1, 2, 3, 4]
    assert json.loads((job / rundir.JOB_STATUS).read_text())["status"] == "done"
    assert (job / rundir.JOB_DONE).is_file()


@pytest.mark.slow
def test_hydra_launcher_plugin_needs_no_code_changes(tmp_path):
    """hydra/launcher=submitit_local (when the plugin is installed): jobs run in submitit's
    processes, the summary is still built from the job dirs."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sw = tmp_path / "sw"
    r = cli("-m", "+recipe=cpu_smoke", "optim.lr=1e-3,3e-3", "train.steps=2", *SMALL, f"run.name=p_{tmp_path.name}",
            f"hydra.sweep.dir={sw}", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
            cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = rows_of(sw / rundir.SWEEP_SUMMARY)
    assert [x["status"] for x in rows] == ["done", "done"] and all(float(x["final_loss"]) > 0 for x in rows)
