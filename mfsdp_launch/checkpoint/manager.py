"""CheckpointManager: the one object a worker holds. It decides what to resume (plan.py), verifies
and loads it (load.py), and saves when the config asks for it (commit.py).

Async saves (`checkpoint.async_save`): `dcp.async_save` stages a CPU copy of the state on the
calling thread, then writes from a background thread over a dedicated gloo group (torch 2.13
asserts the group has a CPU backend, and a group used by a background thread must not be used by
the training thread). While a save is in flight every `maybe_save` call polls it with one tiny
all_gather, so all ranks commit in the same call; the next save and `wait()` block until it is
done. Final and forced saves are committed before `maybe_save` returns. `maybe_save` and `wait`
must be called by every rank, in the same order, with the same arguments.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, Optional

from ..core.errors import ConfigError
from .collective import Group
from .commit import Saver
from .errors import CheckpointError, dcp_failures, describe
from .layout import CHECKPOINTS, clean_stale
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
        self.run_dir = Path(run_dir).expanduser().absolute()
        self.dir = self.run_dir / CHECKPOINTS
        self.info = dict(manifest_info or {})
        self.rank, self.world_size = int(rank), int(world_size)
        self.engine = engine
        self.group = Group(process_group, world_size)
        if not self.group.distributed:
            quiet_single_process_warnings()
        self.last_blocked_seconds = 0.0
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
                           keep_last=int(cfg_get(ckpt_cfg, "keep_last", 3) or 1), async_pg=async_pg)
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
        if plan.kind == "fresh":
            return None
        path = plan.found.path
        try:
            if plan.kind == "weights":
                load_weights(self.engine, model, path, self.group)
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
        if plan.own and plan.kind == "resume":
            self.saver.have_steps.add(plan.step)
        return result

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
                check_compatible(plan, self.info)
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

    def _wants(self, step: int, final: bool, force: bool) -> bool:
        if force or (final and bool(cfg_get(self.cfg, "save_final", True))):
            return True
        interval = int(cfg_get(self.cfg, "interval", 0) or 0)
        return interval > 0 and step > 0 and step % interval == 0

    def maybe_save(self, step: int, model, optimizer, scheduler, train_state, *, final: bool = False,
                   force: bool = False) -> float:
        """Save if this step asks for it; returns the seconds training was blocked. Collective:
        call it on every rank with the same arguments (at every step is fine and polls async saves)."""
        t0 = time.perf_counter()
        saver = self.saver
        if saver.pending is not None:
            saver.poll()
        if self._wants(step, final, force) and step not in saver.have_steps:
            if saver.pending is not None:
                saver.finish_pending()
            use_async = saver.async_pg is not None or (bool(cfg_get(self.cfg, "async_save", False))
                                                       and not self.group.distributed)
            saver.save(step, self.engine, model, optimizer, scheduler, train_state,
                       use_async=use_async and not (final or force))
        blocked = time.perf_counter() - t0
        self.last_blocked_seconds = blocked
        return blocked

    def wait(self) -> None:
        """Finish and commit an in-flight async save. Collective."""
        if self.saver.pending is not None:
            self.saver.finish_pending()
