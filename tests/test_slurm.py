"""launcher=slurm: the sbatch script written into run.dir, and submitting it (no cluster needed)."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from conftest import cli
from mfsdp_launch import slurm
from mfsdp_launch.config import prepare


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
    ]
    # SBATCH directives must come before the first command, or sbatch ignores them.
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH")) < first_cmd
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    cmd = " ".join(ln.rstrip("\\").strip() for ln in text[text.index("srun "):].splitlines())
    assert cmd.startswith("srun ")
    for part in (f"{sys.executable} -m torch.distributed.run", '--nnodes="$SLURM_NNODES"',
                 "--nproc-per-node=8", "--rdzv-backend=c10d", '--rdzv-endpoint="${HEAD_NODE}:${RDZV_PORT}"',
                 '--rdzv-id="$SLURM_JOB_ID"', f"-m mfsdp_launch.worker --config {run_dir}/config.yaml"):
        assert part in cmd, part
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
    assert slurm.first_host(nodelist) == first


def test_worker_env_under_a_bare_srun():
    from unittest import mock

    from mfsdp_launch.runtime import dist_env as _dist_env

    slurm_env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                 "SLURM_JOB_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "123"}
    # patch.dict restores os.environ as a whole afterwards, also removing the RANK/MASTER_* keys
    # that _dist_env adds (leaked, they would turn every later CLI call into a "worker").
    with mock.patch.dict(os.environ, slurm_env):
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            os.environ.pop(k, None)
        assert _dist_env() == (5, 1, 8)
        assert os.environ["MASTER_ADDR"] == "gpu003" and os.environ["MASTER_PORT"] == str(20000 + 123)
