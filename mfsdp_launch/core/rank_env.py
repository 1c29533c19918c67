"""What a rank process is started with, by torchrun (launcher/launch.py) or by an sbatch script (launcher/slurm.py):
its module, this package on its PYTHONPATH, and the NCCL diagnostics settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from . import rundir

DEFAULT_RDZV_PORT_BASE = 20000  # the port is derived from the job id: two jobs never share one


def rendezvous_port(job_id) -> int:
    """The c10d port of a SLURM job: derived from its id, so two jobs never share one."""
    return DEFAULT_RDZV_PORT_BASE + int(job_id) % 20000


def first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist like 'gpu[003-004,007],cpu01'."""
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        return prefix + rest.rstrip("]").split(",")[0].split("-")[0]
    return head


NCCL_TRACE_ENTRIES = "2000"  # flight recorder ring size per process group (PyTorch's suggested size)


def rank_module() -> str:
    return "mfsdp_launch.rank"


def package_root() -> str:
    """The folder holding this package (a source checkout or site-packages): put on the workers'
    PYTHONPATH so that they import this package the way the launcher did."""
    return str(Path(__file__).resolve().parent.parent)


def diagnostics_env(run_dir: Optional[Path], environ=None, torch_version: Optional[str] = None) -> dict:
    """The flight recorder on (the last collectives of every process group, dumped on a stall or
    an NCCL timeout into run.dir/logs), unless the user set these variables. torch 2.8 renamed
    TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE (and warns about the old names)."""
    environ = os.environ if environ is None else environ
    new_names = _torch_at_least(torch_version, (2, 8))
    size_keys = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    file_keys = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    env = {}
    if not any(k in environ for k in size_keys):
        env[size_keys[0] if new_names else size_keys[1]] = NCCL_TRACE_ENTRIES
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if run_dir is not None:
        env["MFSDP_RUN_DIR"] = str(run_dir)
        if not any(k in environ for k in file_keys):
            # torch appends the rank to this prefix
            env[file_keys[0] if new_names else file_keys[1]] = str(
                Path(run_dir) / rundir.LOGS / rundir.FLIGHT_RECORDER_TIMEOUT)
    return env


def _torch_at_least(version: Optional[str], wanted: tuple) -> bool:
    """Compare the installed torch's version without importing torch."""
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return True
    parts = []
    for p in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= wanted
