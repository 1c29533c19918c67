"""Per-rank memory estimate for the dry run: what each ZeRO stage and outer strategy keeps where.

A model of the engine's buffers, not a measurement: parameters in compute dtype, main (fp32)
weights, gradients and Adam's two moments, each divided by the ranks that shard it, plus one
gathered FSDP unit (twice, for prefetch) and activations (from the model family).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict

from .config.dtypes import Dtype
from .config.sharding import shard_factors
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
    # With model.fsdp_unit_modules overridden the units are unknown here: the whole model bounds it.
    unit = n if m.fsdp_unit_modules else fam.largest_unit_params(m)
    act = fam.activation_bytes(m, cfg.train.micro_batch_size, cfg.train.seq_len, compute_b)
    return MemoryEstimate(
        params=n * compute_b / f["params"],
        main_params=n * main_b / f["main_params"],
        grads=n * grad_b / f["grads"],
        optimizer=n * optim_b / f["optimizer"],
        gathered_units=2 * unit * compute_b if f["params"] > 1 else 0.0,
        activations=act / max(dims.cp, 1),
    )
