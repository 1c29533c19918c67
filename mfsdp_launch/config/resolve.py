"""The one resolve step: every derived value is filled here, once, before the config is frozen.
Validation afterwards only checks; workers read the frozen values."""

from __future__ import annotations

from ..mesh import ParallelDims, world_size
from ..models import family
from .dtypes import Dtype
from .fp8 import fixed_format


def resolve(cfg) -> ParallelDims:
    """Fill derived values in place; returns the mesh degrees. Raises ConfigError."""
    dims = ParallelDims.from_config(cfg.mesh, world_size(cfg.launcher))
    cfg.mesh.dp_shard = dims.dp_shard  # the inferred degree (-1) as a number
    if cfg.precision.compute_dtype is None:
        cfg.precision.compute_dtype = Dtype.fp32
    fmt = fixed_format(cfg.fp8.recipe)
    if fmt is not None:
        cfg.fp8.format = fmt
    family(cfg.model.name).resolve(cfg.model, cfg.precision.compute_dtype)
    return dims
