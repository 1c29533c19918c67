"""Shell pieces shared by the scripts that run training on scheduled nodes: SLURM's sbatch script
(launcher/slurm.py) and a Kubernetes pod's command (launcher/kubernetes.py). Both run the same
node command: torchrun starting this node's ranks of `-m mfsdp_launch.rank --config
$RUN_DIR/config.yaml`; both turn a signal into the STOP file (the ranks save and stop) and judge
the run from what it left in the run dir (`launcher.runstate`)."""

from __future__ import annotations

import shlex
from typing import Dict, List, Optional

from ..core import exit_codes, rundir
from ..core.rank_env import diagnostics_env, rank_module
from .output import PREFIX_TEMPLATE


def environment(run_dir: str, nproc: int, cpus: str, pythonpath: Optional[str] = None,
                extra: Optional[Dict[str, str]] = None) -> List[str]:
    """RUN_DIR and the ranks' environment; `cpus`: a shell expression for the node's CPU count."""
    q = shlex.quote
    lines = [f'export PYTHONPATH={q(pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"'] if pythonpath else []
    lines += [
        "export MFSDP_LAUNCHER=1",
        "export PYTHONUNBUFFERED=1",
        f"RUN_DIR={q(run_dir)}",
        "# The node's CPUs shared out among its ranks (torchrun would pin 1 thread each).",
        f'THREADS=$(( {cpus} / {nproc} )); [ "$THREADS" -ge 1 ] || THREADS=1',
        'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$THREADS}"',
        f"export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE={q(PREFIX_TEMPLATE)}",
        "# Flight recorder on: the last collectives of each rank, dumped into $RUN_DIR/logs on a stall.",
    ]
    for key, value in {**diagnostics_env(run_dir, environ={}), **(extra or {})}.items():
        if value.startswith(run_dir):
            value = "$RUN_DIR" + value[len(run_dir):]  # no quoting trouble with odd paths
        lines.append(f'export {key}="{value}"' if key == "MFSDP_RUN_DIR" else f'export {key}="${{{key}:-{value}}}"')
    return lines


def lock(holder: str) -> List[str]:
    """The job owns run.dir while it runs, as `mfsdp-train` does (runlock): flock on run.lock.
    `holder`: shell words printed as the record's command (expanded inside double quotes)."""
    busy = 75
    return [
        "# One owner per run dir: hold run.lock (flock) while the job runs.",
        "if command -v flock >/dev/null; then",
        f'  exec 9>>"$RUN_DIR/{rundir.LOCK}"',
        f"  flock -n -E {busy} 9; LOCK_RC=$?",
        f'  if [ "$LOCK_RC" -eq {busy} ]; then',
        f'    echo "mfsdp-train: error: run.dir: $RUN_DIR is in use by $(cat "$RUN_DIR/{rundir.LOCK}") '
        f'(allowed: wait for that run to end, or another run.dir)" >&2',
        f"    exit {exit_codes.CONFIG}",
        '  elif [ "$LOCK_RC" -eq 0 ]; then',
        f'    printf \'{{"host": "%s", "pid": %d, "command": "%s"}}\\n\' "$(hostname)" $$ '
        f'"{holder}" > "$RUN_DIR/{rundir.LOCK}"',
        f'    trap \'rm -f "$RUN_DIR/{rundir.LOCK}"\' EXIT',
        "  fi",
        "fi",
    ]


def node_torchrun(lc, *, python: str, nnodes: str, rendezvous: List[str], config: str) -> List[str]:
    """The node command's words: torchrun for this node's launcher.nproc_per_node ranks of the
    frozen config `config` (a shell word)."""
    return [
        f"{python} -m torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={lc.nproc_per_node}",
        *rendezvous,
        '--log-dir="$RUN_DIR/logs" --tee=3',
        f"--max-restarts={lc.max_restarts}",
        f"-m {rank_module()} --config {config}",
    ]


def stop_traps(signals: List[str]) -> List[str]:
    """Each signal touches the STOP file: the ranks finish their step, save a checkpoint and stop."""
    return [
        "STOP_SIGNAL=",
        f'stop_request() {{ STOP_SIGNAL=$1; TRAPPED=1; touch "$RUN_DIR/{rundir.STOP}"; '
        'echo "mfsdp-train: SIG$1: the ranks finish their step, save a checkpoint and stop" >&2; }',
        *[f"trap 'stop_request {s}' {s}" for s in signals],
    ]


def wait_and_judge(python: str, pid: str, config: str) -> List[str]:
    """Wait for the node command (in the background, so that the traps run while it trains), then
    print the run's summary line; CODE is the launch's exit code."""
    return [
        f"{pid}=$!",
        "while :; do  # a trapped signal interrupts `wait`: wait again for the command's own exit code",
        f'  TRAPPED=0; wait "${pid}"; RC=$?',
        '  [ "$TRAPPED" = 1 ] && [ "$RC" -gt 128 ] || break',
        "done",
        f'{python} -m mfsdp_launch.launcher.runstate {config} "$RC" ${{STOP_SIGNAL:+--stop-requested}} '
        '--wall-s "$((SECONDS - START))"',
        "CODE=$?",
    ]
