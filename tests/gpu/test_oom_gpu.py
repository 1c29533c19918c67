"""A real CUDA out-of-memory at step 3 (a custom model that asks for 10 TB there), FSDP2 on NCCL over
2 GPUs: the console shows rank/oom.py's one line with the measured peak and the GPU's total, no
traceback, exit code 1; the run leaves no rank on the GPUs (the launcher returns in time)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from _harness import OOM_MODULE, ROOT, require_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]  # 1 GPU: test_one_gpu_features.py


def test_real_cuda_oom_is_one_line(tmp_path):
    require_gpus(2)
    (tmp_path / "oom_gpu_model.py").write_text(textwrap.dedent(OOM_MODULE))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    args = ["engine=fsdp2", "model=custom", "model.target=oom_gpu_model:LM",
            "model.fsdp_unit_modules=[oom_gpu_model.Block]", "data=synthetic", "train.steps=6",
            "train.log_interval=1", "train.progress=false", "train.seq_len=64", "train.micro_batch_size=2",
            "launcher.nproc_per_node=2", "precision.compute_dtype=bf16", "checkpoint.save_final=false",
            f"run.dir={tmp_path / 'run'}"]
    out = subprocess.run([sys.executable, "-m", "mfsdp_launch", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240)
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-3000:]
    lines = [x for x in console.splitlines() if "ran out of GPU memory at step 3" in x]
    assert len(lines) == 1, console[-3000:]  # the root cause's line only
    assert "ran out of GPU memory" in console.strip().splitlines()[-1]  # the summary line's "why"
    assert "GiB reserved, of the GPU's" in lines[0] and "model.activation_checkpointing=full" in lines[0]
    assert "Traceback" not in console, console[-3000:]
