"""Megatron-FSDP's arguments as a pure mapping from the config: no CUDA, no process group, unit-tested
on CPU (tests/unit/engines/test_engine_megatron_args.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from ..core.dtypes import Dtype
from ..core.sharding import OuterStrategy, ZeroStrategy, check_sharding


@dataclass(frozen=True)
class MegatronPlan:
    """Everything `MegatronFSDPEngine` passes to Megatron-FSDP, as plain values.

    Mesh dims and groups are named (resolved against the DeviceMesh at shard time); dtypes are
    config names ("fp32", "bf16", ...) or None.
    """

    use_mesh: bool  # False: Megatron-FSDP builds its own (world, 1) mesh ("ez" path)
    dp_shard_dim: Optional[str]
    dp_outer_dim: Optional[str]
    tp_dim: Optional[str]
    hybrid_fsdp_group_dim: Optional[str]  # mesh dim whose group is hybrid_fsdp_group
    zero_dp_strategy: str
    outer_dp_sharding_strategy: str
    compute_dtype: Optional[str]
    main_params_dtype: Optional[str]
    main_grads_dtype: Optional[str]
    grad_comm_dtype: Optional[str]
    init_model_with_meta_device: bool
    sync_model_each_microbatch: bool
    keep_fp8_transpose_cache: bool
    use_decoupled_grad: bool
    report_nan_in_param_grad: bool
    cuda_graph_mode: bool
    nccl_ub: bool
    fsdp_double_buffer: bool
    fuse_wgrad_accumulation: bool  # applied after wrapping (engines/megatron_wgrad_fusion.py)
    # Group over which gradient shards are disjoint: "none" (full replicas), "fsdp"
    # (dp_shard[_cp]) or "hybrid" (dp_outer x dp_shard[_cp], HFSDP).
    grad_norm_group: str
    # "dtensor": Megatron-FSDP's uneven DTensors; "replicated": plain full tensors (no_shard).
    checkpoint_format: str

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def plan_megatron_fsdp(dims, sharding_cfg, precision_cfg, engine_cfg, *, mesh_enabled: bool = True,
                       init_on_meta: bool = False, cuda_graph: bool = False) -> MegatronPlan:
    """Map the config onto Megatron-FSDP's arguments. Pure: no CUDA, no process group.

    Raises ConfigError for combinations Megatron-FSDP refuses (the same rule validation applies, so
    a programmatic caller that skipped validation gets the one-line error, not a deep one).
    """
    zero = ZeroStrategy(sharding_cfg.zero_dp_strategy)
    outer = OuterStrategy(sharding_cfg.outer_dp_sharding_strategy)
    # dp_outer=1 (the seed's (1,2,2,2) mesh with outer optim) is plain FSDP: no hybrid group.
    hybrid = mesh_enabled and dims.dp_outer > 1
    check_sharding(zero, outer, dp_outer=dims.dp_outer, meta_init=init_on_meta)
    pc = precision_cfg

    def name(dtype) -> Optional[str]:
        return None if dtype is None else Dtype(dtype).value

    if zero is ZeroStrategy.no_shard:
        norm_group = "none"
    elif outer is OuterStrategy.optim and hybrid:
        norm_group = "hybrid"
    else:
        norm_group = "fsdp"
    if mesh_enabled:
        shard_dim = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
        outer_dim = "dp_outer" if hybrid else None
        hybrid_dim = "hsdp" if hybrid else None
        tp_dim = "tp"
    else:
        shard_dim = outer_dim = hybrid_dim = tp_dim = None
    return MegatronPlan(
        use_mesh=bool(mesh_enabled),
        dp_shard_dim=shard_dim,
        dp_outer_dim=outer_dim,
        tp_dim=tp_dim,
        hybrid_fsdp_group_dim=hybrid_dim,
        zero_dp_strategy=zero.name,
        outer_dp_sharding_strategy=outer.name if hybrid else "no_shard",
        compute_dtype=name(pc.compute_dtype) or "fp32",
        main_params_dtype=name(pc.main_params_dtype),
        main_grads_dtype=name(pc.main_grads_dtype),
        grad_comm_dtype=name(pc.grad_comm_dtype),
        init_model_with_meta_device=bool(init_on_meta),
        sync_model_each_microbatch=bool(engine_cfg.sync_every_microbatch),
        keep_fp8_transpose_cache=bool(engine_cfg.keep_fp8_transpose_cache),
        use_decoupled_grad=bool(engine_cfg.use_decoupled_grad),
        report_nan_in_param_grad=bool(engine_cfg.report_nan_in_param_grad),
        cuda_graph_mode=bool(cuda_graph),
        nccl_ub=bool(engine_cfg.nccl_ub),
        fsdp_double_buffer=bool(engine_cfg.fsdp_double_buffer or engine_cfg.nccl_ub),
        fuse_wgrad_accumulation=bool(engine_cfg.fuse_wgrad_accumulation),
        grad_norm_group=norm_group,
        checkpoint_format="replicated" if zero is ZeroStrategy.no_shard else "dtensor",
    )
