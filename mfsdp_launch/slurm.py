"""`launcher=slurm`: write a ready sbatch script into run.dir, and submit it when asked.

The script allocates `launcher.nnodes` nodes with one task each; `srun` starts one torchrun per
node, and the torchruns meet through c10d rendezvous on the first node of the allocation. The
workers read the frozen config.yaml from run.dir, so run.dir must be on a filesystem that every
node sees (as it must anyway for checkpoints). No cluster is needed to write the script.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from .atomic_io import atomic_write_text
from . import rundir
from .console import eprint
from .launch import package_root

DEFAULT_RDZV_PORT_BASE = 20000  # the port is derived from the job id: two jobs never share one


def rendezvous_port(job_id) -> int:
    """The c10d port of a SLURM job: derived from its id, so two jobs never share one."""
    return DEFAULT_RDZV_PORT_BASE + int(job_id) % 20000


def first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist like 'gpu[003-004,007],cpu01'."""
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        return prefix + rest.rstrip("]").split(",")[0].split("-")[0]
    return head


def gpus_per_node(cfg) -> Optional[int]:
    """launcher.gpus_per_node, else one GPU per process unless the job is CPU-only (gloo)."""
    lc = cfg.launcher
    if lc.gpus_per_node is not None:
        return lc.gpus_per_node or None
    if cfg.engine.backend == "gloo":
        return None
    return lc.nproc_per_node


def sbatch_script(cfg, config_path: Path) -> str:
    """The text of the sbatch script for this frozen config."""
    lc = cfg.launcher
    run_dir = Path(config_path).resolve().parent
    q = shlex.quote

    directives = [
        f"--job-name={cfg.run.name}",
        f"--nodes={lc.nnodes}",
        "--ntasks-per-node=1",
    ]
    gpus = gpus_per_node(cfg)
    if gpus:
        directives.append(f"--gpus-per-node={gpus}")
    if lc.partition:
        directives.append(f"--partition={lc.partition}")
    if lc.account:
        directives.append(f"--account={lc.account}")
    if lc.time_limit:
        directives.append(f"--time={lc.time_limit}")
    log = f"{run_dir}/slurm-%j.out"
    directives += [f'--output="{log}"' if any(c.isspace() for c in log) else f"--output={log}",
                   "--open-mode=append"]

    if lc.rdzv_endpoint:
        endpoint = q(lc.rdzv_endpoint)
        endpoint_lines: List[str] = []
    else:
        endpoint = '"${HEAD_NODE}:${RDZV_PORT}"'
        endpoint_lines = [
            '# c10d rendezvous on the first node of the allocation, on a port derived from the job id.',
            'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f'RDZV_PORT=$(( {DEFAULT_RDZV_PORT_BASE} + SLURM_JOB_ID % 20000 ))',
        ]
    rdzv_id = lc.rdzv_id or "$SLURM_JOB_ID"
    torchrun = [
        f"{q(sys.executable)} -m torch.distributed.run",
        '--nnodes="$SLURM_NNODES"',
        f"--nproc-per-node={lc.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f'--rdzv-id="{rdzv_id}"' if rdzv_id == "$SLURM_JOB_ID" else f"--rdzv-id={q(rdzv_id)}",
        f"--max-restarts={lc.max_restarts}",
        "-m mfsdp_launch.worker --config " + q(str(Path(config_path).resolve())),
    ]
    lines = [
        "#!/bin/bash",
        f"# Written by mfsdp-train for run {cfg.run.name!r}. Submit it with: sbatch {run_dir / rundir.SBATCH_SCRIPT}",
        "# run.dir must be on a filesystem every node sees: the workers read its config.yaml and",
        "# write checkpoints there. Re-submitting the script resumes from the newest checkpoint.",
        *[f"#SBATCH {d}" for d in directives],
        "",
        "set -euo pipefail",
        f"cd {q(os.getcwd())}",
        f'export PYTHONPATH={q(package_root())}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        "export MFSDP_LAUNCHER=1",
        "export PYTHONUNBUFFERED=1",
        *endpoint_lines,
        "",
        "# One torchrun per node (one task per node); torchrun starts the ranks of its node.",
        "srun --kill-on-bad-exit=1 \\",
        "  " + " \\\n  ".join(torchrun),
        "",
    ]
    return "\n".join(lines)


def write_and_maybe_submit(cfg, config_path: Path) -> int:
    """Write `run.dir/sbatch.sh`; submit it if launcher.submit=true. 0 on success, 2 when sbatch
    is needed but missing, sbatch's exit code if it refused the job."""
    run_dir = Path(config_path).resolve().parent
    script = run_dir / rundir.SBATCH_SCRIPT
    atomic_write_text(script, sbatch_script(cfg, config_path), mode=0o755)
    lc = cfg.launcher
    print(f"mfsdp-train: wrote {script} ({lc.nnodes} node(s) x {lc.nproc_per_node} processes)", flush=True)
    if not lc.submit:
        print(f"mfsdp-train: submit it with: sbatch {shlex.quote(str(script))}"
              "   (or add launcher.submit=true)", flush=True)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        eprint(f"mfsdp-train: error: launcher.submit: sbatch not found on PATH; run "
                f"`sbatch {script}` on a SLURM login node (allowed: false)")
        return 2
    proc = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        eprint(f"mfsdp-train: error: sbatch refused the job (exit code {proc.returncode}): "
                f"{msg[-1] if msg else 'no message'}")
        return proc.returncode
    job_id = proc.stdout.strip().split(";")[0]
    (run_dir / rundir.SLURM_JOB_ID).write_text(job_id + "\n")
    print(f"mfsdp-train: submitted SLURM job {job_id}; log: {run_dir}/slurm-{job_id}.out", flush=True)
    return 0
