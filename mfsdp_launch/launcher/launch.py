"""Launch a composed config: validate it, take the run dir, freeze the config into it, then hand
off to torchrun (or write an sbatch script). Shared by the CLI and by sweep jobs. Imports no torch.

The exit code (`exit_codes`) is judged from what the run left on disk, and the run ends with one
summary line (`runstate.summary_line`).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, List, Optional

from ..core import exit_codes, rundir, storage
from ..core.rank_env import diagnostics_env, package_root, rank_module
from ..core.console import eprint
from ..core.errors import ConfigError
from ..core.schema import KUBERNETES_KINDS, SCHEDULED_KINDS, LauncherKind



@dataclass
class Checked:
    """A config that passed `check`: its mesh degrees (built once) and its warnings."""

    dims: Any
    warnings: List[str]


def check(cfg) -> Checked:
    """Resolve and validate a composed config, raises ConfigError."""
    from ..planner.resolve import resolve
    from ..planner.validate import validate
    from .runlock import check_run_dir

    dims = resolve(cfg)

    # A dry run is prepared on a machine that need not run it, and it resumes nothing.
    if storage.is_remote(cfg.run.dir):  # an object store: this machine's side is run.local_dir
        cfg.run.dir = storage.check_url(str(cfg.run.dir))
        local = cfg.run.local_dir or storage.default_local_dir(cfg.run.dir)
        cfg.run.local_dir = local if cfg.launcher.dry_run else str(check_run_dir(local))
    elif cfg.launcher.dry_run:
        check_run_dir_text(cfg.run.dir)
    else:
        cfg.run.dir = str(check_run_dir(cfg.run.dir))
    warnings = validate(cfg, dims, check_hardware=not cfg.launcher.dry_run)
    _check_data_bytes(cfg)
    if not cfg.launcher.dry_run:
        _preflight(cfg)
    return Checked(dims, warnings)


def _check_data_bytes(cfg) -> None:
    """Prepared shards against their manifests (sizes, sampled checksums): a damaged file is one
    line before spawning (data/check.py)."""
    from ..data import check_data_integrity

    check_data_integrity(cfg.data)


def _ready_text_cache(cfg) -> None:
    """data=text: build the token cache once here, or rebuild a damaged one (text.py verifies it),
    before the ranks open it."""
    if str(cfg.data.name) == "text":
        from ..data import build_token_cache

        build_token_cache(cfg.data)


def check_run_dir_text(value) -> None:
    if value is None or not str(value).strip():
        raise ConfigError("run.dir", "is empty", "a directory path, e.g. run.dir=runs/my_run")


def run_checked(cfg, checked: Checked, overrides: List[str]) -> int:
    """Show the dry run, or print the warnings and launch: a config that passed `check`."""
    if cfg.launcher.dry_run:
        from ..planner.dryrun import render

        render(cfg, checked.warnings, dims=checked.dims)
        return exit_codes.OK
    for w in checked.warnings:
        eprint(f"mfsdp-train: warning: {w}")
    return launch(cfg, overrides)


def _preflight(cfg) -> None:
    """Checks that need the run directory (resume compatibility), still before spawning."""
    from ..checkpoint import preflight

    preflight(cfg)


def prepare_run_dir(cfg, overrides: List[str]) -> Path:
    from ..planner.compose import save_frozen

    from ..checkpoint import clean_stale
    from ..checkpoint.aside import before_start

    run_dir = storage.path(cfg.run.dir).expanduser().resolve()
    cfg.run.dir = str(run_dir)
    local = storage.local_run_dir(cfg.run)  # run_dir, or this machine's side of an object store
    # Stale saves first: on a disk a crashed save filled, they hold the space config.yaml needs.
    clean_stale(run_dir)
    # An earlier run's files this run would replace go to run.dir/previous/<n>/, never away.
    moved = before_start(cfg.checkpoint, run_dir)
    if moved:
        print(f"mfsdp-train: {moved}", flush=True)
    path = save_frozen(cfg, local, overrides)  # the ranks read it here
    if local != run_dir:  # and a copy in the store: the run's record, beside its checkpoints
        for name in (rundir.CONFIG, rundir.OVERRIDES):
            storage.copy_file(local / name, run_dir / name)
    (local / rundir.STOP).unlink(missing_ok=True)
    return path


def already_finished(cfg) -> Optional[str]:
    """The one line saying there is nothing to train, when the checkpoint this run would resume
    from is at or beyond train.steps; None when there is training to do."""
    from ..checkpoint import checkpoints_dir, plan_resume, verify_checksums

    plan = plan_resume(cfg.checkpoint, checkpoints_dir(cfg.run.dir))
    if plan.kind != "resume" or plan.step is None or plan.step < cfg.train.steps:
        return None
    try:  # a damaged final checkpoint is not a finished run: the ranks fall back past it
        if verify_checksums(plan.found.path, plan.found.manifest) is not None:
            return None
    except OSError:
        return None
    where = f"{plan.found.path}" if not plan.own else f"{plan.found.name}"
    if plan.step == cfg.train.steps:
        return (f"mfsdp-train: run.dir={cfg.run.dir} already finished: checkpoint {where} is at train.steps="
                f"{cfg.train.steps}; nothing to do (raise train.steps to train on)")
    return (f"mfsdp-train: run.dir={cfg.run.dir}: checkpoint {where} is at step {plan.step}, beyond "
            f"train.steps={cfg.train.steps}; nothing to do (raise train.steps to train on, or "
            "checkpoint.load_step=N to go back)")


def torchrun_command(launcher_cfg, config_path: Path) -> List[str]:
    lc = launcher_cfg
    run_dir = Path(config_path).parent
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={lc.nproc_per_node}"]
    if lc.nnodes == 1 and not lc.rdzv_endpoint:
        cmd.append("--standalone")  # c10d on a free port: nothing fixed, nothing to collide
    else:
        rdzv_id = lc.rdzv_id or run_dir.name
        cmd += [f"--nnodes={lc.nnodes}", f"--node-rank={lc.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={lc.rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    # Each rank's stdout/stderr into run.dir/logs and (prefixed, for the launcher) to the console.
    cmd += [f"--log-dir={torchrun_log_dir(run_dir, lc.node_rank)}", "--tee=3"]
    cmd += [f"--max-restarts={lc.max_restarts}", "-m", rank_module(), "--config", str(config_path)]
    return cmd


def torchrun_log_dir(run_dir: Path, node_rank: int) -> Path:
    return Path(run_dir) / rundir.LOGS / f"node{node_rank}"


def launcher_log(run_dir: Path, node_rank: int) -> Path:
    name = rundir.LAUNCHER_LOG if not node_rank else rundir.LAUNCHER_LOG.replace(".log", f".node{node_rank}.log")
    return Path(run_dir) / rundir.LOGS / name


def worker_env(launcher_cfg, run_dir: Optional[Path] = None, environ=None) -> dict:
    """The environment torchrun and the ranks get: `environ` (the launcher's own when None) and ours."""
    env = dict(os.environ if environ is None else environ)
    from ..core.hardware import cpu_count

    # torchrun would pin 1 thread per rank with a warning; share the cores out instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count() // launcher_cfg.nproc_per_node)))
    env["MFSDP_LAUNCHER"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONPATH"] = package_root() + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(diagnostics_env(run_dir, environ=env))
    return env


def launch(cfg, overrides: List[str]) -> int:
    with _run_lock(cfg) as lock:
        if cfg.launcher.kind not in SCHEDULED_KINDS:
            done = already_finished(cfg)
            if done:
                print(done, flush=True)
                return exit_codes.OK
            _ready_text_cache(cfg)
        config_path = prepare_run_dir(cfg, overrides)
        if cfg.launcher.kind == LauncherKind.slurm:
            from .slurm import write_and_maybe_submit

            return write_and_maybe_submit(cfg, config_path)
        if cfg.launcher.kind in KUBERNETES_KINDS:
            from .kubernetes import write_and_maybe_submit as write_manifest

            return write_manifest(cfg, config_path)
        return _run_torchrun(cfg, config_path, lock)


def _run_lock(cfg):
    """The run dir's lock: a flock on run.lock, or a lease object in an object store (lease.py)."""
    if storage.is_remote(cfg.run.dir):
        from .lease import ObjectLease

        return ObjectLease(cfg.run.dir, node_rank=cfg.launcher.node_rank, command=_command_line())
    from .runlock import RunLock

    return RunLock(Path(cfg.run.dir).expanduser().resolve(), node_rank=cfg.launcher.node_rank,
                   command=_command_line())


def _command_line() -> str:
    return shlex.join(["mfsdp-train", *sys.argv[1:]])[:300]


def _run_torchrun(cfg, config_path: Path, lock) -> int:
    from .runstate import ending, read_metrics, rows_of_this_run, summary_line
    from .progress import ProgressBar, wanted as progress_wanted
    from .output import Console, RankLogLinks
    from .supervise import Supervisor, torchrun_env

    run_dir, lc = config_path.parent, cfg.launcher
    console = Console(launcher_log(run_dir, lc.node_rank))
    supervisor = None
    try:
        cmd = torchrun_command(lc, config_path)
        links = RankLogLinks(run_dir / rundir.LOGS, torchrun_log_dir(run_dir, lc.node_rank), lc.node_rank,
                             lc.nproc_per_node)
        # (rank 0's progress: on the first node; another node's console shows its ranks' lines)
        bar = ProgressBar(run_dir, cfg.train.steps, enabled=progress_wanted(cfg.train) and lc.node_rank == 0)
        # Listening for Ctrl-C, SIGTERM, SIGHUP and Ctrl-Z from here on (before the `NxM ranks` line).
        supervisor = Supervisor(cmd, torchrun_env(worker_env(lc, run_dir)), run_dir, console,
                                pass_fds=(lock.fd,) if lock.fd is not None else (), rank_logs=links, progress=bar)
        console.out(f"mfsdp-train: {lc.nnodes}x{lc.nproc_per_node} ranks, run.dir={cfg.run.dir}")
        with open(run_dir / rundir.LAUNCH_CMD, "w") as f:
            f.write(shlex.join(cmd) + "\n")
        console.log_only(f"mfsdp-train: {_command_line()}\ntorchrun: {shlex.join(cmd)}\n")
        after = _resumes_from(cfg)
        before = rows_of_this_run(read_metrics(cfg.run.dir), after)  # an earlier attempt's rows past it
        t0 = time.monotonic()
        result = supervisor.run()
        wall = time.monotonic() - t0
        root = result.root
        end = ending(cfg.run.dir, cfg.train.steps, result.rc, stop_requested=result.stop_requested,
                     aborted=result.aborted, rank_exit_code=root.exit_code if root else None, after=after,
                     before=before)
        line = summary_line(end, cfg.train.steps, wall, run_dir, why=_why(end.code, result))
        (console.out if end.code == exit_codes.OK else console.err)(line)
        return end.code
    except Exception:
        # The launcher's own failure: its traceback also goes to launcher.log, since the terminal
        # that would show it may be gone (a closed window is how the launcher often ends).
        import traceback

        console.log_only("mfsdp-train: the launcher failed:\n" + traceback.format_exc())
        raise
    finally:
        if supervisor is not None:
            supervisor.restore_signals()
        console.close()


def _resumes_from(cfg) -> int:
    """The step this launch's ranks continue from (0: a fresh start): its summary shows only the
    rows past it."""
    from ..checkpoint import checkpoints_dir, plan_resume

    try:
        plan = plan_resume(cfg.checkpoint, checkpoints_dir(cfg.run.dir))
    except ConfigError:
        return 0
    return int(plan.step) if plan.kind == "resume" and plan.step is not None else 0


def _why(code: int, result) -> Optional[str]:
    """The cause shown in the summary line: the signal that stopped the run, or the failing rank."""
    if code in (exit_codes.INTERRUPTED, exit_codes.ABORTED):
        return ", ".join(dict.fromkeys(result.signals)) or None
    if code in (exit_codes.FAILED, exit_codes.CONFIG):
        root = result.root
        if root is not None and root.rank is not None:
            how = (f"killed by {root.signal_name}" if root.signal_name
                   else f"exit code {root.exit_code}" if root.exit_code is not None else "failed")
            if result.root_oom:
                return f"rank {root.rank} ran out of GPU memory, {how}"
            return f"rank {root.rank} {how}" + ("" if root.signal_name else ", traceback above")
        if result.torchrun_error:
            return f"torchrun: {result.torchrun_error}"
        return f"torchrun exit code {result.rc}"
    return None
