"""End to end on GPUs through the CLI (`python -m mfsdp_launch ...`): the bf16 FSDP recipe on the
text corpus (loss falls, metrics.jsonl has MFU against the H200 bf16 peak), a resume of that run
at world size 1, and the HFSDP FP8 recipe (dp_outer=2 x dp_shard=1) on te_gpt."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from _harness import LOG_DIR, ROOT, require_gpus, require_te

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STALL_DUMP_S = 60  # a step that takes longer than this is a hang here
RUNS = Path(os.environ.get("MFSDP_GPU_TEST_LOGS", tempfile.gettempdir())) / "mfsdp_e2e_runs"


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("MFSDP_CACHE_DIR", str(RUNS / "token_cache"))
    return env


def cli(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the CLI with its output streamed to log files, so that a hung run is stopped at
    `timeout` through the launcher (no orphaned ranks left on the GPUs) and its log, with the
    stall watchdog's stack dumps, survives."""
    env = cli_env()
    args = (*args, f"train.stall_dump_s={STALL_DUMP_S}")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"e2e_{name}.log"
    with open(log, "w") as out, open(log.with_suffix(".stderr"), "w") as err:
        out.write(f"$ python -m mfsdp_launch {' '.join(args)}\n")
        out.flush()
        proc = subprocess.Popen([sys.executable, "-m", "mfsdp_launch", *args], cwd=ROOT, env=env,
                                stdout=out, stderr=err, text=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # The launcher's own abort path: a first SIGTERM asks for a graceful stop, a second
            # makes it SIGTERM torchrun's session, and torchrun SIGKILLs ranks that stay stuck.
            for sig, wait in ((signal.SIGTERM, 5), (signal.SIGTERM, 60), (signal.SIGKILL, 10)):
                try:
                    proc.send_signal(sig)
                    proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            code = None
    stdout, stderr = log.read_text(), log.with_suffix(".stderr").read_text()
    print(stdout[-3000:])
    if code is None:
        pytest.fail(f"{name}: no exit after {timeout} s, killed; last stderr (stack dumps):\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(proc.args, code, stdout, stderr)


def fresh_run_dir(name: str) -> Path:
    run_dir = RUNS / name
    shutil.rmtree(run_dir, ignore_errors=True)
    return run_dir


def rows(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _check_training(proc, run_dir, *, min_drop: float):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = rows(run_dir)
    assert len(r) >= 3, r
    first, last = r[0]["loss"], r[-1]["loss"]
    assert math.isfinite(last) and last < first - min_drop, [x["loss"] for x in r]
    for x in r:
        assert x["mfu"] is not None and 0 < x["mfu"] < 1, x
        assert x["tokens_per_s_per_gpu"] > 0 and x["peak_mem_gib"] > 0, x
    return r


FSDP_DIR = RUNS / "fsdp_bf16"


@pytest.mark.multi_gpu
def test_e2e_fsdp_bf16_text():
    require_gpus(2)
    shutil.rmtree(FSDP_DIR, ignore_errors=True)
    proc = cli("fsdp_bf16", "+recipe=fsdp_bf16", "launcher.nproc_per_node=2", "model.preset=125m",
               "train.steps=60", "train.seq_len=1024", "train.log_interval=10", "data.max_bytes=16000000",
               f"run.dir={FSDP_DIR}")
    r = _check_training(proc, FSDP_DIR, min_drop=2.0)
    assert "H200" in proc.stdout or "peak" in proc.stdout
    assert (FSDP_DIR / "checkpoints" / "step_60" / "manifest.json").is_file()
    print(json.dumps(r[-1]))


@pytest.mark.multi_gpu
def test_e2e_resume_fsdp_bf16_at_world_size_1():
    """The 2-rank run's checkpoint resumes on 1 rank (model and optimizer resharded)."""
    require_gpus(1)
    if not (FSDP_DIR / "checkpoints" / "step_60").is_dir():
        pytest.skip("needs test_e2e_fsdp_bf16_text's checkpoint")
    proc = cli("fsdp_bf16_resume_1rank", "+recipe=fsdp_bf16", "launcher.nproc_per_node=1", "model.preset=125m",
               "train.steps=70", "train.seq_len=1024", "train.log_interval=5", "data.max_bytes=16000000",
               f"run.dir={FSDP_DIR}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step_60" in proc.stdout, proc.stdout[-2000:]
    r = rows(FSDP_DIR)
    steps = [x["step"] for x in r]
    assert steps[-1] == 70 and 65 in steps, steps
    before = [x["loss"] for x in r if x["step"] == 60][0]
    after = [x["loss"] for x in r if x["step"] > 60]
    assert all(math.isfinite(a) and a < before + 0.5 for a in after), (before, after)


@pytest.mark.multi_gpu
def test_te_e2e_hfsdp_fp8_text():
    require_gpus(2)
    require_te()
    run_dir = fresh_run_dir("hfsdp_fp8")
    proc = cli("hfsdp_fp8", "+recipe=hfsdp_fp8", "mesh.dp_outer=2", "launcher.nproc_per_node=2", "model.preset=125m",
               "model.params_dtype=bf16", "train.steps=60", "train.seq_len=1024", "train.log_interval=10",
               "data.max_bytes=16000000", "checkpoint.save_final=false", f"run.dir={run_dir}")
    assert "(2, 1, 1, 1)" in proc.stdout, proc.stdout[-2000:]
    _check_training(proc, run_dir, min_drop=2.0)


@pytest.mark.multi_gpu
def test_te_e2e_full_iteration_cuda_graph_cli():
    """train.cuda_graph=full_iteration through the worker: one capture, a replay per step, loss
    falls, and the final checkpoint is written from the graph-mode model."""
    require_gpus(2)
    require_te()
    run_dir = fresh_run_dir("cuda_graph")
    proc = cli("cuda_graph", "+recipe=fsdp_bf16", "launcher.nproc_per_node=2", "model.preset=125m",
               "optim.impl=te_fused", "train.cuda_graph=full_iteration", "train.compile=false", "train.steps=40",
               "train.seq_len=1024", "train.log_interval=10", "data.max_bytes=16000000", f"run.dir={run_dir}",
               timeout=150)
    _check_training(proc, run_dir, min_drop=1.5)
    assert (run_dir / "checkpoints" / "step_40" / "manifest.json").is_file()


@pytest.mark.multi_gpu
def test_te_e2e_fp8_skip_delayed():
    """fp8.skip keeps the output head and the first layer in bf16 under delayed scaling; the run
    says which modules it kept and trains."""
    require_gpus(2)
    require_te()
    run_dir = fresh_run_dir("fp8_skip")
    proc = cli("fp8_skip", "+recipe=hfsdp_fp8", "launcher.nproc_per_node=2", "model.preset=125m",
               "model.params_dtype=bf16", "fp8.recipe=delayed", "fp8.skip=[lm_head,layers.0]",
               "train.steps=40", "train.seq_len=1024", "train.log_interval=10", "data.max_bytes=16000000",
               "checkpoint.save_final=false", f"run.dir={run_dir}", timeout=150)
    assert "fp8.skip: 2 module(s) stay in bf16: layers.0, lm_head" in proc.stdout, proc.stdout[-2000:]
    _check_training(proc, run_dir, min_drop=1.5)


def test_te_fp8_skip_glob_that_matches_nothing_is_refused_before_spawn():
    """On a machine with TE the launcher builds te_gpt on the meta device and checks the globs:
    one line, exit 2, no rank started."""
    require_te()
    run_dir = fresh_run_dir("fp8_skip_refused")
    proc = subprocess.run([sys.executable, "-m", "mfsdp_launch", "+recipe=hfsdp_fp8", "launcher.nproc_per_node=2",
                           "fp8.skip=[lm_head,no_such_layer]", f"run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=cli_env())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "fp8.skip" in proc.stderr and "no_such_layer" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "config.yaml").exists()
