"""launcher=slurm: the sbatch script written into run.dir, and submitting it (no cluster needed)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import cli, cli_env, free_port, read_metrics
from mfsdp_launch.core import exit_codes, rank_env
from mfsdp_launch.launcher import slurm
from mfsdp_launch.planner import prepare


def slurm_args(run_dir, *extra):
    return ("+recipe=cpu_smoke", "launcher=slurm", "launcher.nnodes=4", "launcher.nproc_per_node=8",
            "mesh.dp_outer=4", f"run.dir={run_dir}", "run.name=big_job", *extra)


def test_cli_writes_a_ready_sbatch_script(tmp_path):
    run_dir = tmp_path / "run"
    r = cli(*slurm_args(run_dir, "launcher.partition=gpu", "launcher.account=proj42",
                        "launcher.time_limit=01:30:00", "launcher.gpus_per_node=8"), cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    script_path = run_dir / "sbatch.sh"
    assert f"submit it with: sbatch {script_path}" in r.stdout
    assert os.access(script_path, os.X_OK)
    text = script_path.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [ln for ln in lines if ln.startswith("#SBATCH ")]
    assert sbatch == [
        "#SBATCH --job-name=big_job",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --time=01:30:00",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --requeue",
    ]
    # SBATCH directives must come before the first command, or sbatch ignores them.
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH")) < first_cmd
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    cmd = " ".join(ln.rstrip("\\").strip() for ln in text[text.index("srun "):].splitlines())
    assert cmd.startswith("srun ")
    for part in (f"{sys.executable} -m torch.distributed.run", '--nnodes="$SLURM_NNODES"',
                 "--nproc-per-node=8", "--rdzv-backend=c10d", '--rdzv-endpoint="${HEAD_NODE}:${RDZV_PORT}"',
                 '--rdzv-id="$SLURM_JOB_ID"', '--log-dir="$RUN_DIR/logs" --tee=3',
                 f"-m mfsdp_launch.rank --config {run_dir}/config.yaml"):
        assert part in cmd, part
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$THREADS}"' in text
    assert "SLURM_CPUS_ON_NODE" in text and "/ 8 ))" in text  # the node's CPUs over its 8 ranks
    # The frozen config the workers read is there, with the resolved run.dir and mesh.
    cfg_text = (run_dir / "config.yaml").read_text()
    assert f"dir: {run_dir}" in cfg_text and "nnodes: 4" in cfg_text
    # Nothing ran: no torchrun, no metrics.
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "launch_cmd.txt").exists()


def test_script_syntax_is_valid_bash(tmp_path):
    cfg, _ = prepare(list(slurm_args(tmp_path / "r")), check_hardware=False)
    (tmp_path / "r").mkdir()
    path = tmp_path / "r" / "sbatch.sh"
    path.write_text(slurm.sbatch_script(cfg, tmp_path / "r" / "config.yaml"))
    import subprocess

    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_optional_directives_and_cpu_jobs(tmp_path):
    cfg, _ = prepare(["+recipe=cpu_smoke", "launcher=slurm", "launcher.nnodes=2", "engine.backend=gloo",
                      f"run.dir={tmp_path}", "launcher.rdzv_endpoint=head01:29400", "launcher.rdzv_id=myrun"],
                     check_hardware=False)
    text = slurm.sbatch_script(cfg, tmp_path / "config.yaml")
    assert "--gpus-per-node" not in text  # gloo: a CPU job asks for no GPUs
    assert "--partition" not in text and "--account" not in text
    assert "--rdzv-endpoint=head01:29400" in text and "--rdzv-id=myrun" in text
    assert "HEAD_NODE" not in text
    cfg.engine.backend = None
    assert "#SBATCH --gpus-per-node=2" in slurm.sbatch_script(cfg, tmp_path / "config.yaml")  # one per process


def test_submit_without_sbatch_is_one_line_exit_2(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    r = cli(*slurm_args(tmp_path / "run", "launcher.submit=true"), cwd=tmp_path, timeout=120,
            env={"PATH": str(empty_bin)})
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mfsdp-train: error: launcher.submit: sbatch not found"), r.stderr
    assert (tmp_path / "run" / "sbatch.sh").is_file()  # written anyway, to submit elsewhere


def test_submit_with_sbatch(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    sbatch = fake_bin / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/sbatch_args\necho '4242;cluster'\n")
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IXUSR)
    run_dir = tmp_path / "run"
    r = cli(*slurm_args(run_dir, "launcher.submit=true"), cwd=tmp_path, timeout=120,
            env={"PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert r.returncode == 0, r.stderr
    assert "submitted SLURM job 4242" in r.stdout
    assert (run_dir / "slurm_job_id").read_text().strip() == "4242"
    assert (tmp_path / "sbatch_args").read_text().split() == ["--parsable", str(run_dir / "sbatch.sh")]


def test_sbatch_refusal_is_reported(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    sbatch = fake_bin / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n")
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IXUSR)
    r = cli(*slurm_args(tmp_path / "run", "launcher.submit=true", "launcher.partition=nope"), cwd=tmp_path,
            timeout=120, env={"PATH": f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].endswith("invalid partition specified: nope")


def test_dry_run_does_not_write_a_script(tmp_path):
    r = cli(*slurm_args(tmp_path / "run", "launcher.dry_run=true"), cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "world=32 (4 node(s) x 8)" in r.stdout
    assert not (tmp_path / "run" / "sbatch.sh").exists()


@pytest.mark.parametrize("nodelist,first", [("gpu[003-004,007],cpu01", "gpu003"), ("node7", "node7")])
def test_worker_reads_the_slurm_nodelist(nodelist, first):
    """Under a bare srun (no torchrun) the worker takes its rank/world from SLURM's environment."""
    assert rank_env.first_host(nodelist) == first


def test_worker_env_under_a_bare_srun():
    from unittest import mock

    from mfsdp_launch.rank.runtime import dist_env as _dist_env

    slurm_env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                 "SLURM_JOB_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "123"}
    # patch.dict restores os.environ as a whole afterwards, also removing the RANK/MASTER_* keys
    # that _dist_env adds (leaked, they would turn every later CLI call into a "worker").
    with mock.patch.dict(os.environ, slurm_env):
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(k, None)
        assert _dist_env() == (5, 1, 8)
        assert os.environ["MASTER_ADDR"] == "gpu003" and os.environ["MASTER_PORT"] == str(20000 + 123)


# --- preemption: the script run by bash with stub srun/scontrol (no cluster) -------------------

STUB_SRUN = """#!/bin/sh
# srun stand-in: drop srun's options, run the command (one node, here).
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
exec "$@"
"""
STUB_SCONTROL = """#!/bin/sh
echo "$@" >> "{log}"
"""


def stub_cluster(tmp_path: Path) -> tuple:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL.format(log=calls))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**cli_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "SLURM_JOB_ID": "777",
           "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_CPUS_ON_NODE": "2"}
    return env, calls


def steps_in(run_dir: Path) -> list:
    return [r["step"] for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_usr1_saves_a_checkpoint_exits_interrupted_and_requeues_then_the_job_resumes(tmp_path):
    """SLURM's `--signal=B:USR1@120` before the time limit: the script asks the ranks to stop (they
    save), judges the run interrupted (exit 3) and requeues the job; run again (the requeue), it
    resumes from that checkpoint and finishes."""
    run_dir = tmp_path / "run"
    small = ["model.preset=tiny", "train.seq_len=64", "data.max_bytes=2000000", "train.log_interval=1",
             "train.grad_accum_steps=1", "train.micro_batch_size=2", "train.progress=false"]
    r = cli("+recipe=cpu_smoke", "launcher=slurm", "engine.backend=gloo", f"run.dir={run_dir}", "train.steps=400",
            f"launcher.rdzv_endpoint=127.0.0.1:{free_port()}", *small, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    script = run_dir / "sbatch.sh"
    env, calls = stub_cluster(tmp_path)
    log = open(tmp_path / "job.out", "w")
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(steps_in(run_dir)) < 2:
            assert job.poll() is None, (tmp_path / "job.out").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert json.loads((run_dir / "run.lock").read_text())["command"] == "sbatch job 777"
        job.send_signal(signal.SIGUSR1)  # B: to the batch shell only
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    out = (tmp_path / "job.out").read_text()
    assert job.returncode == exit_codes.INTERRUPTED, out[-3000:]
    stopped = steps_in(run_dir)[-1]
    assert stopped < 400 and (run_dir / "checkpoints" / f"step_{stopped}" / "manifest.json").is_file()
    assert calls.read_text().split() == ["requeue", "777"]
    assert f"interrupted at step {stopped}/400" in out and "Traceback" not in out
    assert not (run_dir / "run.lock").exists()
    assert len(list((run_dir / "logs").rglob("stdout.log"))) == 2  # each rank's output, via torchrun --tee

    # The requeued job: the same script, fewer steps to go (train.steps is in the frozen config,
    # so shorten the run by editing it the way a user would re-submit with more or fewer steps).
    cfg = (run_dir / "config.yaml").read_text().replace("steps: 400", f"steps: {stopped + 1}")
    (run_dir / "config.yaml").write_text(cfg)
    again = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == exit_codes.OK, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from step {stopped}" in again.stdout
    assert steps_in(run_dir)[-1] == stopped + 1
    assert calls.read_text().split() == ["requeue", "777"]  # no second requeue
