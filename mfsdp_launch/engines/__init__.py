"""The sharding engines: what each can do (a torch-free table that validation reads) and how to
get one (imported lazily: each engine module imports its backend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet

from ..core.dtypes import WIDE_DTYPES, Dtype
from ..core.sharding import OuterStrategy, ZeroStrategy
from ..core.errors import ConfigError
from ..core.parallel import Parallel
from ..core.schema import EngineConfig
from .config import FSDP2Config, MegatronFSDPConfig
from ..core.names import import_object


@dataclass(frozen=True)
class EngineCaps:
    name: str
    target: str  # "module:Class", imported by get_engine
    needs_cuda: bool
    zero: FrozenSet[ZeroStrategy]
    outer: FrozenSet[OuterStrategy]
    fp8_params: bool  # TE quantized (FP8) primary weights
    te_fused_optim: bool
    cuda_graph: bool  # full-iteration CUDA graphs
    default_mesh: bool  # mesh.enabled=false: the engine builds its own
    main_params_dtypes: FrozenSet = frozenset({None, *Dtype})
    # The ways of using mesh.tp / mesh.cp (core/parallel.py) it can shard around.
    tp_modes: FrozenSet[str] = frozenset()
    cp_modes: FrozenSet[str] = frozenset()
    why_not: str = ""  # appended to refusals: what to use instead
    # optim.name=muon (components/muon.py): Newton-Schulz on DTensor parameters, gathered one at a time.
    muon: bool = False
    # train.cpu_offload: sharded parameters, gradients and optimizer state in host memory.
    cpu_offload: bool = False
    # fp8.recipe=torchao_*: torchao float8 layers under this engine, and whether torchao_tensorwise
    # all-gathers their weights in FP8 (torchao's hooks are FSDP2's; elsewhere the cast follows the
    # all-gather, as rowwise's always does).
    linear_fp8: bool = False
    torchao_fp8_all_gather: bool = False
    # fp8.cache_weight_casts: fused_rowwise layers keep their weight casts in buffers of their own
    # across a step's micro-batches (components/fp8_linear.py); run under FSDP2 only.
    fp8_weight_cache: bool = False
    # mesh.ep > 1: expert weights sharded over the expert-data-parallel ranks (models/llama/expert_parallel.py).
    expert_parallel: bool = False
    section: type = EngineConfig  # its `engine` config section (engines/config.py)


ENGINES: Dict[str, EngineCaps] = {
    caps.name: caps
    for caps in (
        EngineCaps(
            name="megatron_fsdp", target="mfsdp_launch.engines.megatron:MegatronFSDPEngine", needs_cuda=True,
            zero=frozenset(ZeroStrategy), outer=frozenset(OuterStrategy),
            fp8_params=True, te_fused_optim=True, cuda_graph=True, default_mesh=True,
            # torchao's Float8Linear keeps an ordinary weight (without FP8 all-gather), so the engine's
            # buffers hold it as any Linear's; the MoE experts' FP8 grouped GEMM reads plain weights.
            linear_fp8=True,
            # Its own tp/cp mesh dims: TE layers' groups, or replicas over them (the seed's toys);
            # it averages gradients over dp_shard x cp, so all-gather attention runs too.
            tp_modes=frozenset({Parallel.TE, Parallel.REPLICATE}),
            cp_modes=frozenset({Parallel.TE, Parallel.REPLICATE, Parallel.ALLGATHER}),
            # mesh.ep > 1 not yet: the expert mesh is built and passed (engines/megatron_experts.py;
            # at ep=1 the experts are its expert parameters), but its expert shards at ep > 1 hold
            # [experts/ep, ...] tensors that DCP cannot reshard across ep, and 2-GPU EP is the
            # multi-GPU issue's.
            expert_parallel=False,
            section=MegatronFSDPConfig,
        ),
        EngineCaps(
            # FSDP2 shards only over the data-parallel dims; ZeRO-1 and HFSDP have no FSDP2 form, and
            # its sharded parameters are the main weights, so they must be wide.
            name="fsdp2", target="mfsdp_launch.engines.fsdp2:FSDP2Engine", needs_cuda=False,
            zero=frozenset({ZeroStrategy.no_shard, ZeroStrategy.optim_grads, ZeroStrategy.optim_grads_params}),
            outer=frozenset({OuterStrategy.no_shard}), fp8_params=False,
            te_fused_optim=False, cuda_graph=False, default_mesh=False,
            main_params_dtypes=frozenset({None, *WIDE_DTYPES}), why_not="use engine=megatron_fsdp",
            # A 2-D mesh: FSDP over dp (x cp, the flattened dp_shard_cp dim), DTensor TP over tp.
            tp_modes=frozenset({Parallel.DTENSOR}), cp_modes=frozenset({Parallel.ALLGATHER}), section=FSDP2Config,
            muon=True,
            # CPUOffloadPolicy; torchao's Float8Linear and its FP8 all-gather are built for fully_shard.
            cpu_offload=True, linear_fp8=True, torchao_fp8_all_gather=True, fp8_weight_cache=True,
            # The experts' own fully_shard over the expert-data-parallel mesh, as torchtitan's.
            expert_parallel=True,
        ),
    )
}


def engine_caps(name: str) -> EngineCaps:
    if name not in ENGINES:
        raise ConfigError("engine", f"unknown engine {name!r}", list(ENGINES))
    return ENGINES[name]


def get_engine(name: str, **kwargs):
    """An Engine instance (see engines/base.py) of the named engine."""
    return import_object(engine_caps(name).target, key="engine")(**kwargs)


__all__ = ["ENGINES", "EngineCaps", "engine_caps", "get_engine"]
