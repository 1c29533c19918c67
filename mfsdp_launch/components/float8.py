"""FP8 without Transformer Engine on a model's plain `nn.Linear` layers (gpt, hf, custom), under
either engine: torchao float8 training (fp8.recipe=torchao_tensorwise|torchao_rowwise), or
fp8.recipe=fused_rowwise, torchao_rowwise's numerics with our own fused casts (fp8_linear.py:
the casts are where torchao's rowwise loses its GEMMs' gain).

`convert` swaps each eligible Linear for torchao's `Float8Linear` (fused_rowwise: for a subclass of
its own class that runs fp8_linear.fp8_linear) on the built model, before the
family's parallelize and the engine's sharding (torchtitan's order), so activation checkpointing
and `torch.compile` (train.compile: it fuses the casts, which is where the speed comes from) wrap
the converted layers. Tensorwise scaling all-gathers the weights in FP8 under FSDP2 (torchao's
weight subclass casts each shard before the all-gather) and computes the scales of all weights
in one all-reduce after each optimizer step; rowwise scaling is more accurate and all-gathers in
the compute dtype. Under Megatron-FSDP both all-gather in the compute dtype (its buffers hold
ordinary weights; torchao's all-gather hooks are FSDP2's) and cast after it. A mixture of experts'
grouped experts run their grouped GEMMs in FP8 under either recipe (rowwise scales: torchao's
FP8 grouped GEMM, models/llama/moe_fp8.py).

A Linear stays in high precision when `fp8.skip` names it (or a module holding it) or when a
dimension is not a multiple of 16 (FP8 GEMMs need it). Validation (`check_config`, torch-free)
refuses what cannot run, each in one line: CPU runs (planner/machine.py), families without plain
Linears, tensor parallelism (torchao's TP styles are not wired here),
and TE-only keys (fp8.params, fp8.attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Sequence

from ..core.errors import ConfigError
from ..core.fp8 import FP8Recipe
from ..core.fp8_flops import fp8_shape
from ..core.globs import check_globs_match, matching

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "pip install 'mfsdp-launch[torchao]'"
RECIPE_NAMES = {FP8Recipe.torchao_tensorwise: "tensorwise", FP8Recipe.torchao_rowwise: "rowwise"}


def check_config(fp8, *, supported: Sequence[str], model: str, tp: int, linear_models: Sequence[str]) -> None:
    """Refuse a linear recipe where it cannot run (torch-free). `supported`: the recipes the
    family's support answer lists under the engine."""
    recipe = str(fp8.recipe)
    if recipe not in supported:
        raise ConfigError("fp8.recipe", f"{recipe}: model={model} has no plain nn.Linear layers to run in FP8",
                          "none, or model=" + "|".join(linear_models))
    if tp > 1:
        raise ConfigError("mesh.tp", f"{tp} with fp8.recipe={recipe}: FP8 tensor-parallel styles are "
                          "not wired here", "1, or fp8.recipe=none")
    if fp8.params:
        raise ConfigError("fp8.params", f"true is TE's FP8 primary weights; {recipe} keeps high-precision weights "
                          "(torchao_tensorwise all-gathers them in FP8 by itself)", "false")
    if fp8.attention:
        raise ConfigError("fp8.attention", f"true is TE's FP8 attention, not available with {recipe}", "false")


def check_weight_cache(fp8, *, grad_accum_steps: int, caps, wired: Sequence[str]) -> None:
    """fp8.cache_weight_casts where it does something and is wired (torch-free; `caps`: the
    engine's EngineCaps, `wired`: the engines whose caps take it)."""
    if not fp8.cache_weight_casts:
        return
    if FP8Recipe(fp8.recipe) is not FP8Recipe.fused_rowwise:
        raise ConfigError("fp8.cache_weight_casts", f"true keeps fused_rowwise's weight casts across micro-batches; "
                          f"fp8.recipe={fp8.recipe} has none of its own to keep", "false, or fp8.recipe=fused_rowwise")
    if grad_accum_steps == 1:
        raise ConfigError("fp8.cache_weight_casts", "true does nothing at train.grad_accum_steps=1: each weight is "
                          "cast once a step already", "false, or train.grad_accum_steps > 1")
    if not caps.fp8_weight_cache:
        raise ConfigError("fp8.cache_weight_casts", f"true is wired for engine={'|'.join(wired)}, not "
                          f"engine={caps.name}", "false")


def micro_batch_hook(fp8_cfg):
    """What the loop calls before each micro-batch (its index), or None: fp8.cache_weight_casts'
    fill-or-read switch."""
    if not (FP8Recipe(fp8_cfg.recipe) is FP8Recipe.fused_rowwise and fp8_cfg.cache_weight_casts):
        return None
    from .fp8_linear import WeightCasts

    return WeightCasts.before_micro_batch


def _under(fqn: str, skipped: List[str]) -> bool:
    return any(fqn == s or fqn.startswith(s + ".") for s in skipped)


def _eligible(module, fqn: str, skipped: List[str]) -> bool:
    import torch.nn as nn

    if not isinstance(module, nn.Linear):
        return True  # torchao walks containers through the filter too
    if _under(fqn, skipped):
        return False
    return fp8_shape(module.in_features, module.out_features)  # the rule mfu_at_precision counts by


def convert(model: "torch.nn.Module", fp8_cfg, *, all_gather: bool = True, emulate: bool = False) -> List[str]:
    """Put the eligible Linears of `model` in FP8 in place (torchao's Float8Linear, or ours under
    fused_rowwise) and turn on the FP8 grouped GEMMs of its grouped experts (modules with
    `enable_fp8`); returns the names of the Linears and experts kept in high precision (fp8.skip
    or a dimension not a multiple of 16). `all_gather`: tensorwise weights all-gather in FP8 (the
    engine's EngineCaps.torchao_fp8_all_gather). `emulate`: torchao's high-precision emulation
    (tests on CPU)."""
    import torch.nn as nn

    recipe = FP8Recipe(fp8_cfg.recipe)
    modules = {name: m for name, m in model.named_modules() if name}
    skipped = []
    if fp8_cfg.skip:
        check_globs_match("fp8.skip", list(fp8_cfg.skip), list(modules), "module")
        skipped = matching(modules, list(fp8_cfg.skip))
    kept = [name for name, m in modules.items() if isinstance(m, nn.Linear) and not _eligible(m, name, skipped)]
    if recipe is FP8Recipe.fused_rowwise:
        from . import fp8_linear

        linears = (m for name, m in modules.items() if isinstance(m, nn.Linear) and _eligible(m, name, skipped))
        fp8_linear.convert(linears, cache_weight_casts=bool(fp8_cfg.cache_weight_casts))
    else:
        _convert_torchao(model, recipe, skipped, all_gather=all_gather, emulate=emulate)
        for name, old in modules.items():
            _keep_init(old, model.get_submodule(name))
    for name, m in modules.items():  # a family's grouped experts: torchao's FP8 grouped GEMM (rowwise)
        if hasattr(m, "enable_fp8") and (_under(name, skipped) or not m.enable_fp8()):
            kept.append(name)
    return kept


def _convert_torchao(model, recipe: FP8Recipe, skipped: List[str], *, all_gather: bool, emulate: bool) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(RECIPE_NAMES[recipe])
    if recipe is FP8Recipe.torchao_tensorwise and all_gather:
        config = _replace(config, enable_fsdp_float8_all_gather=True)
    if emulate:
        config = _replace(config, emulate=True)
    if recipe is FP8Recipe.torchao_rowwise:
        # Compiled rowwise casts must round as eager does: a recomputed (activation-checkpointed)
        # cast that rounds otherwise feeds backward other values (NaN losses: torchtitan #1056,
        # pytorch #150859; torchtitan sets the same for this recipe).
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: _eligible(m, fqn, skipped))


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


def after_optimizer_steps(model: "torch.nn.Module", optimizer, fp8_cfg, *, all_gather: bool = True) -> None:
    """Tensorwise with FP8 all-gather: after each optimizer step, every FP8-all-gathered weight's
    scale in one all-reduce (instead of one per weight at its all-gather)."""
    if FP8Recipe(fp8_cfg.recipe) is not FP8Recipe.torchao_tensorwise or not all_gather:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def outside(model: "torch.nn.Module", units: Sequence["torch.nn.Module"]) -> List["torch.nn.Module"]:
    """The Float8Linear layers that none of `units` holds (a converted head): train.compile compiles
    the units, so these would cast eagerly, one kernel per op over [tokens, out_features] tensors."""
    from torchao.float8.float8_linear import Float8Linear

    inside = {id(m) for unit in units for m in unit.modules()}
    return [m for m in model.modules() if isinstance(m, Float8Linear) and id(m) not in inside]

