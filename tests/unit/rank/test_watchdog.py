"""The stall watchdog prints the Python stacks of a process stuck in a call, stays quiet while steps
keep completing, never crashes the process it watches (issue 17: it killed ranks with SIGSEGV when
it fired during start-up), and writes the flight recorder's last collectives per rank."""

import pickle
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, cli_env, free_port


def run(body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import time
        from mfsdp_launch.rank.watchdog import StallWatchdog
        wd = StallWatchdog(0.5, label="rank 0: ")
        wd.start()
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)


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
    assert proc.stderr.count("Python stacks") >= 2  # repeated while the stall lasts


def test_steps_that_keep_completing_dump_nothing():
    proc = run("""
        for _ in range(8):
            time.sleep(0.15)
            wd.arm()
        wd.stop()
        time.sleep(0.8)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "Python stacks" not in proc.stderr and "File" not in proc.stderr, proc.stderr


def test_dumping_while_threads_come_and_go_does_not_crash():
    """Start-up creates and ends threads; dumps firing then crashed faulthandler's C-thread dump
    (SIGSEGV). A dump every millisecond during 3 s of thread churn must leave the process alive."""
    code = textwrap.dedent("""
        import threading, time
        from mfsdp_launch.rank.watchdog import StallWatchdog
        wd = StallWatchdog(0.001, label="rank 0: ")
        wd.start()
        def work():
            sum(range(100))
        t0 = time.time()
        while time.time() - t0 < 3:
            threads = [threading.Thread(target=work) for _ in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wd.stop()
        print("alive")
    """)
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, f"exit code {proc.returncode} (-11 is SIGSEGV)"
    assert proc.stdout.strip() == "alive"


WORKER = """
import os, sys, time
import torch, torch.distributed as dist
from mfsdp_launch.rank.watchdog import StallWatchdog
dist.init_process_group("gloo")
rank = dist.get_rank()
wd = StallWatchdog(0.5, label=f"rank {rank}: ", logs_dir=sys.argv[1])
wd.start()
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
    wd.arm()
def stuck_in_all_reduce():
    dist.all_reduce(t)
if rank == 1:
    time.sleep(2.5)  # rank 0 waits for it in the collective: a stall
stuck_in_all_reduce()
wd.stop()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_stall_dumps_stacks_and_the_flight_recorder_per_rank(tmp_path):
    """Two gloo ranks; rank 1 is late to a collective. Rank 0's watchdog prints the frame it is
    blocked in and writes its flight recorder (the launcher turns it on: TORCH_FR_BUFFER_SIZE)."""
    from mfsdp_launch.core.rank_env import diagnostics_env

    script = tmp_path / "stall.py"
    script.write_text(WORKER)
    logs = tmp_path / "logs"
    env = {**cli_env(), **diagnostics_env(None, environ={}), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script), str(logs)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rank 0: stall watchdog: no step for" in r.stderr
    assert "stuck_in_all_reduce" in r.stderr
    dump = logs / "flight_recorder_stall_rank0"
    assert f"flight recorder written to {dump}" in r.stderr
    trace = pickle.loads(dump.read_bytes())
    entries = trace["entries"]
    assert len(entries) >= 4 and all(e["profiling_name"] == "gloo:all_reduce" for e in entries)
    assert entries[-1]["state"] != "completed"  # the collective it is stuck in


GPU_WORKER = """
import os, sys, time
import torch, torch.distributed as dist
from mfsdp_launch.rank.watchdog import StallWatchdog
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
wd = StallWatchdog(1.0, label=f"rank {rank}: ", logs_dir=sys.argv[1])
wd.start()
t = torch.ones(1024, device="cuda")
for _ in range(3):
    dist.all_reduce(t)
torch.cuda.synchronize()
wd.arm()
def stuck_in_all_reduce():
    dist.all_reduce(t)
    torch.cuda.synchronize()  # the GPU waits for rank 1 in NCCL; this thread waits for the GPU
if rank == 1:
    time.sleep(4)
stuck_in_all_reduce()
wd.stop()
dist.destroy_process_group()
"""


@pytest.mark.gpu
def test_an_nccl_stall_dumps_the_nccl_flight_recorder(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from mfsdp_launch.core.rank_env import diagnostics_env

    script = tmp_path / "stall_nccl.py"
    script.write_text(GPU_WORKER)
    logs = tmp_path / "logs"
    env = {**cli_env(), **diagnostics_env(None, environ={}), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(script), str(logs)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stuck_in_all_reduce" in r.stderr
    dump = logs / "flight_recorder_stall_nccl_rank0"
    assert f"flight recorder written to {dump}" in r.stderr, r.stderr[-3000:]
    entries = pickle.loads(dump.read_bytes())["entries"]
    assert any("nccl:all_reduce" in e["profiling_name"] for e in entries), entries[:2]
    assert entries[-1]["state"] != "completed"  # the collective rank 0 waits in
