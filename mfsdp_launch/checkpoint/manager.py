"""CheckpointManager: the one object a worker holds. It decides what to resume (plan.py), verifies
and loads it (load.py), and saves when the config asks for it (commit.py).

Async saves (`checkpoint.async_save`): `dcp.async_save` stages a CPU copy of the state on the
calling thread, then writes from a background thread over a dedicated gloo group (torch 2.13
asserts the group has a CPU backend, and a group used by a background thread must not be used by
the training thread). While a save is in flight every `maybe_save` call polls it with one tiny
all_gather, so all ranks commit in the same call; the next save and `wait()` block until it is
done. Final and forced saves are committed before `maybe_save` returns. `maybe_save` and `wait`
must be called by every rank, in the same order, with the same arguments.

Time-based saves (`checkpoint.interval_minutes`, train time since the last save or the start):
rank 0's clock decides (`time_due`), and the loop's per-step stop collective carries its vote to
every rank (`agree`), so all ranks save at the same step without a collective of their own.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Dict, Optional

from ..core import storage
from ..core.errors import ConfigError
from . import adapters
from .collective import Group
from .commit import Saver
from .errors import CheckpointError, dcp_failures, describe
from .best import best_loss
from .find import Found, committed_steps
from .integrity import inspect_checkpoint
from .layout import CHECKPOINTS, clean_stale, step_name
from .load import load_full, load_weights, quiet_single_process_warnings, verify
from .manifest import cfg_get, config_changes
from .plan import ResumePlan, check_compatible, plan_resume


def _print(msg: str) -> None:
    print(msg, flush=True)


class CheckpointManager:
    """Saves and resumes one run's checkpoints. Construct it on every rank (it is collective)."""

    def __init__(self, ckpt_cfg, run_dir, *, manifest_info: dict, rank: int, world_size: int, engine,
                 process_group=None):
        self.cfg = ckpt_cfg
        self.run_dir = storage.path(run_dir).expanduser().absolute()  # a Path, or an object store's
        self.dir = self.run_dir / CHECKPOINTS
        self.info = dict(manifest_info or {})
        self.rank, self.world_size = int(rank), int(world_size)
        self.engine = engine
        self.group = Group(process_group, world_size)
        if not self.group.distributed:
            quiet_single_process_warnings()
        self.last_blocked_seconds = 0.0
        # checkpoint.keep_best=val_loss: a validation that beats the best saves its step (checkpoint/best.py)
        self.keep_best = str(cfg_get(ckpt_cfg, "keep_best", "none") or "none") == "val_loss"
        self.best_val = best_loss(self.dir) if self.keep_best else float("inf")
        self._resumed: Optional[Found] = None  # the checkpoint a full resume loaded (a rollback target)
        self._since = time.monotonic()  # the clock of checkpoint.interval_minutes
        self._due_step: Optional[int] = None  # the step the ranks agreed a time-based save is due
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            clean_stale(self.run_dir)
        async_pg = None
        if bool(cfg_get(ckpt_cfg, "async_save", False)) and self.group.distributed:
            import torch.distributed as dist

            # The background writer gets its own gloo group: async_save needs a CPU backend, and a
            # group used from another thread must not be shared with the training thread.
            async_pg = dist.new_group(backend="gloo")
        self.saver = Saver(self.dir, self.group, rank=self.rank, world_size=self.world_size, info=self.info,
                           keep_last=int(cfg_get(ckpt_cfg, "keep_last", 3) or 1), async_pg=async_pg,
                           keep_best=self.keep_best)
        self.group.barrier()

    @property
    def resumed_path(self) -> Optional[Path]:
        return self.saver.resumed_path

    @property
    def last_save_seconds(self) -> float:
        return self.saver.last_save_seconds

    @property
    def _pending(self):
        return self.saver.pending

    # -------------------------------------------------------------------- resume

    def resume(self, model, optimizer, scheduler, train_state) -> Optional[int]:
        """Load what the config asks for; returns the step training continues from.

        Full resume: the checkpoint's step. Weights only: 0 (fresh optimizer, schedule and train
        state). Nothing loaded: None. Prints the decision on rank 0. Collective.
        """
        plan = self._decide()
        self._announce(plan)
        self._since = time.monotonic()  # training starts now: resuming is not train time
        if plan.kind == "fresh":
            return None
        path = plan.found.path
        try:
            if plan.kind == "weights":
                load_weights(self.engine, model, path, self.group, adapters_only=adapters.of(self.info) is not None)
                result = 0
            else:
                result = load_full(plan.found, engine=self.engine, model=model, optimizer=optimizer,
                                   scheduler=scheduler, train_state=train_state, group=self.group, rank=self.rank,
                                   world_size=self.world_size, seed=self.info.get("seed", 0) or 0)
        except (ConfigError, CheckpointError):
            raise
        except dcp_failures() as exc:  # DCP's CheckpointException too (a BaseException)
            raise CheckpointError(f"cannot load {path}: {describe(exc)}") from exc
        self.saver.resumed_path = path
        self._resumed = plan.found if plan.kind == "resume" else None
        if plan.own and plan.kind == "resume":
            self.saver.have_steps.add(plan.step)
        return result

    def rollback(self, model, optimizer, scheduler, train_state, *, at_most: int) -> Optional[int]:
        """Reload the newest intact checkpoint this run saved or resumed from, of step `at_most` or
        earlier (after train.max_bad_steps bad steps in a row, the last step before them:
        rank/step_guard.py); returns its step, None when there is none. A step failing its
        checksums is passed over, as at a resume. Collective."""
        self.wait()  # an async save in flight is committed first: it may be the newest
        damaged: Dict[Path, str] = {}
        while True:
            found = self.group.broadcast(self._rollback_target(int(at_most), damaged) if self.rank == 0 else None)
            if found is None:
                return None
            problem = verify(found, self.group, self.rank)
            if problem is None:
                break
            damaged[found.path] = problem
            if self.rank == 0:
                _print(f"{found.name} is damaged ({problem}): not rolling back to it")
        try:
            step = load_full(found, engine=self.engine, model=model, optimizer=optimizer, scheduler=scheduler,
                             train_state=train_state, group=self.group, rank=self.rank,
                             world_size=self.world_size, seed=self.info.get("seed", 0) or 0)
        except dcp_failures() as exc:
            raise CheckpointError(f"cannot roll back to {found.path}: {describe(exc)}") from exc
        # The later steps are of a timeline this run replaces: saved again as it gets there.
        self.saver.have_steps = {s for s in self.saver.have_steps if s <= step}
        return step

    def _rollback_target(self, step: int, damaged: Dict[Path, str]) -> Optional[Found]:
        for s in sorted((s for s in self.saver.have_steps if s <= step), reverse=True):
            path = self.dir / step_name(s)
            if path in damaged:
                continue
            manifest, problem = inspect_checkpoint(path)
            if problem is None:
                return Found(path, s, manifest)
        resumed = self._resumed  # e.g. checkpoint.load_path's: where the run began
        if resumed is not None and resumed.path not in damaged and resumed.step <= step:
            return resumed
        return None

    def _decide(self) -> ResumePlan:
        """The plan, with its checkpoint's checksums verified: a step that fails them counts as
        damaged and the plan is made again (the previous intact step, or a refusal)."""
        damaged: Dict[Path, str] = {}
        while True:
            plan = self._plan(damaged)
            if plan.kind == "fresh":
                return plan
            problem = verify(plan.found, self.group, self.rank)
            if problem is None:
                return plan
            damaged[plan.found.path] = problem

    def _plan(self, damaged: Dict[Path, str]) -> ResumePlan:
        """Rank 0 decides; every rank gets the plan or raises the same error."""
        payload = None
        if self.rank == 0:
            try:
                plan = plan_resume(self.cfg, self.dir, damaged)
                check_compatible(plan, self.info, self.cfg)
                payload = ("ok", plan)
            except ConfigError as exc:
                payload = ("error", (exc.key, exc.problem, exc.allowed))
            except Exception as exc:  # e.g. an unreadable directory: fail every rank, not just 0
                payload = ("failed", describe(exc))
        payload = self.group.broadcast(payload)
        if payload[0] == "error":
            raise ConfigError(*payload[1])
        if payload[0] == "failed":
            raise CheckpointError(f"cannot decide what to resume from {self.dir}: {payload[1]}")
        return payload[1]

    def _announce(self, plan: ResumePlan) -> None:
        if self.rank != 0:
            return
        for note in plan.notes:
            _print(note)
        _print(plan.line)
        if plan.found is not None:
            changes = config_changes(self.info, plan.found.manifest)
            if changes:
                _print(f"config changes since step {plan.step} (allowed): " + "; ".join(changes))

    # -------------------------------------------------------------------- save

    def time_due(self) -> bool:
        """Rank 0's vote: checkpoint.interval_minutes of train time have passed since the last save
        (or the start). Local, no collective: `agree` takes what every rank was told."""
        minutes = cfg_get(self.cfg, "interval_minutes")
        return self.rank == 0 and bool(minutes) and time.monotonic() - self._since >= float(minutes) * 60

    def agree(self, step: int, due: bool) -> None:
        """The ranks' agreed answer to `time_due` at `step` (the same on every rank)."""
        self._due_step = step if due else None

    def _wants(self, step: int, final: bool, force: bool) -> bool:
        if force or (final and bool(cfg_get(self.cfg, "save_final", True))) or self._due_step == step:
            return True
        interval = int(cfg_get(self.cfg, "interval", 0) or 0)
        return interval > 0 and step > 0 and step % interval == 0

    def due(self, step: int, *, final: bool = False, force: bool = False) -> bool:
        """Whether `maybe_save` with these arguments saves (keep_best aside: it needs the step's
        validation, which settles the step anyway)."""
        return self._wants(step, final, force) and step not in self.saver.have_steps

    def maybe_save(self, step: int, model, optimizer, scheduler, train_state, *, final: bool = False,
                   force: bool = False, val_loss: Optional[float] = None) -> float:
        """Save if this step asks for it; returns the seconds training was blocked. Collective:
        call it on every rank with the same arguments (at every step is fine and polls async saves).
        `val_loss`: the validation loss of this step, if the loop validated at it (keep_best)."""
        t0 = time.perf_counter()
        saver = self.saver
        if saver.pending is not None:
            saver.poll()
        better = self.keep_best and val_loss is not None and val_loss < self.best_val
        if (self._wants(step, final, force) or better) and step not in saver.have_steps:
            if saver.pending is not None:
                saver.finish_pending()
            if not self.engine.params_finite(model):  # never commit non-finite weights
                self._refuse_nonfinite(step, final or force)
                return time.perf_counter() - t0
            use_async = saver.async_pg is not None or (bool(cfg_get(self.cfg, "async_save", False))
                                                       and not self.group.distributed)
            saver.save(step, self.engine, model, optimizer, scheduler, train_state,
                       use_async=use_async and not (final or force), val_loss=val_loss)
            if better:
                self.best_val = val_loss
            self._since = time.monotonic()  # the save's own time is not train time
        blocked = time.perf_counter() - t0
        self.last_blocked_seconds = blocked
        return blocked

    def _refuse_nonfinite(self, step: int, last: bool) -> None:
        kept = ", ".join(step_name(s) for s in committed_steps(self.dir)) or "none"
        why = (f"checkpoint of step {step} not saved: the model's weights are not finite; the committed "
               f"checkpoints are intact: {kept}")
        if last:  # nothing after it would save instead
            raise CheckpointError(why)
        if self.rank == 0:
            print(f"checkpoint: warning: {why}", file=sys.stderr, flush=True)

    def wait(self) -> None:
        """Finish and commit an in-flight async save. Collective."""
        if self.saver.pending is not None:
            self.saver.finish_pending()
