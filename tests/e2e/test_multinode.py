"""More than one node: c10d rendezvous between two launcher processes on this host (two
"nodes" of 2 CPU ranks, an HSDP mesh across them), and the dry run's cross-node warnings."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import cli, free_port, read_metrics, start_cli

SMALL = ["model.preset=tiny", "train.seq_len=64", "data.max_bytes=2000000", "train.log_interval=1",
         "train.grad_accum_steps=1", "train.micro_batch_size=2"]


def test_dry_run_warns_when_dp_shard_spans_nodes():
    r = cli("+recipe=cpu_smoke", "launcher.nnodes=2", "launcher.nproc_per_node=2",
            "launcher.rdzv_endpoint=127.0.0.1:29400", "mesh.dp_outer=1", "mesh.dp_shard=4",
            "launcher.dry_run=true", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "warning: mesh.dp_shard=4 groups span 2 nodes (nproc_per_node=2)" in r.stdout
    assert "world=4 (2 node(s) x 2)" in r.stdout


def test_dry_run_hsdp_across_nodes_has_no_warning():
    r = cli("+recipe=cpu_smoke", "launcher.nnodes=2", "launcher.nproc_per_node=2",
            "launcher.rdzv_endpoint=127.0.0.1:29400", "mesh.dp_outer=2", "mesh.dp_shard=2",
            "launcher.dry_run=true", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no warnings" in r.stdout and "span" not in r.stdout


def test_more_than_one_node_needs_a_rendezvous_endpoint():
    r = cli("+recipe=cpu_smoke", "launcher.nnodes=2", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("mfsdp-train: error: launcher.rdzv_endpoint: is needed with launcher.nnodes=2 "
                                "(allowed: host:port of node 0, the same on every node)")


def _start(args, log: Path):
    f = open(log, "w")
    return start_cli(*args, stdout=f, stderr=subprocess.STDOUT), f


def _stop(proc) -> None:
    """Our launcher: the first SIGTERM asks for a graceful stop, the second aborts torchrun."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def two_nodes(tmp_path: Path, run_dir: Path, steps: int, tag: str, timeout: float = 240, nproc: int = 2) -> str:
    """Both "nodes" of one job on this host, `nproc` ranks each (dp_outer=2 across them, dp_shard=nproc
    within); returns their combined output."""
    port = free_port()  # never a fixed port: the OS picks a free one
    common = ["+recipe=cpu_smoke", "engine=fsdp2", "launcher.nnodes=2", f"launcher.nproc_per_node={nproc}",
              f"launcher.rdzv_endpoint=127.0.0.1:{port}", "mesh.dp_outer=2", f"mesh.dp_shard={nproc}",
              f"run.dir={run_dir}", f"train.steps={steps}", "checkpoint.interval=2", *SMALL]
    logs = [tmp_path / f"{tag}_node{i}.log" for i in range(2)]
    procs = []
    try:
        procs.append(_start([*common, "launcher.node_rank=0"], logs[0]))
        # Node 1 starts once node 0 has frozen its config into the shared run dir (both write it).
        deadline = time.monotonic() + 60
        while "ranks, run.dir=" not in logs[0].read_text() and time.monotonic() < deadline:
            if procs[0][0].poll() is not None:
                break
            time.sleep(0.2)
        procs.append(_start([*common, "launcher.node_rank=1"], logs[1]))
        end = time.monotonic() + timeout
        for p, _ in procs:
            p.wait(timeout=max(1, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p, f in procs:
            _stop(p)
            f.close()
    out = "\n".join(f"--- node {i} ---\n" + log.read_text() for i, log in enumerate(logs))
    codes = [p.returncode for p, _ in procs]
    assert codes == [0, 0], f"exit codes {codes}\n{out[-6000:]}"
    return out


@pytest.mark.slow
def test_two_nodes_on_one_host_train_checkpoint_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    out = two_nodes(tmp_path, run_dir, steps=4, tag="first")
    assert out.count("mfsdp-train: 2x2 ranks") == 2
    assert "mesh (2, 2, 1, 1)" in out  # HSDP: dp_outer=2 across the nodes, dp_shard=2 within
    assert "starting fresh" in out
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "step_4" / "manifest.json").is_file()
    manifest = json.loads((run_dir / "checkpoints" / "step_4" / "manifest.json").read_text())
    assert manifest["step"] == 4

    # Both nodes again, for more steps: they resume from the committed step 4. One rank per node
    # this time (every rank is a torch import): the rendezvous and the resume are still across the
    # two launchers, and the 2x2 checkpoint reshards onto the 2x1 mesh.
    out = two_nodes(tmp_path, run_dir, steps=6, tag="second", nproc=1)
    assert out.count("mfsdp-train: 2x1 ranks") == 2
    assert "resuming from step 4" in out, out[-4000:]
    assert "world size 4 -> 2 (DCP reshards model and optimizer)" in out
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 for r in rows)
    assert (run_dir / "checkpoints" / "step_6" / "manifest.json").is_file()
