"""Operating real runs (issue 17): one owner per run dir, no orphans when the launcher dies, exit
codes that tell a finished run from an interrupted or failed one, graceful SLURM-style
preemption, per-rank logs, one traceback and a summary line. Real launcher, torchrun and gloo
ranks; signals sent to real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import USER_MODULE, USER_MODULE_NAME, cli, read_metrics, start_cli, write_user_module
from mfsdp_launch.core import exit_codes, rundir

pytestmark = pytest.mark.slow

SMALL = ["+recipe=cpu_smoke", "model.preset=tiny", "train.seq_len=64", "data.max_bytes=2000000",
         "train.log_interval=1", "train.grad_accum_steps=1", "train.micro_batch_size=2", "train.progress=false"]


def start(run_dir: Path, *overrides: str, log: Path) -> tuple:
    f = open(log, "w")
    proc = start_cli(*SMALL, f"run.dir={run_dir}", *overrides, stdout=f, stderr=subprocess.PIPE)
    return proc, f


def metric_steps(run_dir: Path) -> list:
    return [r["step"] for r in read_metrics(run_dir)]


def wait_for_steps(run_dir: Path, n: int, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(metric_steps(run_dir)) < n:
        assert proc.poll() is None, f"launcher exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no training steps in time"
        time.sleep(0.2)


def tree(pid: int) -> list:
    """pid's live descendants (torchrun and the ranks), from /proc."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def finish(proc, f, timeout: float = 180) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        f.close()
    return err


# --- 1. one owner per run dir -------------------------------------------------------------------


def test_two_runs_started_together_one_refuses_and_the_other_finishes_unharmed(tmp_path):
    run_dir = tmp_path / "run"
    procs = [start(run_dir, "train.steps=6", "checkpoint.interval=3", log=tmp_path / f"{i}.log") for i in range(2)]
    errs = [finish(p, f) for p, f in procs]
    codes = [p.returncode for p, _ in procs]
    assert sorted(codes) == [exit_codes.OK, exit_codes.CONFIG], (codes, errs)
    winner, loser = (0, 1) if codes[0] == exit_codes.OK else (1, 0)
    lines = errs[loser].strip().splitlines()
    assert len(lines) == 1, errs[loser]
    holder = procs[winner][0].pid
    assert lines[0].startswith(f"mfsdp-train: error: run.dir: {run_dir} is in use by pid {holder} on host")
    # The winner's run is whole: every step once, its checkpoints, its log; the lock is gone.
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "checkpoints" / "step_6" / "manifest.json").is_file()
    assert not (run_dir / rundir.LOCK).exists()
    out = (tmp_path / f"{winner}.log").read_text()
    summary = [ln for ln in out.splitlines() if ln.startswith("mfsdp-train: finished")]
    assert summary and "step 6/6" in summary[0] and "last checkpoint step_6" in summary[0], summary

    # 9. The finished run again (or with fewer steps): one line, exit 0, nothing spawned.
    for steps in (6, 4):
        r = cli(*SMALL, f"run.dir={run_dir}", f"train.steps={steps}", timeout=120)
        assert r.returncode == exit_codes.OK, r.stderr
        assert r.stdout.count("\n") == 1 and "nothing to do" in r.stdout, r.stdout
        assert "ranks, run.dir=" not in r.stdout
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5, 6]


# --- 2. no orphans ------------------------------------------------------------------------------


def test_sigkill_of_the_launcher_leaves_no_rank_alive_and_the_next_run_takes_over(tmp_path):
    run_dir = tmp_path / "run"
    proc, f = start(run_dir, "train.steps=100000", log=tmp_path / "a.log")
    wait_for_steps(run_dir, 2, proc)
    family = tree(proc.pid)
    assert len(family) >= 3, family  # torchrun and its 2 ranks
    try:
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 15
        while any(alive(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in family if alive(p)], "torchrun or ranks outlived the launcher"
    finally:
        f.close()
        for p in family:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # Its lock was left behind by a dead process: the next launch takes it over and resumes.
    assert json.loads((run_dir / rundir.LOCK).read_text())["pid"] == proc.pid
    r = cli(*SMALL, f"run.dir={run_dir}", "train.steps=2", timeout=180)
    assert r.returncode == exit_codes.OK, r.stderr[-3000:]
    assert f"taking over {run_dir / rundir.LOCK} left by pid {proc.pid}" in r.stderr
    assert "no longer running" in r.stderr


# --- 3. exit codes and signals ------------------------------------------------------------------


# SIGTERM to the launcher alone (exit code 3, the summary line, a checkpoint, then a resume):
# tests/e2e/test_resume_e2e.py::test_sigterm_to_the_launcher_saves_exits_interrupted_then_resumes.


def test_sigterm_to_every_process_is_a_graceful_preemption_without_traceback(tmp_path):
    """What SLURM does on preemption or scancel: SIGTERM to the launcher, torchrun and the ranks."""
    run_dir = tmp_path / "run"
    # 5. With the stall watchdog dumping all through start-up: no rank may crash (SIGSEGV).
    proc, f = start(run_dir, "train.steps=100000", "train.stall_dump_s=0.2", log=tmp_path / "out.log")
    wait_for_steps(run_dir, 2, proc)
    for pid in [proc.pid, *tree(proc.pid)]:
        os.kill(pid, signal.SIGTERM)
    err = finish(proc, f)
    out = (tmp_path / "out.log").read_text()
    assert proc.returncode == exit_codes.INTERRUPTED, err[-3000:]
    assert "Traceback" not in out + err and "mfsdp-train: failed" not in err, err
    # torchrun itself stayed out of it: it neither raised its SignalException nor tore the ranks
    # down. (The class name alone may appear: the stall watchdog's stack dumps quote source lines.)
    launcher_log = (run_dir / "logs" / rundir.LAUNCHER_LOG).read_text()
    assert "got signal:" not in launcher_log and "death signal" not in launcher_log, launcher_log[-3000:]
    stopped = metric_steps(run_dir)[-1]
    assert (run_dir / "checkpoints" / f"step_{stopped}" / "manifest.json").is_file()
    assert f"interrupted at step {stopped}/" in err
    assert "stall watchdog: no step for" in (run_dir / "logs" / "rank1.stderr.log").read_text()


# --- 6. logs, one traceback, the summary --------------------------------------------------------


CRASHING_MODULE = USER_MODULE.replace(
    "    def forward(self, input_ids):\n",
    "    calls = 0\n\n"
    "    def forward(self, input_ids):\n"
    "        LM.calls += 1\n"
    "        if LM.calls == 3:\n"
    "            raise RuntimeError('boom in forward 3')\n")


def test_a_failing_run_shows_one_traceback_and_keeps_every_ranks_log(tmp_path):
    """The user's forward raises on every rank at once: each rank fails; the console shows one
    traceback (not one per rank, not torchrun's ChildFailedError block) and the summary.
    (A non-finite loss is no longer a crash: bad steps are skipped, tests/e2e/test_bad_steps_e2e.py.)"""
    assert CRASHING_MODULE != USER_MODULE
    env = write_user_module(tmp_path / "user_code", CRASHING_MODULE)
    run_dir = tmp_path / "run"
    small = [o for o in SMALL if not o.startswith("model.preset")]  # a key of model=gpt
    r = cli(*small, "model=custom", f"model.target={USER_MODULE_NAME}:build",
            f"model.fsdp_unit_modules=[{USER_MODULE_NAME}.Block]", f"run.dir={run_dir}", "train.steps=20",
            env=env, timeout=180)
    assert r.returncode == exit_codes.FAILED, r.stderr[-3000:]
    assert r.stderr.count("Traceback (most recent call last)") == 1, r.stderr
    assert "RuntimeError: boom in forward 3" in r.stderr
    assert "ChildFailedError" not in r.stderr + r.stdout and "Root Cause" not in r.stderr
    assert "also failed" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("mfsdp-train: failed at step") and "exit code 1" in last, last
    logs = run_dir / rundir.LOGS
    assert "ChildFailedError" in (logs / rundir.LAUNCHER_LOG).read_text()  # torchrun's block: in the log only
    for rank in (0, 1):
        assert "boom in forward 3" in (logs / f"rank{rank}.stderr.log").read_text()
    assert "starting fresh" in (logs / "rank0.stdout.log").read_text()
