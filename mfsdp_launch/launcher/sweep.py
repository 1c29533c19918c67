"""`mfsdp-train -m ...`: a Hydra multirun where every job is its own torchrun launch.

Real Hydra multirun: the configured sweeper expands the overrides and the configured launcher
runs the jobs (the basic launcher: one after another in this process; `hydra/launcher=
submitit_slurm` and friends work too, as the task function is a plain module-level function).

Each job gets a deterministic directory, `<hydra.sweep.dir>/<hydra.job.override_dirname>`
(a '/' in a value is escaped, so one job is one directory), which is its `run.dir`. The job
records `job_status.json` there and never raises, so one failing job does not stop the sweep.

Re-running the same sweep launches nothing for finished jobs (status `done`, marked "already
finished") and resumes the others. A job is finished when
  * its directory holds a `DONE` marker whose step is >= the job's train.steps (the sweep writes
    it after torchrun exits 0 and the run reached train.steps), or
  * its newest intact committed checkpoint (`checkpoints/step_<N>/` whose manifest.json lists
    files that are all there: the resume point `checkpoint.find_latest` picks) is at step
    N >= train.steps (a run finished outside this sweep, or before the marker was written).
Anything else is launched again and resumes from its newest checkpoint (`checkpoint.resume=auto`).

After the sweep, the summary (console, `sweep_summary.csv`, `sweep_summary.md`) is built from
the job directories on disk, so it also covers jobs that a launcher plugin ran elsewhere.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import List, Optional

from ..core.atomic_io import atomic_write_text
from ..core.errors import ConfigError
from ..core.names import exception_line
from ..core import exit_codes, rundir
from ..core.schema import SCHEDULED_KINDS
from . import launch
from ..core.console import eprint
from .runstate import reached_step
from .sweep_summary import ALREADY_FINISHED, finished_step, job_dirs_in, summarize


# Statuses a job can end with; the sweep exits 0 only if every job ended in OK_STATUSES.
# ("skipped" is what earlier versions recorded for an already finished job: now "done".)
OK_STATUSES = ("done", "skipped", "dry_run", "submitted", "written")

# Per-process sweep state: a job stopped on request (Ctrl-C, STOP file) stops the whole sweep.
_STATE = {"stop": False, "started": 0}


# --- the command -------------------------------------------------------------------------------


def run_sweep(argv: List[str]) -> int:
    """Run the sweep for these command-line arguments (with -m/--multirun); 0 if every job
    finished, 1 if any failed, 2 for bad overrides (nothing ran), 3 if interrupted."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from ..planner.compose import config_dir, config_error_from, register_schema

    overrides = [a for a in argv if a not in ("-m", "--multirun")]
    flags = [a for a in overrides if a.startswith("-")]
    if flags:
        eprint(f"mfsdp-train: error: {flags[0]}: not supported with -m/--multirun "
                "(allowed: key=value overrides; launcher.dry_run=true shows each job)")
        return 2

    _STATE.update(stop=False, started=0)
    register_schema()  # before Hydra starts: config.yaml's first default is the schema
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="mfsdp-train",
                                     config_search_path=create_config_search_path(f"file://{config_dir()}"))
    interrupted = aborted = False
    returns = None
    n_jobs = None
    try:
        try:
            sweep_cfg = hydra.compose_config(config_name="config", overrides=overrides,
                                             run_mode=RunMode.MULTIRUN)
            sweep_dir = _abs(str(sweep_cfg.hydra.sweep.dir), sweep_cfg.hydra.runtime.cwd)
            n_jobs = _prevalidate(hydra, sweep_cfg)
        except Exception as exc:  # Hydra/OmegaConf raise many types; all mean bad input here
            eprint(f"mfsdp-train: error: {_explain(config_error_from(exc), exc)}")
            return exit_codes.CONFIG
        print(f"mfsdp-train: sweep{f' of {n_jobs} jobs' if n_jobs else ''} into {sweep_dir}", flush=True)
        try:
            returns = hydra.multirun(config_name="config", task_function=sweep_job, overrides=overrides)
        except KeyboardInterrupt:
            interrupted = True
            eprint("mfsdp-train: sweep interrupted; re-run the same command to resume it")
        except Exception as exc:
            if n_jobs is None and _STATE["started"] == 0 and not job_dirs_in(sweep_dir):
                # Another sweeper composes the jobs itself, before launching any: bad values end up here.
                eprint(f"mfsdp-train: error: {_explain(config_error_from(exc), exc)}")
                return exit_codes.CONFIG
            # E.g. a launcher plugin whose job was killed (timeout, preemption): its JobReturn raises.
            eprint(f"mfsdp-train: sweep aborted: {exception_line(exc)}")
            aborted = True
    finally:
        GlobalHydra.instance().clear()

    job_dirs = _job_dirs_from_returns(returns)
    if job_dirs is None:  # a sweeper that returns no JobReturns: look at the sweep dir itself
        job_dirs = job_dirs_in(sweep_dir)
    rows = summarize(job_dirs, sweep_dir)
    if interrupted or _STATE["stop"]:  # Ctrl-C between jobs, or a job stopped on request
        return exit_codes.INTERRUPTED
    if aborted:
        return exit_codes.FAILED
    return exit_codes.OK if rows and all(r["status"] in OK_STATUSES for r in rows) else exit_codes.FAILED


def _explain(err: ConfigError, exc: BaseException) -> ConfigError:
    """A YAML syntax error names its file and line (cli.explain), from the original exception."""
    from ..planner.compose import explain

    err.__context__ = exc
    return explain(err)


def _prevalidate(hydra, sweep_cfg) -> Optional[int]:
    """Compose every job up front, before anything is written, as the basic sweeper would do
    (later, after creating the sweep dir). Returns the number of jobs; None for other sweepers,
    whose override syntax (ranges, intervals) is theirs to interpret."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    target = OmegaConf.select(sweep_cfg, "hydra.sweeper._target_")
    if target != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return None
    params = OmegaConf.select(sweep_cfg, "hydra.sweeper.params") or {}
    args = [f"{k}={v}" for k, v in params.items()]
    args += [str(o) for o in sweep_cfg.hydra.overrides.task]
    parser = OverridesParser.create(config_loader=hydra.config_loader)
    jobs = [job for batch in BasicSweeper.split_arguments(parser.parse_overrides(args), None) for job in batch]
    for job in jobs:
        hydra.config_loader.load_sweep_config(master_config=sweep_cfg, sweep_overrides=list(job))
    return len(jobs)


def _abs(path: str, cwd: Optional[str] = None) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = Path(cwd or os.getcwd()) / p
    return Path(os.path.normpath(p))


def _job_dirs_from_returns(returns) -> Optional[List[Path]]:
    """The job directories of this sweep, in sweep order, from the launcher's JobReturns."""
    if not isinstance(returns, (list, tuple)):
        return None
    dirs: List[Path] = []
    try:
        for batch in returns:
            for ret in batch:
                dirs.append(job_dir(ret.hydra_cfg.hydra))
    except Exception:
        return None
    return dirs


# --- one job -----------------------------------------------------------------------------------


def job_dir(hydra_node) -> Path:
    """`<sweep dir>/<override_dirname>`, deterministic in the job's overrides.

    '/' in a value (data.path=/x/y) would nest directories, so it is escaped; '%' is escaped
    first so that the mapping stays one-to-one. Very long names are shortened with a hash.
    """
    import hashlib

    base = _abs(str(hydra_node.sweep.dir), str(hydra_node.runtime.cwd))
    name = str(hydra_node.job.override_dirname)
    safe = name.replace("%", "%25").replace(os.sep, "%2F")
    if os.altsep:
        safe = safe.replace(os.altsep, "%2F")
    if not safe or safe in (".", ".."):
        safe = "_default" if not safe else safe.replace(".", "%2E")
    if len(safe.encode()) > 200:
        safe = safe.encode()[:160].decode(errors="ignore") + "-" + hashlib.sha1(name.encode()).hexdigest()[:12]
    return base / safe


def _tidy_hydra_dir(hydra_node, ours: Path) -> None:
    """Hydra made `<sweep>/<override_dirname>` itself; when that is not our (escaped) job dir,
    remove the empty directories it left, never anything with files in it."""
    try:
        made = Path(str(hydra_node.runtime.output_dir))
        base = _abs(str(hydra_node.sweep.dir), str(hydra_node.runtime.cwd))
    except Exception:
        return
    if made == ours or base not in made.parents:
        return
    d = made
    while d != base and base in d.parents:
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


def sweep_job(cfg) -> dict:
    """Hydra's task function for one sweep point. Never raises: the outcome goes to
    `<job dir>/job_status.json` and is returned (launcher plugins send it back)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    jdir = job_dir(hc)
    overrides = [str(o) for o in hc.overrides.task]
    label = str(hc.job.override_dirname) or "(no overrides)"
    num = hc.job.num
    _tidy_hydra_dir(hc, jdir)
    jdir.mkdir(parents=True, exist_ok=True)
    status = {"job_num": num, "overrides": overrides, "run_dir": str(jdir), "host": socket.gethostname(),
              "status": "running", "exit_code": None, "error": None, "started": _now(), "finished": None}
    t0 = time.time()

    def finish(state: str, exit_code: Optional[int] = None, error: Optional[str] = None, **extra) -> dict:
        status.update(status=state, exit_code=exit_code, error=error, finished=_now(),
                      duration_s=round(time.time() - t0, 3), **extra)
        _write_json(jdir / rundir.JOB_STATUS, status)
        return {"status": state, "exit_code": exit_code, "run_dir": str(jdir), "error": error}

    if _STATE["stop"]:
        print(f"mfsdp-train: sweep job #{num} {label}: not run (the sweep was stopped)", flush=True)
        return finish("not_run", error="the sweep was stopped before this job")
    try:
        from ..planner.compose import finalize

        job_cfg = finalize(cfg)
        job_cfg.run.dir = str(jdir)
        status["train_steps"] = int(job_cfg.train.steps)
        done = finished_step(jdir, job_cfg.train.steps)
        if done is not None and not job_cfg.launcher.dry_run:
            print(f"mfsdp-train: sweep job #{num} {label}: {ALREADY_FINISHED} (step {done}/"
                  f"{job_cfg.train.steps}): done, nothing to run", flush=True)
            _write_done(jdir, done, job_cfg.train.steps)
            return finish("done", exit_code=0, final_step=done, already_finished=True)
        _STATE["started"] += 1
        print(f"mfsdp-train: sweep job #{num} {label}: run.dir={jdir}", flush=True)
        _write_json(jdir / rundir.JOB_STATUS, status)
        return _run_job(job_cfg, overrides, jdir, finish)
    except ConfigError as exc:
        eprint(f"mfsdp-train: sweep job #{num} {label}: error: {exc}")
        return finish("invalid", exit_code=2, error=str(exc))
    except Exception as exc:  # anything else: record it, keep sweeping
        eprint(f"mfsdp-train: sweep job #{num} {label}: failed: {type(exc).__name__}: {exc}")
        status["traceback"] = traceback.format_exc()
        return finish("failed", error=exception_line(exc))


def _run_job(job_cfg, overrides: List[str], jdir: Path, finish) -> dict:

    dry = job_cfg.launcher.dry_run
    checked = launch.check(job_cfg)  # also resume compatibility with what the job dir holds
    if not dry:
        (jdir / rundir.JOB_DONE).unlink(missing_ok=True)  # a stale marker for fewer steps
    rc = launch.run_checked(job_cfg, checked, overrides)
    if dry:
        return finish("dry_run", exit_code=0)
    if job_cfg.launcher.kind in SCHEDULED_KINDS:
        return finish(("submitted" if job_cfg.launcher.submit else "written") if rc == 0 else "failed",
                      exit_code=rc)
    step = reached_step(jdir)
    stop_requested = (jdir / rundir.STOP).exists()  # left behind when a stop aborted the job
    if rc == exit_codes.OK and step is not None and step >= job_cfg.train.steps:
        _write_done(jdir, step, job_cfg.train.steps)
        return finish("done", exit_code=0, final_step=step)
    if rc == exit_codes.CONFIG:
        return finish("invalid", exit_code=rc, final_step=step, error="refused at start (see its log)")
    if rc in (exit_codes.OK, exit_codes.INTERRUPTED, exit_codes.ABORTED) or stop_requested:
        # Stopped on request before train.steps: the user wants the sweep to stop too.
        _STATE["stop"] = True
        eprint(f"mfsdp-train: job stopped at step {step} of {job_cfg.train.steps}; stopping the sweep "
                "(re-run the same command to resume it)")
        return finish("stopped", exit_code=rc, final_step=step)
    return finish("failed", exit_code=rc, final_step=step,
                  error=f"exit code {rc}; logs in {jdir / rundir.LOGS}")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def _write_done(jdir: Path, step: int, train_steps: int) -> None:
    _write_json(jdir / rundir.JOB_DONE, {"step": int(step), "train_steps": int(train_steps), "written": _now()})
