"""A committed checkpoint's model weights, read in one process without a process group (any
machine, any world size): what `mfsdp-export` and the Hugging Face export write out, and what
`mfsdp-generate` / `mfsdp-eval` load (tools/plain_model.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Dict

from ..core import storage
from ..core.console import eprint
from ..core.errors import ConfigError

if TYPE_CHECKING:
    import torch


def read_model_state(ckpt: str | os.PathLike, *, prog: str = "mfsdp-export") -> tuple[Dict[str, "torch.Tensor"], object]:
    """The unwrapped model tensors of a committed checkpoint (checksums verified), and its Found
    record. `prog` names the tool in the warning about a damaged step skipped."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from . import CheckpointError, quiet_single_process_warnings, saved_model_keys
    from .reader import dcp_reader
    from .errors import dcp_failures, describe

    quiet_single_process_warnings()

    found = resolve_verified(ckpt, prog=prog)
    try:
        reader = dcp_reader(found.path)
        md = reader.read_metadata()
        saved = {}  # {name: saved key} of the tensors only
        for name, key in saved_model_keys(md, path=found.path, key="CKPT_DIR").items():
            if isinstance(md.state_dict_metadata["model." + key], TensorStorageMetadata):
                saved[name] = key
        if not saved:
            raise ConfigError("CKPT_DIR", f"{found.path} holds no model tensors")
        request: Dict[str, torch.Tensor] = {}
        for key in saved.values():
            meta = md.state_dict_metadata["model." + key]
            request[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        dcp.load({"model": request}, storage_reader=reader, no_dist=True)
    except ConfigError:
        raise
    except dcp_failures() as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"cannot read {found.path} ({describe(exc)})") from exc
    return {name: request[key] for name, key in saved.items()}, found


def resolve_verified(ckpt: str | os.PathLike, *, prog: str = "mfsdp-export"):
    """The checkpoint CKPT names, its checksums verified. A run or checkpoints directory falls back
    past a step that fails them (one warning line each); a step directory that fails is refused."""
    from . import resolve_checkpoint, verify_checksums

    damaged: dict = {}
    while True:
        found = resolve_checkpoint(ckpt, key="CKPT_DIR", damaged=damaged)
        problem = verify_checksums(found.path, found.manifest)
        if problem is None:
            return found
        if found.path == storage.path(ckpt).expanduser().absolute():
            raise ConfigError("CKPT_DIR", f"{found.path} is damaged ({problem})")
        eprint(f"{prog}: warning: {found.name} is damaged ({problem}); trying the step before it")
        damaged[found.path] = problem
