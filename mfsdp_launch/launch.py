"""Launch a composed config: validate it, freeze it into run.dir, then hand off to torchrun (or
write an sbatch script). Shared by the CLI and by sweep jobs. Imports no torch."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

from . import rundir
from .console import eprint


def check(cfg) -> List[str]:
    """Resolve and validate a composed config; returns its warnings, raises ConfigError."""
    from .config.resolve import resolve
    from .config.validate import validate

    resolve(cfg)

    # A dry run is prepared on a machine that need not run it, and it resumes nothing.
    warnings = validate(cfg, check_hardware=not cfg.launcher.dry_run)
    if not cfg.launcher.dry_run:
        _preflight(cfg)
    return warnings


def run_checked(cfg, warnings: List[str], overrides: List[str]) -> int:
    """Show the dry run, or print the warnings and launch: a config that passed `check`."""
    if cfg.launcher.dry_run:
        from .dryrun import render

        render(cfg, warnings)
        return 0
    for w in warnings:
        eprint(f"mfsdp-train: warning: {w}")
    return launch(cfg, overrides)


def _preflight(cfg) -> None:
    """Checks that need the run directory (resume compatibility), still before spawning."""
    from .checkpoint import preflight

    preflight(cfg)


def prepare_run_dir(cfg, overrides: List[str]) -> Path:
    from .config.compose import save_frozen

    run_dir = Path(cfg.run.dir).expanduser().resolve()
    cfg.run.dir = str(run_dir)
    path = save_frozen(cfg, run_dir, overrides)
    (run_dir / rundir.STOP).unlink(missing_ok=True)
    return path


def torchrun_command(launcher_cfg, config_path: Path) -> List[str]:
    lc = launcher_cfg
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={lc.nproc_per_node}"]
    if lc.nnodes == 1 and not lc.rdzv_endpoint:
        cmd.append("--standalone")  # c10d on a free port: nothing fixed, nothing to collide
    else:
        rdzv_id = lc.rdzv_id or Path(config_path).parent.name
        cmd += [f"--nnodes={lc.nnodes}", f"--node-rank={lc.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={lc.rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    cmd += [f"--max-restarts={lc.max_restarts}", "-m", "mfsdp_launch.worker", "--config", str(config_path)]
    return cmd


def worker_env(launcher_cfg) -> dict:
    env = dict(os.environ)
    from .hardware import cpu_count

    # torchrun would pin 1 thread per rank with a warning; share the cores out instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count() // launcher_cfg.nproc_per_node)))
    env["MFSDP_LAUNCHER"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONPATH"] = package_root() + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def package_root() -> str:
    """The folder holding this package (a source checkout or site-packages): put on the workers'
    PYTHONPATH so that they import this package the way the launcher did."""
    return str(Path(__file__).resolve().parent.parent)


def launch(cfg, overrides: List[str]) -> int:
    config_path = prepare_run_dir(cfg, overrides)
    run_dir = config_path.parent
    if cfg.launcher.kind == "slurm":
        from .slurm import write_and_maybe_submit

        return write_and_maybe_submit(cfg, config_path)
    cmd = torchrun_command(cfg.launcher, config_path)
    print(f"mfsdp-train: {cfg.launcher.nnodes}x{cfg.launcher.nproc_per_node} ranks, run.dir={run_dir}",
          flush=True)
    with open(run_dir / rundir.LAUNCH_CMD, "w") as f:
        f.write(shlex.join(cmd) + "\n")
    # Its own session: a Ctrl-C reaches only us; we turn it into a graceful stop request.
    proc = subprocess.Popen(cmd, env=worker_env(cfg.launcher), start_new_session=True)
    requests = {"n": 0}

    def on_signal(signum, _frame):
        requests["n"] += 1
        if requests["n"] == 1:
            (run_dir / rundir.STOP).touch()
            eprint(f"mfsdp-train: {signal.Signals(signum).name}: finishing the step, saving a "
                    "checkpoint and stopping (signal again to abort)")
        else:
            eprint("mfsdp-train: aborting")
            os.killpg(proc.pid, signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - handler above normally runs
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if rc != 0:
        eprint(f"mfsdp-train: training failed (torchrun exit code {rc}); logs above, run.dir={run_dir}")
    return rc
