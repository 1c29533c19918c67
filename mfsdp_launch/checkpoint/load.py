"""Loading a committed step: its checksums first (each rank reads a share), then a full resume or
the model weights only.

* Full resume: model and optimizer through DCP (it reshards to any world size), then the
  configured optimizer hyper-parameters and base LR are put back (`optim.keep_config_hparams`,
  `optim.load_schedule`), then the train position and this rank's RNG states.
* Weights only: the model's tensors, matched by name after stripping wrapper prefixes, so weights
  load across engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

from ..core.errors import ConfigError
from . import adapters
from .collective import Group
from .errors import CheckpointError, describe
from .find import Found
from .integrity import has_checksums, share, verify_checksums
from .reader import dcp_reader
from .state import load_rank_state, read_trainer


def _print(msg: str) -> None:
    print(msg, flush=True)


def quiet_single_process_warnings() -> None:
    """DCP warns at every call without a process group; in a single process that is the intent."""
    import warnings

    warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable")


def verify(found: Found, group: Group, rank: int) -> Optional[str]:
    """Collective: every rank checks the checksums of its share of the files (about 1/world of the
    bytes, several files at once). Returns the first problem found, None when all match. A file
    that cannot be read raises CheckpointError: an unreadable disk is not a damaged checkpoint."""
    if not has_checksums(found.manifest):  # written before checksums: the size check it passed
        return None
    problem = error = None
    try:
        problem = verify_checksums(found.path, found.manifest, files=share(found.manifest, rank, group.world_size))
    except OSError as exc:
        error = describe(exc)
    results = group.gather((problem, error))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(results) if e]
    if errors:
        raise CheckpointError(f"cannot read {found.path} to verify its checksums ({'; '.join(errors[:4])})")
    return next((p for p, _ in results if p), None)


def load_full(found: Found, *, engine, model, optimizer, scheduler, train_state, group: Group, rank: int,
              world_size: int, seed: int) -> int:
    """Load everything of `found`; returns the step training continues from. Collective."""
    import torch.distributed.checkpoint as dcp

    from ..components.optim import config_hparams, keep_config_hparams, load_schedule

    path = found.path
    fresh = config_hparams(optimizer) if optimizer is not None else []
    only = adapters.of(found.manifest) is not None  # LoRA: the base came from its directory
    state = adapters.checkpoint_state(engine, model, optimizer, only)
    dcp.load(state, checkpoint_id=str(path), process_group=group.pg)
    engine.load_state_dict(model, optimizer, state, strict=not only)

    trainer = read_trainer(path)
    notes = keep_config_hparams(optimizer, fresh) if optimizer is not None else []
    if scheduler is not None and trainer.get("scheduler") is not None:
        notes += load_schedule(scheduler, optimizer, trainer["scheduler"])
    if train_state is not None and trainer.get("train_state") is not None:
        train_state.load_state_dict(trainer["train_state"])
    step = int(trainer.get("step", found.step))
    load_rank_state(path, rank=rank, seed=seed, step=step)
    old_ws = found.manifest.get("world_size")
    if isinstance(old_ws, int) and old_ws < world_size:
        notes.append(f"ranks {old_ws}..{world_size - 1} have no saved RNG state: seeded from "
                     "(train.seed, rank, step)")
    if rank == 0 and notes:
        _print("; ".join(notes))
    return step


def saved_model_keys(md, *, path, key: str) -> Dict[str, str]:
    """{name without wrapper prefixes: saved key without "model."} of a DCP checkpoint's metadata;
    a ConfigError under `key` when two saved keys map to one name."""
    from ..engines.base import strip_prefixes

    out: Dict[str, str] = {}
    for k in md.state_dict_metadata:
        if k.startswith("model."):
            sub = k[len("model."):]
            name = strip_prefixes(sub)
            if name in out:
                raise ConfigError(key, f"{path}: keys {sub!r} and another both map to {name!r}")
            out[name] = sub
    return out


def load_weights(engine, model, path: Path, group: Group, *, adapters_only: bool = False) -> None:
    """Model weights only, matched by name after stripping wrapper prefixes (any engine); a LoRA
    run's adapters only."""
    import torch
    import torch.distributed.checkpoint as dcp
    from ..engines.base import strip_prefixes

    md = dcp_reader(path).read_metadata()
    by_name = saved_model_keys(md, path=path, key="checkpoint.load_path")
    ours = adapters.checkpoint_state(engine, model, None, adapters_only)["model"]
    request, missing, saved_of = {}, [], {}
    for k, v in ours.items():
        name = strip_prefixes(k)
        if name in by_name:
            saved_of[k] = by_name[name]
            request[saved_of[k]] = v
        elif isinstance(v, torch.Tensor):
            missing.append(name)
    if missing:
        raise ConfigError("checkpoint.load_path", f"{path} has no weights for {', '.join(missing[:4])}"
                          + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""))
    dcp.load({"model": request}, checkpoint_id=str(path), process_group=group.pg)
    loaded = {k: request[saved] for k, saved in saved_of.items()}
    engine.load_state_dict(model, None, {"model": loaded}, strict=not adapters_only)
