"""run.dir before anything runs (issue 17): unusable directories and empty values are one line
with exit code 2; the lock names a live holder and takes over a dead one's. Real launcher
processes (launcher=slurm takes the lock and writes its script without starting torch)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from helpers import cli, cli_env, cli_error
from mfsdp_launch.core import rundir


def test_run_dir_that_is_a_file(tmp_path):
    target = tmp_path / "afile"
    target.write_text("x")
    line = cli_error(cli("+recipe=cpu_smoke", f"run.dir={target}", timeout=120))
    assert f"run.dir: {target} exists and is not a directory" in line
    assert target.read_text() == "x"


def test_run_dir_that_cannot_be_created():
    line = cli_error(cli("+recipe=cpu_smoke", "run.dir=/proc/mfsdp_x", timeout=120))
    assert line.startswith("mfsdp-train: error: run.dir: cannot create /proc/mfsdp_x")


def test_run_dir_below_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = cli_error(cli("+recipe=cpu_smoke", f"run.dir={tmp_path}/afile/run", timeout=120))
    assert "is not a directory" in line


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this user cannot write: a read-only tmpfs for root, chmod 555 for others."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"root cannot mount a read-only tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", str(d)], capture_output=True)


def test_run_dir_that_is_read_only(read_only_dir):
    line = cli_error(cli("+recipe=cpu_smoke", f"run.dir={read_only_dir}/run", timeout=120))
    assert f"run.dir: {read_only_dir} is not writable" in line


@pytest.mark.parametrize("value", ["", "' '"])
def test_empty_run_dir_is_refused(tmp_path, value):
    line = cli_error(cli("+recipe=cpu_smoke", f"run.dir={value}", cwd=tmp_path, timeout=120))
    assert "run.dir: is empty" in line
    assert list(tmp_path.iterdir()) == []  # nothing written into the current directory


def test_run_dir_with_a_tilde_is_the_home_directory(tmp_path):
    r = cli("+recipe=cpu_smoke", "launcher=slurm", "run.dir=~/mfsdp_tilde_run", cwd=tmp_path, timeout=120,
            env={"HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "home" / "mfsdp_tilde_run" / "sbatch.sh").is_file()
    assert not (tmp_path / "~").exists()


def slurm_run(run_dir, **kw):
    return cli("+recipe=cpu_smoke", "launcher=slurm", f"run.dir={run_dir}", timeout=120, **kw)


def test_a_live_holder_is_named_and_nothing_is_written(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from mfsdp_launch.launcher.runlock import RunLock; "
        f"lock = RunLock({str(run_dir)!r}, command='holder').acquire(); print('held', flush=True); "
        "sys.stdin.read(); lock.release()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=cli_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        line = cli_error(slurm_run(run_dir))
        assert f"run.dir: {run_dir} is in use by pid {holder.pid} on host {socket.gethostname()}" in line
        assert "(holder)" in line
        assert not (run_dir / rundir.CONFIG).exists() and not (run_dir / rundir.SBATCH_SCRIPT).exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert not (run_dir / rundir.LOCK).exists()  # released (and removed) by its holder
    assert slurm_run(run_dir).returncode == 0


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / rundir.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                                   "command": "mfsdp-train old"}))
    r = slurm_run(run_dir)
    assert r.returncode == 0, r.stderr
    assert f"warning: taking over {run_dir / rundir.LOCK} left by pid {dead.pid}" in r.stderr
    assert "no longer running" in r.stderr
    assert (run_dir / rundir.SBATCH_SCRIPT).is_file()
    assert not (run_dir / rundir.LOCK).exists()


def test_lock_records_its_holder_and_other_nodes_lock_their_own_file(tmp_path):
    from mfsdp_launch.launcher.runlock import RunLock

    with RunLock(tmp_path, command="me") as lock:
        record = json.loads((tmp_path / rundir.LOCK).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert lock.flock
        with RunLock(tmp_path, node_rank=1):  # node 1 of the same job, same run dir
            assert (tmp_path / f"{rundir.LOCK}.node1").is_file()
    assert not list(tmp_path.iterdir())
