"""Saving one step: every rank writes into `step_<N>.tmp`, the ranks agree, rank 0 commits.

1. Each rank writes its RNG file (rank 0 also trainer.json); the ranks agree that these writes
   succeeded before anyone enters DCP's collectives (all or none).
2. DCP writes model and optimizer shards (sync, or from a background thread: async).
3. Each rank hashes the files it wrote (its `__<r>_*.distcp` and RNG file, rank 0 the rest) while
   they are still in the page cache; for an async save, in the writer's thread.
4. One all_gather of (error, checksums) is the agreement. On success rank 0 writes manifest.json
   (tmp file, fsync, rename), renames the directory to `step_<N>` (an older `step_<N>`, of a
   timeline this run replaced, is moved to run.dir/previous/<n>/ once the new one is complete:
   aside.py), fsyncs the parent and replaces `latest`; a second agreement makes every rank
   return only after the commit. Later steps of a replaced timeline are moved there too.
5. A failure anywhere (a full disk, any OSError, DCP's CheckpointException, which is a
   BaseException) removes the `.tmp` directory, keeps every committed step, and raises
   CheckpointError on every rank naming the failing ranks, the cause and the steps still there.
"""

from __future__ import annotations

import re
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..core import storage
from . import adapters
from .aside import move_aside
from .collective import Group
from .errors import CheckpointError, dcp_failures, describe
from .find import committed_steps
from .integrity import checksum_files, file_checksum, inspect_checkpoint
from .best import BEST, VAL_LOSS, read_best, update_best
from .layout import LATEST, MANIFEST, TMP_SUFFIX, list_files, list_step_dirs, prune_plan, step_name, write_atomic
from .manifest import collect_versions, new_manifest
from .state import write_rank_state, write_trainer

_DCP_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")
_RANK_FILE = re.compile(r"^extra_rank(\d+)\.pt$")
_FULL_BELOW = 64 << 20  # free bytes, measured before the failed save's .tmp is removed


@dataclass
class _Save:
    step: int
    tmp: Path
    started: float
    future: Optional[Future] = None  # async: resolves to this rank's checksums
    error: Any = None  # this rank's error (str), or the agreed [(rank, error)] of step 1
    done_at: Optional[float] = None
    is_async: bool = False
    train_state: Any = None
    sums: Dict[str, Tuple[int, str]] = field(default_factory=dict)
    val_loss: Optional[float] = None  # the loop validated at this step (checkpoint/best.py)


def _print(msg: str) -> None:
    print(msg, flush=True)


def _failed(errors: list) -> List[Tuple[int, str]]:
    return [(r, e) for r, e in enumerate(errors) if e]


def _why(failed: List[Tuple[int, str]], free: List[Optional[int]], where: Path) -> str:
    """One clause per distinct cause (DCP's own errors already name their ranks), after a word on
    the disk when it is full: torch's writer may report that as "unexpected pos"."""
    parts: List[str] = []
    known = [f for f in free if f is not None]
    if known and min(known) < _FULL_BELOW:
        parts.append(f"the disk of {where} is full: {min(known) / 1e6:.1f} MB free")
    for r, e in failed:
        text = e if e.startswith(("rank ", "ranks ")) else f"rank {r}: {e}"
        if text not in parts:
            parts.append(text)
    return "; ".join(parts[:4]) + (" ..." if len(parts) > 4 else "")


def _free_bytes(path: Path) -> Optional[int]:
    return storage.free_bytes(path)


class Saver:
    """The save side of a CheckpointManager. Every method is collective."""

    def __init__(self, ckpt_dir: Path, group: Group, *, rank: int, world_size: int, info: dict,
                 keep_last: int, async_pg=None, keep_best: bool = False):
        self.dir, self.group = ckpt_dir, group
        self.rank, self.world_size, self.info = rank, world_size, info
        self.keep_last, self.async_pg = keep_last, async_pg
        self.keep_best = keep_best  # checkpoint.keep_best=val_loss: the `best` pointer (checkpoint/best.py)
        self.resumed_path: Optional[Path] = None
        self.have_steps: set = set()  # steps whose state is already on disk in self.dir
        self.pending: Optional[_Save] = None
        self.last_save_seconds = 0.0
        self._staging = None

    # ------------------------------------------------------------------ writing

    def save(self, step: int, engine, model, optimizer, scheduler, train_state, *, use_async: bool,
             val_loss: Optional[float] = None) -> None:
        import torch.distributed.checkpoint as dcp

        job = _Save(step, self.dir / (step_name(step) + TMP_SUFFIX), time.perf_counter(), val_loss=val_loss)
        self.have_steps.add(step)
        # Collective first (Megatron-FSDP's state_dict is one), then this rank's own files.
        state = adapters.checkpoint_state(engine, model, optimizer, adapters.of(self.info) is not None)
        error = None
        try:
            job.tmp.mkdir(parents=True, exist_ok=True)
            write_rank_state(job.tmp, step=step, rank=self.rank, world_size=self.world_size)
            if self.rank == 0:
                job.train_state = write_trainer(job.tmp, step=step, scheduler=scheduler, train_state=train_state)
                adapters.complete_base_reference(self.info)  # LoRA: the base's checksum, for the manifest
        except Exception as exc:
            error = describe(exc)
        failed = _failed(self.group.gather(error))
        if failed:  # every rank enters DCP's collectives, or none
            job.error, job.done_at = failed, time.perf_counter()
            self._commit(job)  # raises
        try:
            if use_async:
                self._start_async(job, state)
                return
            dcp.save(state, checkpoint_id=str(job.tmp), process_group=self.group.pg)
            job.sums = self._checksum_own(job.tmp, self.group.pg)
        except dcp_failures() as exc:  # DCP raises on every rank when any rank's write failed
            job.error = describe(exc)
        job.done_at = time.perf_counter()
        self._commit(job)

    def _start_async(self, job: _Save, state) -> None:
        import torch.distributed.checkpoint as dcp

        stager = self._stager()
        try:
            resp = dcp.async_save(state, checkpoint_id=str(job.tmp), process_group=self.async_pg,
                                  async_stager=stager)
        except dcp_failures() as exc:
            if stager is None:
                raise
            # Staging happens before the writer starts: retry with torch's own staging.
            self._staging = False
            print(f"checkpoint: warning: reusable staging buffers failed ({describe(exc)}); using torch's "
                  "default staging", file=sys.stderr, flush=True)
            resp = dcp.async_save(state, checkpoint_id=str(job.tmp), process_group=self.async_pg)
        upload = getattr(resp, "upload_completion", resp)
        job.future = _then(upload, lambda: self._checksum_own(job.tmp, self.async_pg), job)
        job.is_async = True
        self.pending = job

    def _stager(self):
        """One stager for the run: it keeps its CPU staging buffers and refills them at each save
        (pinned when CUDA is up), instead of allocating the whole state again every time."""
        if self._staging is None:
            import torch

            if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 13):
                self._staging = False  # tested on torch 2.13; torch 2.11's stager failed on reuse
                return None
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._staging = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                         use_async_staging=False, use_non_blocking_copy=cuda))
        return self._staging or None

    def _checksum_own(self, tmp: Path, dcp_pg) -> Dict[str, Tuple[int, str]]:
        """Checksums of the files this rank wrote: DCP's `__<its DCP rank>_*` shards, its RNG file;
        rank 0 also everything no rank claims by name (.metadata, trainer.json, scheduler.pt)."""
        dcp_rank = self.group.rank_in(dcp_pg)
        mine = []
        for name in sorted(storage.listdir(tmp)):
            m, r = _DCP_FILE.match(name), _RANK_FILE.match(name)
            owner = int(m.group(1)) if m else int(r.group(1)) if r else 0
            if owner == (dcp_rank if m else self.rank) and (tmp / name).is_file():
                mine.append(name)
        return checksum_files(tmp, mine)

    def poll(self) -> None:
        if all(self.group.gather(self.pending.future.done())):
            self.finish_pending()

    def finish_pending(self) -> None:
        job, self.pending = self.pending, None
        try:
            job.sums = job.future.result()
        except dcp_failures() as exc:
            job.error = job.error or describe(exc)
        if job.done_at is None:
            job.done_at = time.perf_counter()
        self._commit(job)

    # ------------------------------------------------------------------ committing

    def _commit(self, job: _Save) -> None:
        """Agree that every rank wrote its part, then rank 0 commits; all ranks return after it."""
        sums: Dict[str, Tuple[int, str]] = {}
        if isinstance(job.error, list):  # already agreed (local writes failed)
            failed = job.error
        else:
            gathered = self.group.gather((job.error, job.sums))
            failed = _failed([e for e, _ in gathered])
            sums = {k: v for _, s in gathered for k, v in (s or {}).items()}
        if not failed:
            commit_error = None
            if self.rank == 0:
                try:
                    self._commit_rank0(job, sums)
                except Exception as exc:
                    commit_error = f"commit: {describe(exc)}"
            failed = _failed(self.group.gather(commit_error))
        if failed:
            self._fail(job, failed)
        self.last_save_seconds = job.done_at - job.started

    def _fail(self, job: _Save, failed: List[Tuple[int, str]]) -> None:
        """Remove the .tmp, keep every committed step, raise the same CheckpointError on every rank."""
        self.have_steps.discard(job.step)
        free = self.group.gather(_free_bytes(self.dir))  # before the .tmp is gone: a full disk shows
        if self.rank == 0:
            storage.rmtree(job.tmp, ignore_errors=True)
        self.group.barrier()  # the .tmp is gone before any rank reports (and exits)
        prev = [step_name(s) for s in committed_steps(self.dir)]
        raise CheckpointError(f"checkpoint save of step {job.step} failed ({_why(failed, free, self.dir)}); the "
                              f"committed checkpoints are intact: {', '.join(prev) or 'none'}")

    def _commit_rank0(self, job: _Save, sums: Dict[str, Tuple[int, str]]) -> None:
        files = list_files(job.tmp)
        for entry in files:
            got = sums.get(entry["path"])
            if got is None or got[0] != entry["bytes"]:
                got = file_checksum(job.tmp / entry["path"])  # a file no rank claimed by name
            entry["checksum"] = got[1]
        manifest = new_manifest(self.info, step=job.step, world_size=self.world_size, versions=self._versions(),
                                files=files, save_seconds=job.done_at - job.started, is_async=job.is_async,
                                train_state=job.train_state, resumed_from=self.resumed_path)
        if job.val_loss is not None:
            manifest[VAL_LOSS] = job.val_loss
        body = _json(manifest)
        write_atomic(job.tmp / MANIFEST, lambda f: f.write(body))
        final, replaced = self._rename_into_place(job.tmp, job.step)
        # Committed. What follows is housekeeping: its failures warn, they do not fail the save.
        try:
            write_atomic(self.dir / LATEST, lambda f: f.write((final.name + "\n").encode()))
            size = sum(f["bytes"] for f in files)
            _print(f"checkpoint {final.name} committed ({size / 1e6:.1f} MB, {manifest['save_seconds']:.2f} s"
                   f"{', async' if job.is_async else ''})")
            if self.keep_best and update_best(self.dir, final, job.val_loss):
                _print(f"checkpoint {final.name} is the best so far (val_loss {job.val_loss:.4f}): checkpoints/{BEST}")
            self._remove_superseded(job.step, replaced)
            self._prune()
        except OSError as exc:
            print(f"checkpoint: warning: {final.name} is committed but housekeeping failed: {exc}",
                  file=sys.stderr, flush=True)

    def _rename_into_place(self, tmp: Path, step: int) -> Tuple[Path, Optional[Path]]:
        """Rename `tmp` to step_<N>; returns it and the previous/<n> folder an earlier step_<N> went to."""
        final = self.dir / step_name(step)
        aside = None
        if final.exists():  # a step_<N> of an abandoned timeline (or a damaged one): kept, moved aside
            aside = move_aside(self.dir.parent, [final])
        try:
            storage.replace(tmp, final)
        except OSError:
            if aside is not None:
                storage.replace(aside / final.relative_to(self.dir.parent), final)
            raise
        storage.fsync_dir(self.dir)
        return final, aside

    def _versions(self) -> dict:
        # Workers pass collect_versions(); it always sets mfsdp-launch, but torch is None for a
        # torch without package metadata (a source build).
        v = dict(self.info.get("versions") or collect_versions())
        if not v.get("torch"):
            import torch

            v["torch"] = torch.__version__
        return v

    def _remove_superseded(self, step: int, aside: Optional[Path]) -> None:
        """Move the step directories that are not this run's timeline to `aside` (where a replaced
        step_<step> went) or a new previous/<n>; one line names them. This run's timeline: the
        steps it saved and, when it resumed from this directory, those up to that step. (The
        launcher has moved them already, aside.py; this is for the ranks started without it.)"""
        own = self.resumed_path is not None and self.resumed_path.parent == self.dir
        later = [p for s, p in list_step_dirs(self.dir) if s > step or (not own and s not in self.have_steps)]
        moved = ([step_name(step)] if aside is not None else []) + [p.name for p in later]
        if later:
            aside = move_aside(self.dir.parent, later, into=aside)
        if not moved:
            return
        how = (f"it continued from {self.resumed_path.name}" if self.resumed_path is not None
               else "it started over")
        _print(f"moved the earlier {', '.join(moved)} to {aside}: a timeline this run replaced ({how}); "
               "nothing is deleted")

    def _prune(self) -> None:
        entries = [(s, p, inspect_checkpoint(p)[1] is None) for s, p in list_step_dirs(self.dir)]
        protect = [self.resumed_path] if self.resumed_path else []
        best = read_best(self.dir) if self.keep_best else None
        if best is not None:  # checkpoint.keep_best: never rotated away
            protect.append(best.path)
        for p in prune_plan(entries, self.keep_last, protect):
            storage.rmtree(p, ignore_errors=True)


def _json(manifest: dict) -> bytes:
    import json

    return json.dumps(manifest, indent=1, default=str).encode()


def _then(upload: Future, checksum, job: _Save) -> Future:
    """A future that resolves to `checksum()` once `upload` is done, computed in the writer's
    thread (so an async save's hashing does not block training), or to the upload's failure."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            f.result()
            result = checksum()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one: handed on
            job.done_at = time.perf_counter()
            out.set_exception(exc)
            return
        job.done_at = time.perf_counter()
        out.set_result(result)

    upload.add_done_callback(done)
    return out
