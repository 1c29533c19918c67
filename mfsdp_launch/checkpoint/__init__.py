"""Checkpoints: sharded (DCP), checksummed, committed atomically, resumable at another world size.

Layout, in ``run.dir/checkpoints/``::

    step_<N>/            a committed checkpoint (it has a manifest.json naming every file)
        .metadata, __<r>_0.distcp   DCP checkpoint of {"model": ..., "optimizer": ...}
        extra_rank<r>.pt            rank r's RNG states (torch CPU, CUDA, python, numpy)
        trainer.json                step, tokens_seen, consumed_samples, LR scheduler state
        scheduler.pt                only when the scheduler state is not JSON-able
        manifest.json               written LAST: step, config hash, model/mesh/engine sections,
                                    world size, versions, times, every file with size and checksum
    step_<N>.tmp/        a save in progress (or a crashed one): never a resume point
    latest               the name of the newest committed step directory, for people and tools

The rooms, each one concept:

    layout.py      names on disk, stale `.tmp` cleanup, pruning            (pure Python)
    integrity.py   is a step intact: sizes (cheap), checksums (xxh3-64)    (pure Python)
    find.py        the newest intact step, a given step, a user's path     (pure Python)
    manifest.py    what a checkpoint records; which config changes resume  (pure Python)
    adapters.py    a LoRA run's checkpoint: adapters only, the base's reference
    plan.py        the resume decision, and the launcher's preflight       (pure Python)
    aside.py       what a run would replace goes to run.dir/previous/<n>/  (pure Python)
    state.py       the small objects that save themselves (RNG, trainer.json)
    commit.py      the save/commit protocol (collective)
    load.py        verify a step's checksums in parallel, then load it
    reader.py      DCP's reader of a step, on disk or in an object store
    manager.py     CheckpointManager: what a worker holds
    collective.py  gather/broadcast on the checkpoint's CPU group
    core/errors.py      CheckpointError; DCP's BaseException caught for real, told in one line

run.dir may be an object store (s3://, gs://): every module reaches files through core/storage.py,
and a step directory is then a prefix (its rename copies each object, then deletes the source).

A checksum mismatch at resume counts as damage: the previous intact step is used, with one line
naming the file, or the run refuses (one line) when none is left. Importing this package (and
everything the launcher calls: preflight, finding, cleaning) never imports torch.
"""

from .errors import CheckpointError
from .find import Found, committed_steps, find_latest, require_step, resolve_checkpoint
from .integrity import CHECKSUM, file_checksum, inspect_checkpoint, verify_checksums
from .layout import (CHECKPOINTS, DCP_METADATA, LATEST, MANIFEST, SCHEDULER_FILE, TMP_SUFFIX, TRAINER, checkpoints_dir, clean_stale, list_files, list_step_dirs, parse_step, prune_plan, read_latest_pointer, stale_tmp_entries, step_name, write_atomic)
from .load import quiet_single_process_warnings, saved_model_keys
from .manager import CheckpointManager
from .manifest import (collect_versions, config_changes, incompatibilities, manifest_info_from_config, model_section, model_shape)
from .plan import ResumePlan, plan_resume, preflight
from .state import Stateful

__all__ = [
    "CHECKPOINTS", "CHECKSUM", "DCP_METADATA", "LATEST", "MANIFEST", "SCHEDULER_FILE", "TMP_SUFFIX", "TRAINER",
    "CheckpointError", "CheckpointManager", "Found", "ResumePlan", "Stateful", "checkpoints_dir", "clean_stale",
    "collect_versions", "committed_steps", "config_changes", "file_checksum", "find_latest", "incompatibilities",
    "inspect_checkpoint", "list_files", "list_step_dirs", "manifest_info_from_config", "model_section",
    "model_shape", "parse_step", "plan_resume", "preflight", "prune_plan", "quiet_single_process_warnings",
    "read_latest_pointer", "require_step", "resolve_checkpoint", "saved_model_keys", "stale_tmp_entries",
    "step_name", "verify_checksums", "write_atomic",
]
