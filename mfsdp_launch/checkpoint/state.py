"""The objects a checkpoint holds besides the sharded model and optimizer: each saves itself
(`state_dict()` / `load_state_dict()`), and this module says in which file.

* `extra_rank<r>.pt`, rank r: its RNG states (`rng.RNGState`).
* `trainer.json`, rank 0: the step, the train/data position (`loop.TrainState`: step,
  tokens_seen, consumed_samples; the data module derives its positions from them) and the LR
  scheduler's state (`scheduler.pt` when that is not JSON-able).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Dict, Optional, Protocol

from ..components.rng import RNGState, fallback_seed, seed_all
from .layout import SCHEDULER_FILE, TRAINER, rank_file, write_atomic
from .manifest import plain


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _jsonable(obj) -> bool:
    try:
        json.dumps(obj, allow_nan=True)
        return True
    except (TypeError, ValueError):
        return False


def write_rank_state(tmp: Path, *, step: int, rank: int, world_size: int) -> None:
    """This rank's RNG states, into its own file."""
    import torch

    extra = {"rank": rank, "world_size": world_size, "step": step, "rng": RNGState().state_dict()}
    write_atomic(tmp / rank_file(rank), lambda f: torch.save(extra, f))


def write_trainer(tmp: Path, *, step: int, scheduler: Optional[Stateful], train_state: Optional[Stateful]) -> Any:
    """trainer.json (and scheduler.pt) on rank 0; returns the train state as written, for the manifest."""
    ts = train_state.state_dict() if train_state is not None else None
    trainer: Dict[str, Any] = {"step": step, "train_state": plain(ts)}
    if isinstance(ts, dict):
        for k in ("tokens_seen", "consumed_samples"):
            if k in ts:
                trainer[k] = ts[k]
    if scheduler is not None:
        sd = scheduler.state_dict()
        if _jsonable(sd):
            trainer["scheduler"] = sd
        else:
            import torch

            write_atomic(tmp / SCHEDULER_FILE, lambda f: torch.save(sd, f))
            trainer["scheduler"] = None
            trainer["scheduler_file"] = SCHEDULER_FILE
    write_atomic(tmp / TRAINER, lambda f: f.write(json.dumps(trainer, indent=1).encode()))
    return trainer["train_state"]


def read_trainer(path: Path) -> dict:
    """trainer.json of a step directory, with "scheduler" filled from scheduler.pt when it is there."""
    trainer = json.loads((path / TRAINER).read_text())
    if trainer.get("scheduler") is None and trainer.get("scheduler_file"):
        import torch

        trainer["scheduler"] = torch.load(io.BytesIO((path / trainer["scheduler_file"]).read_bytes()), weights_only=False)
    return trainer


def load_rank_state(path: Path, *, rank: int, seed: int, step: int) -> bool:
    """Restore this rank's RNG states; a rank the checkpoint has no file for (it was saved at a
    smaller world size) seeds from (seed, rank, step). Returns whether a saved state was found."""
    import torch

    f = path / rank_file(rank)
    if f.is_file():
        RNGState().load_state_dict(torch.load(io.BytesIO(f.read_bytes()), weights_only=True).get("rng", {}))
        return True
    seed_all(fallback_seed(seed, rank, step))
    return False
