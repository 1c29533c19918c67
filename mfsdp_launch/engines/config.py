"""Each engine's config section (torch-free): the `engine.*` keys only that engine reads, as
NeMo Automodel's per-strategy configs do. configs/engine/*.yaml start from them."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.schema import EngineConfig


@dataclass
class FSDP2Config(EngineConfig):
    name: str = "fsdp2"


@dataclass
class MegatronFSDPConfig(EngineConfig):
    name: str = "megatron_fsdp"
    report_nan_in_param_grad: bool = False
    # Overlap/communication knobs passed through to fully_shard_model.
    keep_fp8_transpose_cache: bool = False
    use_decoupled_grad: bool = False
    # NCCL user buffers (symmetric registration: all-gather / reduce-scatter on ~5 SMs instead of
    # ~20, so overlapped GEMMs keep theirs; needs torch >= 2.11 and megatron-core or apex, whose
    # allocator also sets NCCL_NVLS_ENABLE=1). Turns on fsdp_double_buffer: persistent
    # communication buffers, more memory (docs/performance.md).
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    # Transformer Engine layers write each weight gradient straight into Megatron-FSDP's gradient
    # buffer (TE's fuse_wgrad_accumulation; Megatron-Core's gradient_accumulation_fusion) instead of
    # autograd's gradient being copied or added into it: engines/megatron_wgrad_fusion.py.
    fuse_wgrad_accumulation: bool = False
