"""Rank-side process guards and stop requests (issue 17), in real processes: a rank dies with its
parent, and stop signals at any moment become the run dir's STOP request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import cli_env

ENV = cli_env()


def test_a_guarded_process_dies_with_its_parent(tmp_path):
    """parent (a shell) -> child with the guards; SIGKILL the parent: the child is gone at once."""
    pid_file = tmp_path / "child.pid"
    child = (f"from mfsdp_launch.rank.stopping import install_process_guards; install_process_guards(None); "
             f"open({str(pid_file)!r}, 'w').write(str(__import__('os').getpid())); __import__('time').sleep(120)")
    parent = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"{child}\"; sleep 120"], env=ENV)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the child outlived its parent")
        time.sleep(0.05)


def test_stop_signals_at_any_time_become_a_stop_request(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        from mfsdp_launch.rank.stopping import StopControl, install_process_guards
        run_dir = Path({str(tmp_path)!r})
        install_process_guards(run_dir)  # before the loop listens: SIGUSR1 -> the STOP file
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert (run_dir / "STOP").exists()
        (run_dir / "STOP").unlink()
        stop = StopControl(run_dir, rank=1).install()  # the loop's view; rank 1 ignores the file
        assert not stop.requested(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested(2) and stop.reason == "SIGTERM"
        rank0 = StopControl(run_dir, rank=0)
        (run_dir / "STOP").touch()
        assert rank0.requested(3) and rank0.reason == "STOP file"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
