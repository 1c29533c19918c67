"""On GPUs through the CLI: a recipe with launcher.nproc_per_node=auto takes every visible GPU, and
train.profile writes a CUDA trace per rank plus rank 0's top ops by self device time."""

from __future__ import annotations

import gzip
import json

import pytest
from omegaconf import OmegaConf
from test_e2e import cli, fresh_run_dir

from _harness import gpu_count, require_gpus
from mfsdp_launch.components.profiling import PROFILE_DIR, TOP_OPS, trace_name

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_auto_nproc_and_profile_on_gpus():
    require_gpus(1)
    run_dir = fresh_run_dir("profile_auto")
    proc = cli("profile_auto", "+recipe=fsdp_bf16", "model.preset=125m", "train.compile=false", "data=synthetic",
               "train.steps=6",
               "train.seq_len=512", "train.log_interval=1", "checkpoint.save_final=false",
               "train.profile={start: 3, steps: 2}", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    frozen = OmegaConf.load(run_dir / "config.yaml")
    n = gpu_count()
    assert frozen.launcher.nproc_per_node == n and frozen.launcher.nproc_auto == f"{n} visible GPU(s)"
    for rank in range(n):
        with gzip.open(run_dir / PROFILE_DIR / trace_name(rank), "rt") as f:
            events = json.load(f)["traceEvents"]
        assert any(e.get("cat") == "kernel" for e in events), f"rank {rank}: no CUDA kernel in the trace"
    table = (run_dir / PROFILE_DIR / TOP_OPS).read_text()
    assert "by self device (GPU) time, steps 3-4, rank 0" in table and "Self CUDA" in table, table
    assert table.splitlines()[0] in proc.stdout
