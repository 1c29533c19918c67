"""The gradient scaling of Megatron-FSDP 0.6.1's buffers, corrected after `fully_shard_model`.

Megatron-FSDP averages gradients over the data-parallel ranks by a factor on each gradient buffer
(1/dp), applied before the reduce (`gradient_reduce_preprocessing`: a multiply of the bucket, or
NCCL PreMulSum for non-bf16 gradients). Three cases need the caller: HFSDP's helper buffer has no
factor, a one-rank PreMulSum loses it, and on one rank the multiply by 1.0 is work for nothing.
"""

from __future__ import annotations

import torch.distributed as dist


def correct_grad_scaling(wrapped) -> None:
    """All three corrections, in the order they depend on (the helper takes the main factor first)."""
    _restore_hfsdp_grad_scaling(wrapped)
    _avoid_single_rank_premul_sum(wrapped)
    _skip_unit_grad_scaling(wrapped)


def _restore_hfsdp_grad_scaling(wrapped) -> None:
    """Give HFSDP's DP-shard gradient buffers the 1/dp gradient scaling (Megatron-FSDP 0.6.1 bug).

    With outer_dp_sharding_strategy="optim" the DP-shard reduce-scatter runs on
    `hfsdp_helper_gbuf` (param_and_grad_buffer.py:3998-4002), which `_create_hfsdp_helper_buffer`
    (param_and_grad_buffer.py:3718) builds without `gradient_scaling_factor`, so it is None:
    `gradient_reduce_preprocessing` then returns plain SUM without scaling (:4740-4742), and the
    DP-outer reduce-scatter is a plain SUM as well, "because the (DP-Shard, DP-Outer) scaling is
    already applied" (:4137-4142). The main gradients were the SUM over dp_outer x dp_shard
    ranks instead of the mean (2.000x torch's norm on dp_outer=2 x dp_shard=1). The main grad
    buffer carries the right factor (1/|dp group|, megatron_fsdp.py:383); copy it over.
    """
    for group in _parameter_groups(wrapped):
        helper = getattr(group, "hfsdp_helper_gbuf", None)
        main = getattr(group, "main_grad_buffer", None)
        if helper is not None and main is not None and helper.gradient_scaling_factor is None:
            helper.gradient_scaling_factor = main.gradient_scaling_factor


def _avoid_single_rank_premul_sum(wrapped) -> None:
    """Scale gradients with an explicit multiply when the DP-shard group has one rank.

    Megatron-FSDP fuses the 1/dp gradient scaling into the reduce-scatter as NCCL PreMulSum
    (`gradient_reduce_div_fusion`, used for non-bf16 gradients). On 2xH200 with HSDP
    dp_outer=2 x dp_shard=1 the global gradient norm measured exactly 2.0x torch's
    clip_grad_norm_ on the same model and data, while dp_shard=2 matched: the scaling is lost
    in the one-rank collective and the outer all-reduce then sums unscaled gradients. The
    unfused path (`grad.mul_(factor)` + SUM, Megatron-FSDP's own path for bf16 gradients) does
    not depend on the collective; with it the HSDP case matches torch (2xH200). HFSDP's 2.0x had
    another cause: see _restore_hfsdp_grad_scaling.
    """
    index = getattr(wrapped, "dist_index", None)
    group = index.get_fsdp_group() if index is not None else None
    if group is not None and dist.get_world_size(group) == 1 and dist.get_world_size() > 1:
        wrapped.ddp_config.gradient_reduce_div_fusion = False


def _skip_unit_grad_scaling(wrapped) -> None:
    """Drop a gradient scaling factor of exactly 1.0 (one data-parallel rank).

    Before each bucket's reduce-scatter, Megatron-FSDP multiplies bf16 gradients in place by the
    buffer's factor (`gradient_reduce_preprocessing`): at 1.0 a read and write of every gradient
    for nothing (2.1 ms of a 144 ms step, gpt 1.4b on one H100, session 36's profile). A factor of
    None makes it a plain SUM, which after a multiply by 1.0 it was anyway; under
    average_in_collective the factor selects AVG, so it stays.
    """
    if getattr(getattr(wrapped, "ddp_config", None), "average_in_collective", False):
        return
    for gbuf in grad_buffers(wrapped):
        if gbuf.gradient_scaling_factor == 1.0:
            gbuf.gradient_scaling_factor = None


def grad_buffers(wrapped):
    """Every gradient buffer that carries a scaling factor: each parameter group's main one and
    its HFSDP helper, where it has one."""
    for group in _parameter_groups(wrapped):
        for gbuf in (getattr(group, "main_grad_buffer", None), getattr(group, "hfsdp_helper_gbuf", None)):
            if gbuf is not None:
                yield gbuf


def _parameter_groups(wrapped):
    """Megatron-FSDP's parameter groups, each with its gradient buffers (none before wrapping)."""
    buffer = getattr(wrapped, "param_and_grad_buffer", None)
    return getattr(buffer, "parameter_groups", None) or []
