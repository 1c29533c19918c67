"""The resume decision: what a run loads, as a pure function of its checkpoint config and what is on
disk. The launcher's preflight and the workers' rank 0 run the same code.

* Resume point: the highest step whose directory is intact. `latest` is never trusted for it.
* `resume=auto` with checkpoints present but none intact refuses to start (ConfigError) rather
  than silently training from scratch; `resume=never` is the way to start over.
* `load_path` is an initialisation source: with `resume=auto|must` it is used only when the run's
  own directory has no checkpoint, so a preempted fine-tune resumes its own progress.
  `resume=never` ignores the run's own checkpoints but still loads `load_path`. `load_step`
  always wins (explicit): the step of `load_path` if given, else of the run's own directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Tuple

from ..core.errors import ConfigError
from .find import Damaged, Found, find_latest, require_step, resolve_checkpoint
from .integrity import inspect_checkpoint
from .layout import checkpoints_dir, list_step_dirs, step_name
from .manifest import cfg_get, incompatibilities, manifest_info_from_config


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
    ckpt_dir = Path(ckpt_dir).expanduser().absolute()
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
                         f"{ckpt_dir} are later; this run's first save removes them")
        return loaded(found, True)

    if resume == "never":
        if load_path:
            return loaded(resolve_checkpoint(load_path, damaged=damaged), False)
        existing = [step_name(s) for s, _ in list_step_dirs(ckpt_dir)]
        why = "checkpoint.resume=never"
        if existing:
            why += f" (the checkpoints in {ckpt_dir}, {', '.join(existing)}, are replaced as this run saves)"
        return ResumePlan("fresh", f"starting fresh: {why}", notes)

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
                          "checkpoint.resume=never to start over, or repair/remove the damaged directories")
    if load_path:
        return loaded(resolve_checkpoint(load_path, damaged=damaged), False)
    if resume == "must":
        raise ConfigError("checkpoint.resume", f"must, but {ckpt_dir} has no committed checkpoint",
                          "auto|never, or a run.dir with checkpoints")
    return ResumePlan("fresh", f"starting fresh: no checkpoint in {ckpt_dir}", notes)


def refusal(plan: ResumePlan, problems: List[Tuple[str, Any, Any]]) -> ConfigError:
    """The one-line ConfigError for a config change that cannot resume `plan`'s checkpoint."""
    key, now, old = problems[0]
    verb = "load" if plan.kind == "weights" else "resume"
    what = "the engine's state layout" if key == "engine" else "the model's saved tensors"
    extra = f" (and {', '.join(p[0] for p in problems[1:])})" if len(problems) > 1 else ""
    allowed = f"{old!r} as in the checkpoint, or checkpoint.resume=never / a new run.dir to start over"
    if key == "engine":
        allowed += ", or checkpoint.load_path=<it> checkpoint.load_weights_only=true in a new run.dir"
    return ConfigError(key, f"{now!r} here but {old!r} in {plan.found.path}, the checkpoint this run would "
                       f"{verb}{extra}: a change of {what} cannot {verb}", allowed)


def check_compatible(plan: ResumePlan, current: dict) -> None:
    """Raise the refusal when the run described by `current` (manifest info) cannot load `plan`."""
    if plan.kind == "fresh":
        return
    problems = incompatibilities(current, plan.found.manifest, weights_only=plan.kind == "weights")
    if problems:
        raise refusal(plan, problems)


def preflight(cfg) -> None:
    """Launcher-side checks before spawning (pure Python; never imports torch).

    Raises ConfigError when the checkpoint config cannot run against what is on disk: resume=must
    with nothing committed, a load_step that is not committed, a bad load_path, or a refused
    change (model shape, engine) vs the checkpoint that would be loaded. Checksums are verified
    later, by the workers, in parallel.
    """
    plan = plan_resume(cfg.checkpoint, checkpoints_dir(cfg.run.dir))
    if plan.kind != "fresh":
        check_compatible(plan, manifest_info_from_config(cfg, versions={}))
