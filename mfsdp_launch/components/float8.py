"""FP8 without Transformer Engine: torchao float8 training (fp8.recipe=torchao_tensorwise|
torchao_rowwise) on a model's plain `nn.Linear` layers (gpt, hf, custom), under FSDP2.

`convert` swaps each eligible Linear for torchao's `Float8Linear` on the built model, before the
family's parallelize and the engine's sharding (torchtitan's order), so activation checkpointing
and `torch.compile` (train.compile: it fuses the casts, which is where the speed comes from) wrap
the converted layers. Tensorwise scaling all-gathers the weights in FP8 under FSDP2 (torchao's
weight subclass casts each shard before the all-gather) and computes the scales of all weights
in one all-reduce after each optimizer step; rowwise scaling is more accurate and all-gathers in
the compute dtype.

A Linear stays in high precision when `fp8.skip` names it (or a module holding it) or when a
dimension is not a multiple of 16 (FP8 GEMMs need it). Validation (`check_config`, torch-free)
refuses what cannot run, each in one line: CPU runs (planner/machine.py), Megatron-FSDP (0.6.1
knows only TE's Float8Tensor: it has none of the FSDP2 all-gather hooks torchao's weights use),
families without plain Linears, tensor parallelism (torchao's TP styles are not wired here),
and TE-only keys (fp8.params, fp8.attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence

from ..core.errors import ConfigError
from ..core.fp8 import FP8Recipe, is_torchao
from ..core.fp8_flops import fp8_shape
from ..core.globs import check_globs_match, matching

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "pip install 'mfsdp-launch[torchao]'"
RECIPE_NAMES = {FP8Recipe.torchao_tensorwise: "tensorwise", FP8Recipe.torchao_rowwise: "rowwise"}
MEGATRON_WHY = ("Megatron-FSDP 0.6.1 knows only Transformer Engine's Float8Tensor and has none of the FSDP2 "
                "all-gather hooks torchao's FP8 weights use")


def check_config(fp8, *, supported: Sequence[str], model: str, engine: str, engine_takes: bool, tp: int,
                 torchao_models: Sequence[str]) -> None:
    """Refuse a torchao recipe where it cannot run (torch-free). `supported`: the recipes the
    family's support answer lists under `engine`; `engine_takes`: the engine runs torchao layers."""
    recipe = str(fp8.recipe)
    if not engine_takes:
        raise ConfigError("fp8.recipe", f"{recipe} runs under engine=fsdp2 only: {MEGATRON_WHY}",
                          "engine=fsdp2, or a TE model with fp8.recipe=delayed|current|blockwise|mxfp8")
    if recipe not in supported:
        raise ConfigError("fp8.recipe", f"{recipe}: model={model} has no plain nn.Linear layers torchao converts",
                          "none, or model=" + "|".join(torchao_models))
    if tp > 1:
        raise ConfigError("mesh.tp", f"{tp} with fp8.recipe={recipe}: torchao's FP8 tensor-parallel styles are "
                          "not wired here", "1, or fp8.recipe=none")
    if fp8.params:
        raise ConfigError("fp8.params", f"true is TE's FP8 primary weights; {recipe} keeps high-precision weights "
                          "(torchao_tensorwise all-gathers them in FP8 by itself)", "false")
    if fp8.attention:
        raise ConfigError("fp8.attention", f"true is TE's FP8 attention, not available with {recipe}", "false")


def _eligible(module, fqn: str, skipped: List[str]) -> bool:
    import torch.nn as nn

    if not isinstance(module, nn.Linear):
        return True  # torchao walks containers through the filter too
    if any(fqn == s or fqn.startswith(s + ".") for s in skipped):
        return False
    return fp8_shape(module.in_features, module.out_features)  # the rule mfu_at_precision counts by


def convert(model: "torch.nn.Module", fp8_cfg, *, emulate: bool = False) -> List[str]:
    """Swap the eligible Linears of `model` for Float8Linear in place; returns the names of the
    Linears kept in high precision (fp8.skip or a dimension not a multiple of 16). `emulate`:
    torchao's high-precision emulation (tests on CPU)."""
    import torch.nn as nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    recipe = FP8Recipe(fp8_cfg.recipe)
    modules = {name: m for name, m in model.named_modules() if name}
    skipped = []
    if fp8_cfg.skip:
        check_globs_match("fp8.skip", list(fp8_cfg.skip), list(modules), "module")
        skipped = matching(modules, list(fp8_cfg.skip))
    config = Float8LinearConfig.from_recipe_name(RECIPE_NAMES[recipe])
    if recipe is FP8Recipe.torchao_tensorwise:
        config = _replace(config, enable_fsdp_float8_all_gather=True)
    if emulate:
        config = _replace(config, emulate=True)
    kept = [name for name, m in modules.items() if isinstance(m, nn.Linear) and not _eligible(m, name, skipped)]
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: _eligible(m, fqn, skipped))
    for name, old in modules.items():
        _keep_init(old, model.get_submodule(name))
    return kept


def _keep_init(old, new) -> None:
    """A Linear subclass's own `reset_parameters` (gpt's N(0, std), a user's) survives the swap:
    meta-device init calls it on the converted layer, which is nn.Linear's otherwise."""
    import types

    import torch.nn as nn

    if new is old or not isinstance(old, nn.Linear) or type(old).reset_parameters is nn.Linear.reset_parameters:
        return
    own = type(old).reset_parameters
    for key, value in vars(old).items():
        if not key.startswith("_") and key not in vars(new) and not isinstance(value, (nn.Module, nn.Parameter)):
            setattr(new, key, value)  # what it reads (gpt's init_std)
    new.reset_parameters = types.MethodType(own, new)


def _replace(config, **fields):
    import dataclasses

    return dataclasses.replace(config, **fields)


def after_optimizer_steps(model: "torch.nn.Module", optimizer, fp8_cfg) -> None:
    """Tensorwise: after each optimizer step, every FP8-all-gathered weight's scale in one
    all-reduce (instead of one per weight at its all-gather)."""
    if FP8Recipe(fp8_cfg.recipe) is not FP8Recipe.torchao_tensorwise:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def uses_torchao(fp8_cfg) -> bool:
    return is_torchao(fp8_cfg.recipe)
