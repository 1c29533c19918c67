"""The one resolve step: every derived value is filled here, once, before the config is frozen.
Validation afterwards only checks; workers read the frozen values."""

from __future__ import annotations

from ..core import hardware
from ..core.errors import ConfigError
from ..mesh import ParallelDims, world_size
from ..models import family
from ..core.dtypes import Dtype
from ..core.fp8 import fixed_format
from ..core.schema import SCHEDULED_KINDS, LauncherKind

AUTO = "auto"
NODES = "nodes"


def resolve(cfg) -> ParallelDims:
    """Fill derived values in place; returns the mesh degrees. Raises ConfigError."""
    auto = resolve_nproc(cfg.launcher)
    resolve_dp_outer(cfg.mesh, cfg.launcher)
    if auto:
        check_auto_mesh(cfg.mesh, cfg.launcher)
    dims = ParallelDims.from_config(cfg.mesh, world_size(cfg.launcher))
    cfg.mesh.dp_shard = dims.dp_shard  # the inferred degree (-1) as a number
    if cfg.precision.compute_dtype is None:
        cfg.precision.compute_dtype = Dtype.fp32
    fmt = fixed_format(cfg.fp8.recipe)
    if fmt is not None:
        cfg.fp8.format = fmt
    family(cfg.model.name).resolve(cfg.model, cfg.precision.compute_dtype)
    return dims


def resolve_nproc(lc) -> bool:
    """launcher.nproc_per_node as a number; `auto` counts this machine's GPUs (torch-free), or
    takes launcher.gpus_per_node for an sbatch script written on a login node. True if it was auto."""
    value = lc.nproc_per_node
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError("launcher.nproc_per_node", f"{value!r} is not a process count", "a positive integer, or auto")
    if isinstance(value, int):
        return False
    if value.strip().lower() != AUTO:
        if value.strip().isdigit():
            lc.nproc_per_node = int(value)
            return False
        raise ConfigError("launcher.nproc_per_node", f"{value!r} is not a process count", "a positive integer, or auto")
    if lc.kind in SCHEDULED_KINDS:
        if not lc.gpus_per_node:
            what = "an sbatch script runs" if lc.kind == LauncherKind.slurm else "the pods run"
            raise ConfigError("launcher.nproc_per_node", f"auto counts this machine's GPUs, but {what} "
                              "on other nodes", "a number, or auto with launcher.gpus_per_node=N")
        lc.nproc_per_node = int(lc.gpus_per_node)
        lc.nproc_auto = f"launcher.gpus_per_node={lc.nproc_per_node}"
        return True
    gpus = hardware.local_gpu_count()
    lc.nproc_per_node = gpus or hardware.CPU_AUTO_PROCESSES
    lc.nproc_auto = f"{gpus} visible GPU(s)" if gpus else f"no GPU here: {lc.nproc_per_node} CPU processes"
    return True


def resolve_dp_outer(mesh_cfg, lc) -> None:
    """mesh.dp_outer as a number; `nodes` is launcher.nnodes (one outer replica per node)."""
    value = mesh_cfg.dp_outer
    if isinstance(value, str) and value.strip().lower() == NODES:
        mesh_cfg.dp_outer = int(lc.nnodes)
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        mesh_cfg.dp_outer = int(value)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError("mesh.dp_outer", f"{value!r} is not a degree", "a positive integer, or nodes")


def check_auto_mesh(mesh_cfg, lc) -> None:
    """A recipe's fixed degrees (an HFSDP recipe's dp_outer=2) on a machine whose GPU count they do
    not divide: one line naming the override, rather than the mesh's generic arithmetic."""
    fixed = {d: int(getattr(mesh_cfg, d)) for d in ("dp_outer", "cp", "tp")}
    product = fixed["dp_outer"] * fixed["cp"] * fixed["tp"]
    world = world_size(lc)
    if product > 0 and world % product == 0:
        return
    key = max(fixed, key=lambda d: fixed[d])
    raise ConfigError(f"mesh.{key}", f"{fixed[key]} does not divide the world size {world} "
                      f"(launcher.nproc_per_node=auto: {lc.nproc_auto})",
                      f"mesh.{key}=1 for plain FSDP on {world} process(es), or launcher.nproc_per_node=N")
