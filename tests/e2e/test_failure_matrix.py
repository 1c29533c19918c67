"""Issue 28's failure matrix, the faults that need a real run: the launcher on a terminal (a pty)
draws the progress bar from rank 0's progress, a slow rank is named as a straggler, a run dir
with spaces and non-ASCII characters works, closing the terminal is a graceful stop (exit 3),
Ctrl-Z pauses the ranks too, a torn metrics.jsonl loses no row on resume, mfsdp-export takes the
format from the extension, a named damaged step is refused before spawning, and a full disk is
one line. Real launcher, torchrun and gloo ranks; signals to real processes.

One terminal run (A) and its resume (B) are shared by the tests that read them."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pty
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from helpers import ROOT, cli, cli_env, cli_error, read_metrics, start_cli, write_user_module

pytestmark = pytest.mark.slow

MODULE = "mfsdp_failure_matrix_model"
# The README's model, with a rank 1 that burns SPIN_S of CPU time in every forward: a slower rank.
SLOW_RANK_MODEL = '''
import os
import time

import torch.nn as nn

SPIN_S = 0.12


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class LM(nn.Module):
    def __init__(self, vocab=256, dim=32, n_layers=2):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_layers))

    def forward(self, input_ids):
        if os.environ.get("RANK") == "1" and not input_ids.is_meta:
            end = time.thread_time() + SPIN_S
            while time.thread_time() < end:
                pass
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build():
    return LM()
'''
RUN = ["+recipe=cpu_smoke", "model=custom", f"model.target={MODULE}:build", f"model.fsdp_unit_modules=[{MODULE}.Block]",
       "train.seq_len=64", "data.max_bytes=2000000", "train.log_interval=2", "train.grad_accum_steps=1",
       "train.micro_batch_size=2", "checkpoint.interval=4", "checkpoint.interval_minutes=null"]
SMALL = ["+recipe=cpu_smoke", "model.preset=tiny", "train.seq_len=64", "data.max_bytes=2000000",
         "train.log_interval=1", "train.grad_accum_steps=1", "train.micro_batch_size=2", "train.progress=false"]


def on_terminal(args, env: dict, hang_up, timeout: float = 240) -> tuple:
    """The launcher with a pty as its controlling terminal (session leader, as under a shell's
    window). `hang_up(output)` -> True closes the terminal (the kernel sends SIGHUP). Returns
    (exit code, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))

    def controlling_tty():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    full_env = {**cli_env(), "TERM": "xterm-256color", **env}
    proc = subprocess.Popen([sys.executable, "-m", "mfsdp_launch", *args], stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=controlling_tty, env=full_env, cwd=ROOT)
    os.close(slave)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: the launcher exited and the pty has no writer left
                    break
                if not chunk:
                    break
                shown += chunk
            if hang_up(shown.decode(errors="replace")):
                break
            if proc.poll() is not None and not ready:
                break
    finally:
        os.close(master)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return rc, shown.decode(errors="replace")


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    return write_user_module(tmp_path_factory.mktemp("user_code"), SLOW_RANK_MODEL, MODULE)


@pytest.fixture(scope="module")
def terminal_run(tmp_path_factory, user_env):
    """Run A: on a terminal, in a run dir with a space and non-ASCII characters; the terminal is
    closed once the bar showed and a checkpoint and two straggler rows are written."""
    run_dir = tmp_path_factory.mktemp("matrix") / "rün ö 1"

    def ready(_shown: str) -> bool:
        rows = [r for r in read_metrics(run_dir) if "loss" in r]
        return len(rows) >= 3 and (run_dir / "checkpoints" / "step_4").is_dir() and "ETA" in _shown

    rc, shown = on_terminal([*RUN, f"run.dir={run_dir}", "train.steps=40"], user_env, ready)
    return run_dir, rc, shown


def test_progress_bar_shows_on_a_terminal(terminal_run):
    """Rank 0's stdout is torchrun's pipe: the launcher draws the bar (step N/M, tok/s, ETA)."""
    _, _, shown = terminal_run
    assert "ETA" in shown and "/40" in shown and "tok/s" in shown, shown[-3000:]


def test_run_dir_with_spaces_and_non_ascii_works(terminal_run):
    run_dir, _, _ = terminal_run
    assert (run_dir / "checkpoints" / "step_4").is_dir() and read_metrics(run_dir)
    assert f"run.dir={run_dir}" in (run_dir / "logs" / "launcher.log").read_text()


def test_a_slow_rank_is_named_as_a_straggler(terminal_run):
    run_dir, _, shown = terminal_run
    rows = [r for r in read_metrics(run_dir) if "loss" in r][1:]  # (the first interval holds start-up work)
    assert rows and all(r["stragglers"] == [1] and r["slowest_rank"] == 1 for r in rows), rows
    assert all(r["step_busy_max_s"] > r["step_busy_s"] > 0 for r in rows)
    assert "stragglers: rank 1" in shown


def test_closing_the_terminal_mid_run_is_a_graceful_stop(terminal_run):
    run_dir, rc, _ = terminal_run
    assert rc == 3, (run_dir / "logs" / "launcher.log").read_text()[-3000:]
    log = (run_dir / "logs" / "launcher.log").read_text()
    assert "SIGHUP: finishing the step, saving a checkpoint" in log and "exit code 3" in log


@pytest.fixture(scope="module")
def resumed_run(terminal_run, user_env):
    """Run B: A resumed after its metrics.jsonl was cut mid-line (the row of its last checkpoint),
    paused with Ctrl-Z (SIGTSTP) while training and continued (SIGCONT)."""
    run_dir = terminal_run[0]
    metrics = run_dir / "metrics.jsonl"
    rows = read_metrics(run_dir)
    resume_at = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert rows[-1]["step"] == resume_at
    text = metrics.read_text()
    metrics.write_text(text[: len(text) - len(json.dumps(rows[-1])) // 2 - 1])  # the last row, cut mid-line
    steps = resume_at + 10
    log = open(run_dir / "resume.out", "w")
    proc = start_cli(*RUN, f"run.dir={run_dir}", f"train.steps={steps}", "train.progress=false", env=user_env,
                     stdout=log, stderr=subprocess.STDOUT)
    try:
        while not [r for r in read_metrics(run_dir) if r["step"] > resume_at + 1]:
            assert proc.poll() is None, (run_dir / "resume.out").read_text()[-3000:]
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTSTP)
        paused = _wait_until(lambda: _all_stopped(proc.pid), 15)
        during = len(read_metrics(run_dir))
        time.sleep(1.5)
        still = _all_stopped(proc.pid) and len(read_metrics(run_dir)) == during
        os.kill(proc.pid, signal.SIGCONT)
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return run_dir, resume_at, steps, paused, still, rc


def _tree(pid: int) -> list:
    from mfsdp_launch.launcher.supervise import descendants

    return [pid, *descendants(pid)]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _all_stopped(pid: int) -> bool:
    tree = _tree(pid)
    return len(tree) >= 4 and all(_state(p) in ("T", "t", "gone") for p in tree)  # launcher, torchrun, 2 ranks


def _wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_ctrl_z_pauses_the_ranks_too_and_fg_resumes(resumed_run):
    run_dir, _, steps, paused, still, rc = resumed_run
    assert paused, "the launcher, torchrun and the ranks were not all stopped after SIGTSTP"
    assert still, "training went on while the launcher was stopped"
    assert rc == 0, (run_dir / "resume.out").read_text()[-3000:]
    assert max(r["step"] for r in read_metrics(run_dir)) == steps


def test_a_torn_metrics_line_loses_no_row_on_resume(resumed_run):
    run_dir, resume_at, steps, _, _, _ = resumed_run
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # no torn line left
    train_steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    assert resume_at in train_steps and train_steps == sorted(set(train_steps)), train_steps
    assert train_steps[-1] == steps


def test_export_takes_the_format_from_the_extension(resumed_run, tmp_path, capsys):
    from mfsdp_launch.tools.export import main as export_main

    run_dir = resumed_run[0]
    assert export_main([str(run_dir), str(tmp_path / "model.pt")]) == 0
    import torch

    assert "emb.weight" in torch.load(tmp_path / "model.pt", weights_only=True)  # a torch file, not safetensors
    capsys.readouterr()
    assert export_main([str(run_dir), str(tmp_path / "other.pt"), "--format", "safetensors"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mfsdp-export: error: --format: safetensors, but OUT "), err
    assert not (tmp_path / "other.pt").exists()
    assert export_main([str(run_dir), str(tmp_path / "model.weights")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_named_damaged_step_is_refused_before_spawning(resumed_run, tmp_path, user_env, monkeypatch):
    """checkpoint.load_step, or load_path to another run's step, on a same-size damaged step: one
    line naming it, no rank started (no launcher log), and no "last checkpoint" claim."""
    run_dir = tmp_path / "copy"
    shutil.copytree(resumed_run[0] / "checkpoints", run_dir / "checkpoints")
    step = min((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    _flip(sorted(step.glob("*.distcp"))[0])
    n = int(step.name.split("_")[1])
    r = cli(*RUN, f"run.dir={run_dir}", f"checkpoint.load_step={n}", f"train.steps={n + 2}", env=user_env, timeout=120)
    line = cli_error(r)
    assert line.startswith(f"mfsdp-train: error: checkpoint.load_step: {step} is damaged (checksum mismatch in "), line
    assert not (run_dir / "logs").exists() and "last checkpoint" not in r.stdout + r.stderr

    # load_path to another run's damaged step: the same check (in this process: the same code).
    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.launcher.launch import check
    from mfsdp_launch.planner.compose import compose

    other = tmp_path / "other"
    monkeypatch.syspath_prepend(user_env["PYTHONPATH"].split(os.pathsep)[0])
    with pytest.raises(ConfigError) as e:
        check(compose([*RUN, f"run.dir={other}", f"checkpoint.load_path={step}", f"train.steps={n + 2}"]))
    assert str(e.value).startswith(f"checkpoint.load_path: {step} is damaged ("), str(e.value)
    assert not other.exists()


def test_closing_the_terminal_during_start_up_is_a_graceful_stop(tmp_path):
    """SIGHUP right after the launcher's first line: no traceback, nothing killed by the signal,
    exit 3 (nothing started, so nothing to save)."""
    run_dir = tmp_path / "run"
    rc, _ = on_terminal([*SMALL, f"run.dir={run_dir}", "train.steps=40"], {},
                        lambda shown: "ranks, run.dir=" in shown, timeout=120)
    assert rc == 3, (run_dir / "logs" / "launcher.log").read_text()[-3000:]
    assert "exit code 3" in (run_dir / "logs" / "launcher.log").read_text()


def _file_size_limit(limit: int):
    def setup():  # in the child: a write past `limit` bytes fails with EFBIG instead of killing it
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return setup


def test_a_full_disk_is_one_line(tmp_path):
    """The run dir's disk takes no more (a file-size limit here: EFBIG; a full tmpfs too, where
    this machine lets us mount one: ENOSPC): one line, exit 2, nothing half-written."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "mfsdp_launch", *SMALL, f"run.dir={run_dir}", "train.steps=2"],
                       preexec_fn=_file_size_limit(2000), env=cli_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    line = cli_error(r)
    assert line.startswith("mfsdp-train: error: run.dir: cannot write ") and "File too large" in line, line
    assert not (run_dir / "config.yaml").exists() and not list(run_dir.glob("*.tmp*"))

    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mount.returncode != 0:
        return  # no tmpfs here (needs root): the file-size limit stands for it
    try:
        _fill(disk / "filler")
        r = cli(*SMALL, f"run.dir={disk / 'run'}", "train.steps=2", timeout=120)
        line = cli_error(r)
        assert line.startswith("mfsdp-train: error: run.dir: cannot write ") and "No space left" in line, line
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
