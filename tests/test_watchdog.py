"""The stall watchdog prints the Python stacks of a process stuck in a call, and stays quiet
while steps keep completing."""

import subprocess
import sys
import textwrap


def run(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import time
        from mfsdp_launch.watchdog import StallWatchdog
        wd = StallWatchdog(0.5, label="rank 0: ")
        wd.start()
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_stalled_step_dumps_the_blocked_frame():
    proc = run("""
        def waiting_for_a_collective():
            time.sleep(1.6)
        waiting_for_a_collective()
        wd.stop()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "stall watchdog" in proc.stderr
    assert "waiting_for_a_collective" in proc.stderr
    assert proc.stderr.count("Thread") >= 2  # repeated while the stall lasts


def test_steps_that_keep_completing_dump_nothing():
    proc = run("""
        for _ in range(8):
            time.sleep(0.15)
            wd.arm()
        wd.stop()
        time.sleep(0.8)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "Thread" not in proc.stderr and "File" not in proc.stderr, proc.stderr
