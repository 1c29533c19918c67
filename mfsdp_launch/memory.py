"""Per-rank memory estimate for the dry run: what each ZeRO stage and outer strategy keeps where.

A model of the engine's buffers, not a measurement: parameters in compute dtype, main (fp32)
weights, gradients and Adam's two moments, each divided by the ranks that shard it, plus one
gathered FSDP unit (twice, for prefetch) and activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .mesh import ParallelDims
from .precision import DTYPE_BYTES

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
        return {
            "params": self.params,
            "main_params": self.main_params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "gathered_units": self.gathered_units,
            "activations": self.activations,
        }


def shard_factors(zero: str, outer: str, dims: ParallelDims) -> Dict[str, int]:
    """How many ranks share each kind of state, per ZeRO stage (0-3) and outer strategy."""
    inner = dims.shard_size
    full = inner * (dims.dp_outer if outer == "optim" else 1)
    stage = ("no_shard", "optim", "optim_grads", "optim_grads_params").index(zero)
    return {
        "optimizer": full if stage >= 1 else 1,
        "main_params": full if stage >= 1 else 1,
        "grads": (full if stage >= 2 else 1),
        "params": (full if stage >= 3 else 1),
    }


def estimate(cfg, dims: ParallelDims) -> MemoryEstimate:
    from .models import sizes

    n = sizes.param_count(cfg.model)
    pc = cfg.precision
    compute_b = DTYPE_BYTES[pc.compute_dtype or "fp32"]
    main_b = DTYPE_BYTES[pc.main_params_dtype] if pc.main_params_dtype else 0
    if pc.main_params_dtype == pc.compute_dtype:
        main_b = 0  # the compute weights are the main weights
    grad_b = DTYPE_BYTES[pc.main_grads_dtype or pc.compute_dtype or "fp32"]
    f = shard_factors(cfg.sharding.zero_dp_strategy, cfg.sharding.outer_dp_sharding_strategy, dims)
    optim_b = 2 * DTYPE_BYTES[pc.main_params_dtype or "fp32"]
    params = n * compute_b / f["params"]
    unit = sizes.largest_unit_params(cfg.model) if hasattr(sizes, "largest_unit_params") else 0
    gathered = 2 * unit * compute_b if f["params"] > 1 else 0.0
    act = sizes.activation_bytes(cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len, compute_b)
    return MemoryEstimate(
        params=params,
        main_params=n * main_b / f["main_params"],
        grads=n * grad_b / f["grads"],
        optimizer=n * optim_b / f["optimizer"],
        gathered_units=gathered,
        activations=act / max(dims.cp, 1),
    )
