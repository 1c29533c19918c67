"""Out of GPU memory at run time: a real run whose model raises torch.cuda.OutOfMemoryError (a real
exception class on CPU torch) at step 3 shows one line and the summary line on the console, not a
traceback; the traceback stays in run.dir/logs; exit code 1 (failed). Plus the recognizer."""

from __future__ import annotations

import pytest

from helpers import USER_MODULE_NAME, cli, write_user_module

torch = pytest.importorskip("torch")

from mfsdp_launch.core import exit_codes  # noqa: E402
from mfsdp_launch.planner.memory import HINT  # noqa: E402
from mfsdp_launch.rank.oom import LINE_RE, is_oom, note_step, oom_line  # noqa: E402

MODULE_NAME = "mfsdp_test_oom_model"
OOM_MODULE = f'''
import torch
from {USER_MODULE_NAME} import LM


class OOMAtStep3(LM):
    def __init__(self):
        super().__init__(256, 16, 2)
        self.calls = 0

    def forward(self, input_ids):
        self.calls += 1
        if self.calls == 3:  # step 3 (one micro-batch per step)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                              "total capacity of 139.81 GiB of which 1.2 GiB is free.")
        return super().forward(input_ids)
'''


def test_oom_is_one_line_on_the_console(tmp_path):
    folder = tmp_path / "code"
    env = write_user_module(folder)  # the sample model, which this one extends
    write_user_module(folder, OOM_MODULE, name=MODULE_NAME)
    run_dir = tmp_path / "run"
    out = cli("+recipe=cpu_smoke", "model=custom", f"model.target={MODULE_NAME}:OOMAtStep3",
              f"model.fsdp_unit_modules=[{USER_MODULE_NAME}.Block]", "train.grad_accum_steps=1", "train.steps=6",
              "train.log_interval=1", "train.progress=false", "train.seq_len=32", "data=synthetic",
              "checkpoint.save_final=false", f"run.dir={run_dir}", env=env, timeout=300)
    console = out.stdout + out.stderr
    assert out.returncode == exit_codes.FAILED, console[-3000:]
    lines = [x for x in console.splitlines() if LINE_RE.match(x)]
    assert len(lines) == 1, console[-3000:]
    assert "at step 3" in lines[0] and HINT in lines[0] and "2.00 GiB" in lines[0], lines[0]
    assert "Traceback" not in console, console[-3000:]
    assert "ran out of GPU memory" in console.strip().splitlines()[-1]  # the summary line says why
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank*.stderr.log"))
    assert "Traceback" in logs and "OutOfMemoryError" in logs


def test_recognizes_oom_texts_and_not_others():
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert is_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert is_oom(RuntimeError("NCCL error in: ...: unhandled cuda error, NCCL version 2.27: out of memory"))
    wrapped = RuntimeError("checkpoint save failed")
    wrapped.__cause__ = torch.cuda.OutOfMemoryError("CUDA out of memory.")
    assert is_oom(wrapped)
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(MemoryError("host out of memory"))


def test_line_names_the_step_or_its_absence():
    exc = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
    assert "outside a training step" in oom_line(exc, 0)
    note_step(exc, 7)
    note_step(exc, 9)  # the innermost (first) note wins
    line = oom_line(exc, 1, estimate_gib=150.0)
    assert LINE_RE.match(line) and "at step 7" in line and "512.00 MiB" in line and "~150.0 GiB" in line
    assert "\n" not in line
