"""Per-rank memory estimate for the dry run: what each ZeRO stage and outer strategy keeps where.

A model of the engine's buffers, not a measurement: parameters in compute dtype, main (fp32)
weights, gradients and Adam's two moments, each divided by the ranks that shard it, plus one
gathered FSDP unit (twice, for prefetch) and activations (from the model family, following
`model.activation_checkpointing` and `mesh.tp`).

Before a job spawns, `check_fits` compares the estimate with the GPU's memory (`gpu_memory_bytes`,
from nvidia-smi, no torch): a config that cannot fit is one line, unless `launcher.force_memory`.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Dict, Optional

from .config.dtypes import Dtype
from .config.sharding import shard_factors
from .errors import ConfigError
from .mesh import ParallelDims
from .models import family

GIB = 1024**3


@dataclass
class MemoryEstimate:
    params: float
    main_params: float
    grads: float
    optimizer: float
    gathered_units: float
    activations: float

    @property
    def total(self) -> float:
        return sum(self.as_dict().values())

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


def estimate(cfg, dims: ParallelDims) -> MemoryEstimate:
    fam, m, pc = family(cfg.model.name), cfg.model, cfg.precision
    n = fam.param_count(m)
    compute_b = Dtype(pc.compute_dtype or Dtype.fp32).bytes
    main_b = Dtype(pc.main_params_dtype).bytes if pc.main_params_dtype else 0
    if pc.main_params_dtype == pc.compute_dtype:
        main_b = 0  # the compute weights are the main weights
    grad_b = Dtype(pc.main_grads_dtype or pc.compute_dtype or Dtype.fp32).bytes
    optim_b = 2 * Dtype(pc.main_params_dtype or Dtype.fp32).bytes
    f = shard_factors(cfg.sharding.zero_dp_strategy, cfg.sharding.outer_dp_sharding_strategy,
                      dims.shard_size, dims.dp_outer)
    # With model.fsdp_unit_modules overriding a built-in family's units they are unknown here: the
    # whole model bounds it. Measured families (custom, hf) know theirs.
    unit = n if m.fsdp_unit_modules and not fam.measured else fam.largest_unit_params(m)
    if dims.tp > 1 and fam.dtensor_tp:
        n, unit = _tp_params(fam, m, n, unit, dims.tp)
        act = fam.activation_bytes(m, cfg.train.micro_batch_size, cfg.train.seq_len, compute_b, tp=dims.tp)
    else:  # the seed's toys replicate over tp
        act = fam.activation_bytes(m, cfg.train.micro_batch_size, cfg.train.seq_len, compute_b)
    return MemoryEstimate(
        params=n * compute_b / f["params"],
        main_params=n * main_b / f["main_params"],
        grads=n * grad_b / f["grads"],
        optimizer=n * optim_b / f["optimizer"],
        gathered_units=2 * unit * compute_b if f["params"] > 1 else 0.0,
        activations=act / max(dims.cp, 1),
    )


def _tp_params(fam, m, n: int, unit: int, tp: int):
    """(params, largest unit) per rank under DTensor TP (models/parallelize.py): the blocks' linear
    weights split over tp; embedding, norms and head stay whole. When a block is the largest unit
    it shrinks too (if the root then becomes larger, this underestimates the gathered unit)."""
    from .models.llama_dims import layer_params

    d = fam.dims(m)
    per_layer = layer_params(d) - 2 * d.dim
    if unit == layer_params(d):
        unit -= per_layer * (1 - 1 / tp)
    return n - d.n_layers * per_layer * (1 - 1 / tp), unit


HINT = "try model.activation_checkpointing=full, mesh.tp=2 or a smaller train.micro_batch_size"


def check_fits(needed_bytes: float, device_bytes: Optional[float], *, force: bool = False) -> Optional[str]:
    """Refuse (ConfigError) a per-GPU estimate above the device's memory; with `force`, return the
    same sentence as a warning. Nothing when the device memory is unknown (no GPU, no nvidia-smi)."""
    if device_bytes is None or needed_bytes <= device_bytes:
        return None
    msg = f"needs ~{needed_bytes / GIB:.1f} GiB per GPU, the GPU has {device_bytes / GIB:.1f}: {HINT}"
    if force:
        return msg + " (launcher.force_memory=true: starting anyway)"
    raise ConfigError("memory", msg, "launcher.force_memory=true to start anyway")


def gpu_memory_bytes() -> Optional[float]:
    """Total memory of the smallest visible NVIDIA GPU, from nvidia-smi (no torch, no CUDA init);
    None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_memory_total(out)


def parse_memory_total(text: str) -> Optional[float]:
    """nvidia-smi's `memory.total` lines (MiB, one per GPU) -> bytes of the smallest GPU."""
    mib = [float(line) for line in (line.strip() for line in text.splitlines()) if line.replace(".", "", 1).isdigit()]
    return min(mib) * 1024**2 if mib else None
