"""ZeRO strategies and the rules that tie them to the mesh (torch-free).

OmegaConf reads an Enum field from either its name or its number, so `zero_dp_strategy=3` and
`zero_dp_strategy=optim_grads_params` are the same value and a typo names the allowed ones.
"""

from __future__ import annotations

from .choice import NumberedChoice

from typing import List

from .errors import ConfigError


class ZeroStrategy(NumberedChoice):
    """What the data-parallel shard group splits: Megatron-FSDP's zero_dp_strategy 0-3."""

    no_shard = 0
    optim = 1
    optim_grads = 2
    optim_grads_params = 3


class OuterStrategy(NumberedChoice):
    """What dp_outer also splits: no_shard (HSDP replicas) or optim (HFSDP)."""

    no_shard = 0
    optim = 1


def check_sharding(zero: ZeroStrategy, outer: OuterStrategy, *, dp_outer: int, meta_init: bool) -> List[str]:
    """Megatron-FSDP's limits on the strategies; returns warnings. Shared by validation and the
    engine's argument mapping."""
    warnings = []
    if outer is OuterStrategy.optim:
        if zero is not ZeroStrategy.optim_grads_params:
            raise ConfigError("sharding.outer_dp_sharding_strategy",
                              f"'optim' (HFSDP) needs zero_dp_strategy=optim_grads_params, got {zero}",
                              "no_shard, or zero_dp_strategy=optim_grads_params")
        if dp_outer < 2:
            warnings.append("sharding.outer_dp_sharding_strategy=optim with mesh.dp_outer=1: the outer "
                            "dimension has one rank, so this is plain FSDP")
    if meta_init and zero is ZeroStrategy.no_shard:
        raise ConfigError("model.init_on_meta", "Megatron-FSDP refuses meta-device init with "
                          "zero_dp_strategy=no_shard", "false, or a sharded zero_dp_strategy")
    return warnings


def single_node_outer_warning(dp_outer: int, nnodes: int, world: int) -> List[str]:
    """dp_outer>1 with every rank on one node: the outer dimension buys nothing that NVLink needs."""
    if dp_outer < 2 or nnodes > 1:
        return []
    return [f"mesh.dp_outer={dp_outer} with all {world} ranks on one node: HSDP/HFSDP pay off across nodes; "
            "within one node plain FSDP (mesh.dp_outer=1) shards over NVLink and is faster "
            "(docs/performance.md has the measurement)"]


def shard_factors(zero: ZeroStrategy, outer: OuterStrategy, shard_size: int, dp_outer: int) -> dict:
    """How many ranks share each kind of training state (for the memory estimate)."""
    full = shard_size * (dp_outer if outer is OuterStrategy.optim else 1)
    stage = zero.value
    return {
        "optimizer": full if stage >= 1 else 1,
        "main_params": full if stage >= 1 else 1,
        "grads": full if stage >= 2 else 1,
        "params": full if stage >= 3 else 1,
    }
