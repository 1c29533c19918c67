"""The resume decision: what a run loads, as a pure function of its checkpoint config and what is on
disk. The launcher's preflight and the workers' rank 0 run the same code.

* Resume point: the highest step whose directory is intact. `latest` is never trusted for it.
* `resume=auto` with checkpoints present but none intact refuses to start (ConfigError) rather
  than silently training from scratch.
* `resume=never` starts over. In a run dir that holds step directories it refuses (one line naming
  them) unless `checkpoint.overwrite=true`, and then the earlier run is moved aside to
  `run.dir/previous/<n>/` before anything starts (aside.py): nothing is deleted.
* `load_path` is an initialisation source: with `resume=auto|must` it is used only when the run's
  own directory has no checkpoint, so a preempted fine-tune resumes its own progress.
  `resume=never` ignores the run's own checkpoints but still loads `load_path`. `load_step`
  always wins (explicit): the step of `load_path` if given, else of the run's own directory.
* A full resume refuses a change of the keys that decide which samples train
  (`manifest.SAMPLE_KEYS`) unless `checkpoint.allow_data_change=true`, as it refuses a change
  of the model's shape or of the engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ..core import storage
from ..core.errors import ConfigError
from . import adapters
from .find import Damaged, Found, find_latest, require_step, resolve_checkpoint
from .integrity import inspect_checkpoint
from .layout import checkpoints_dir, list_step_dirs, step_name
from .manifest import cfg_get, data_changes, incompatibilities, manifest_info_from_config

# What a refusal proposes instead of a change that cannot resume: never a flag that loses work.
START_OVER = ("a new run.dir to start over (or checkpoint.resume=never checkpoint.overwrite=true, which moves "
              "this run's files to run.dir/previous/<n>/)")


@dataclass
class ResumePlan:
    kind: str  # "fresh" | "resume" | "weights"
    line: str  # the one decision line
    notes: List[str] = field(default_factory=list)  # printed before it (damaged fallbacks, ...)
    found: Optional[Found] = None
    own: bool = False  # the checkpoint is in this run's own directory

    @property
    def step(self) -> Optional[int]:
        return self.found.step if self.found else None


def plan_resume(ck, ckpt_dir: str | os.PathLike, damaged: Damaged = None) -> ResumePlan:
    """Decide what a run with checkpoint config `ck` and own checkpoints in `ckpt_dir` loads.

    `damaged`: step directories a checksum found damaged (see find.py), skipped like any other.
    """
    ckpt_dir = storage.path(ckpt_dir).expanduser().absolute()
    resume = str(cfg_get(ck, "resume", "auto"))
    load_step, load_path = cfg_get(ck, "load_step"), cfg_get(ck, "load_path")
    weights_only = bool(cfg_get(ck, "load_weights_only", False))
    notes: List[str] = []

    def loaded(found: Found, own: bool) -> ResumePlan:
        if not own:  # another run's newer steps that failed a checksum (find_latest names our own)
            notes.extend(f"{p.name} of {p.parent} is damaged ({why}), falling back to {found.name}"
                         for p, why in sorted((damaged or {}).items()) if p.parent == found.path.parent)
        if weights_only and not own:
            return ResumePlan("weights", f"starting fresh from the model weights of step {found.step} "
                              f"({found.path}): checkpoint.load_weights_only=true (fresh optimizer "
                              "and schedule, step 0)", notes, found, own)
        return ResumePlan("resume", f"resuming from step {found.step} ({found.path})", notes, found, own)

    if load_step is not None:
        if load_path:
            return loaded(resolve_checkpoint(load_path, step=int(load_step), damaged=damaged), False)
        found = require_step(ckpt_dir, int(load_step), damaged=damaged)
        # Only the directories above found.step need checking (committed_steps would check all).
        newer = [s for s, p in list_step_dirs(ckpt_dir)
                 if s > found.step and inspect_checkpoint(p)[1] is None and not (damaged and p in damaged)]
        if newer:
            notes.append(f"checkpoint.load_step={found.step}: {', '.join(step_name(s) for s in newer)} in "
                         f"{ckpt_dir} are later; this run's first save moves them to {ckpt_dir.parent}/previous/<n>/ "
                         "(nothing is deleted)")
        return loaded(found, True)

    if resume == "never":
        _check_start_over(ck, ckpt_dir)
        if load_path:
            return loaded(resolve_checkpoint(load_path, damaged=damaged), False)
        return ResumePlan("fresh", "starting fresh: checkpoint.resume=never", notes)

    own_found, own_damaged = find_latest(ckpt_dir, damaged)
    if own_found is not None:
        for path, problem in own_damaged:
            notes.append(f"{path.name} is damaged ({problem}), falling back to {own_found.name}")
        if load_path:
            notes.append(f"checkpoint.load_path={load_path} is not used: {ckpt_dir} has its own checkpoint "
                         "(load_path only initialises a run that has none)")
        return loaded(own_found, True)
    if own_damaged:
        why = "; ".join(f"{p.name} is damaged ({w})" for p, w in own_damaged)
        raise ConfigError("checkpoint.resume", f"{resume}, but {ckpt_dir} has no intact checkpoint: {why}",
                          "repair the damaged directories, or " + START_OVER)
    if load_path:
        return loaded(resolve_checkpoint(load_path, damaged=damaged), False)
    if resume == "must":
        raise ConfigError("checkpoint.resume", f"must, but {ckpt_dir} has no committed checkpoint",
                          "auto|never, or a run.dir with checkpoints")
    return ResumePlan("fresh", f"starting fresh: no checkpoint in {ckpt_dir}", notes)


def _check_start_over(ck, ckpt_dir: Path) -> None:
    """resume=never in a run dir with step directories: refused unless checkpoint.overwrite=true
    (then the launcher moves them aside first, aside.py); a load_path among them cannot move."""
    existing = [p for _, p in list_step_dirs(ckpt_dir)]
    if not existing:
        return
    names = ", ".join(p.name for p in existing)
    if not bool(cfg_get(ck, "overwrite", False)):
        raise ConfigError("checkpoint.resume", f"never, but {ckpt_dir} holds an earlier run's checkpoints "
                          f"({names}) that starting over would replace",
                          "a new run.dir, or checkpoint.overwrite=true to start over here with the earlier run "
                          "moved to run.dir/previous/<n>/ (nothing is deleted)")
    load_path = cfg_get(ck, "load_path")
    target = storage.path(load_path).expanduser().absolute() if load_path else None
    if target is not None and (target in (ckpt_dir, ckpt_dir.parent) or ckpt_dir in target.parents):
        raise ConfigError("checkpoint.load_path", f"{load_path} is one of this run.dir's own checkpoints, which "
                          "checkpoint.overwrite=true moves to run.dir/previous/<n>/ before the run starts",
                          "a checkpoint outside this run.dir (copy it), or checkpoint.load_step=N with "
                          "checkpoint.resume=auto")


def refusal(plan: ResumePlan, problems: List[Tuple[str, Any, Any]]) -> ConfigError:
    """The one-line ConfigError for a config change that cannot resume `plan`'s checkpoint."""
    key, now, old = problems[0]
    verb = "load" if plan.kind == "weights" else "resume"
    base = ((adapters.of(plan.found.manifest) or {}).get("base") or {}).get("key")
    what = {"engine": "the engine's state layout", "optim.name": "the optimizer's saved state",
            base: "the frozen base the adapters were trained over"}.get(key, "the model's saved tensors")
    extra = f" (and {', '.join(p[0] for p in problems[1:])})" if len(problems) > 1 else ""
    allowed = f"{old!r} as in the checkpoint, or {START_OVER}"
    if key in ("engine", "optim.name"):
        allowed += ", or checkpoint.load_path=<it> checkpoint.load_weights_only=true in a new run.dir"
    return ConfigError(key, f"{now!r} here but {old!r} in {plan.found.path}, the checkpoint this run would "
                       f"{verb}{extra}: a change of {what} cannot {verb}", allowed)


def data_refusal(plan: ResumePlan, problems: List[Tuple[str, Any, Any]]) -> ConfigError:
    """The one-line ConfigError for a change of which samples train, at a full resume."""
    key, now, old = problems[0]
    extra = f" (and {', '.join(f'{k} {o!r} -> {n!r}' for k, n, o in problems[1:])})" if len(problems) > 1 else ""
    return ConfigError(key, f"{now!r} here but {old!r} in {plan.found.path}, the checkpoint this run would "
                       f"resume{extra}: it changes which samples train, so the resumed run would not continue "
                       "the same data", f"{old!r} as in the checkpoint, or checkpoint.allow_data_change=true to "
                       "resume on the changed data, or a new run.dir")


def check_compatible(plan: ResumePlan, current: dict, ck=None) -> None:
    """Raise the refusal when the run described by `current` (manifest info) cannot load `plan`
    under checkpoint config `ck` (its allow_data_change)."""
    if plan.kind == "fresh":
        return
    problems = incompatibilities(current, plan.found.manifest, weights_only=plan.kind == "weights")
    if problems:
        raise refusal(plan, problems)
    if plan.kind == "resume" and not bool(cfg_get(ck, "allow_data_change", False)):
        changed = data_changes(current, plan.found.manifest)
        if changed:
            raise data_refusal(plan, changed)


def preflight(cfg) -> None:
    """Launcher-side checks before spawning (pure Python; never imports torch).

    Raises ConfigError when the checkpoint config cannot run against what is on disk: resume=must
    with nothing committed, a load_step that is not committed, a bad load_path, or a refused
    change (model shape, engine, the data that trains) vs the checkpoint that would be loaded, or a
    resume=never that would replace the run dir's checkpoints. Checksums are verified
    later, by the workers, in parallel, except those of a step the config names (`verify_named`).
    """
    plan = plan_resume(cfg.checkpoint, checkpoints_dir(cfg.run.dir))
    if plan.kind != "fresh":
        check_compatible(plan, manifest_info_from_config(cfg, versions={}), cfg.checkpoint)
        verify_named(plan, cfg.checkpoint)


def verify_named(plan: ResumePlan, ck) -> None:
    """The checksums of a step the config names (checkpoint.load_step, or a load_path that is a
    step directory), read before spawning: there is nothing to fall back to, so damage is one line
    now rather than a failure on every rank. (A newest step found by search is verified by the
    workers, which fall back past damage.)"""
    from .integrity import verify_checksums

    load_step, load_path = cfg_get(ck, "load_step"), cfg_get(ck, "load_path")
    named_dir = load_path and Path(str(load_path)).expanduser().absolute() == plan.found.path
    if load_step is None and not named_dir:
        return
    try:
        problem = verify_checksums(plan.found.path, plan.found.manifest)
    except OSError as exc:
        problem = f"a file cannot be read: {exc.strerror or exc}"
    if problem is None:
        return
    key = "checkpoint.load_step" if load_step is not None else "checkpoint.load_path"
    others = [step_name(s) for s, p in list_step_dirs(plan.found.path.parent)
              if p != plan.found.path and inspect_checkpoint(p)[1] is None]
    raise ConfigError(key, f"{plan.found.path} is damaged ({problem}); nothing was started",
                      f"another committed step of {plan.found.path.parent}: {', '.join(others)}" if others
                      else "a checkpoint that is intact")
