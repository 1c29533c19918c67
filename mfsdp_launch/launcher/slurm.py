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

from ..core.atomic_io import atomic_write_text
from ..core import exit_codes, rundir
from ..core.console import eprint
from ..core.rank_env import DEFAULT_RDZV_PORT_BASE, package_root
from . import jobscript

def gpus_per_node(cfg) -> Optional[int]:
    """launcher.gpus_per_node, else one GPU per process unless the job is CPU-only (gloo)."""
    lc = cfg.launcher
    if lc.gpus_per_node is not None:
        return lc.gpus_per_node or None
    if cfg.engine.backend == "gloo":
        return None
    return lc.nproc_per_node


PREEMPT_SIGNAL_LEAD_S = 120  # SLURM sends SIGUSR1 this long before the time limit (or a preemption)


def sbatch_script(cfg, config_path: Path) -> str:
    """The text of the sbatch script for this frozen config."""
    run_dir = Path(config_path).resolve().parent
    lines = [
        "#!/bin/bash",
        f"# Written by mfsdp-train for run {cfg.run.name!r}. Submit it with: sbatch {run_dir / rundir.SBATCH_SCRIPT}",
        "# run.dir must be on a filesystem every node sees: the workers read its config.yaml and",
        "# write checkpoints there. Re-submitting the script resumes from the newest checkpoint.",
        "# SIGUSR1 (sent 120 s before the time limit) or SIGTERM: the ranks save a checkpoint and stop;",
        "# after SIGUSR1 the job requeues itself and resumes. Exit codes: mfsdp-train --help.",
        *[f"#SBATCH {d}" for d in _directives(cfg, run_dir)],
        "",
        "set -uo pipefail  # not -e: the training step's exit code is judged below",
        f"cd {shlex.quote(os.getcwd())}",
        *_environment(cfg, run_dir),
        "",
        *_lock(run_dir),
        "",
        *_run(cfg, config_path),
    ]
    return "\n".join(lines) + "\n"


def _directives(cfg, run_dir: Path) -> List[str]:
    lc = cfg.launcher
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
                   "--open-mode=append",
                   # B: the signal goes to this script only; it asks the ranks to stop (the STOP file).
                   f"--signal=B:USR1@{PREEMPT_SIGNAL_LEAD_S}",
                   "--requeue"]
    return directives


def _environment(cfg, run_dir: Path) -> List[str]:
    return jobscript.environment(str(run_dir), cfg.launcher.nproc_per_node, "${SLURM_CPUS_ON_NODE:-$(nproc)}",
                                 pythonpath=package_root())


def _lock(run_dir: Path) -> List[str]:
    return jobscript.lock("sbatch job ${SLURM_JOB_ID:-}")


def _run(cfg, config_path: Path) -> List[str]:
    lc = cfg.launcher
    q = shlex.quote
    config = q(str(Path(config_path).resolve()))
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
    rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                  f'--rdzv-id="{rdzv_id}"' if rdzv_id == "$SLURM_JOB_ID" else f"--rdzv-id={q(rdzv_id)}"]
    torchrun = jobscript.node_torchrun(lc, python=q(sys.executable), nnodes='"$SLURM_NNODES"',
                                       rendezvous=rendezvous, config=config)
    return [
        *endpoint_lines,
        *jobscript.stop_traps(["USR1", "TERM"]),
        f'rm -f "$RUN_DIR/{rundir.STOP}"',
        "START=$SECONDS",
        "# One torchrun per node (one task per node); torchrun starts the ranks of its node. In the",
        "# background, so that the signal traps run while it trains.",
        "srun --kill-on-bad-exit=1 \\",
        "  " + " \\\n  ".join(torchrun) + " &",
        *jobscript.wait_and_judge(q(sys.executable), "SRUN_PID", config),
        f'if [ "$CODE" -eq {exit_codes.INTERRUPTED} ] && [ "$STOP_SIGNAL" = USR1 ]; then',
        '  echo "mfsdp-train: requeueing SLURM job $SLURM_JOB_ID: it resumes from the checkpoint" >&2',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$CODE"',
    ]


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
