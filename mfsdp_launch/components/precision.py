"""Mixed precision and FP8 at run time: torch dtypes, TE recipes, autocast and fp8.skip."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

from ..core.dtypes import Dtype
from ..core.fp8 import FP8Recipe, min_capability, on_linears
from ..core.errors import ConfigError
from ..core.globs import check_globs_match, matching


def torch_dtype(name: Optional[str]):
    """A config dtype name ('bf16') -> the torch dtype; None stays None."""
    if name is None:
        return None
    import torch

    return getattr(torch, Dtype(name).torch_name)


def check_fp8_hardware(fp8_cfg) -> None:
    """Refuse FP8 on GPUs that cannot run the recipe; never fall back silently."""
    if fp8_cfg.recipe == FP8Recipe.none:
        return
    from ..core.hardware import gpu_compute_capability

    have = gpu_compute_capability()
    need = min_capability(fp8_cfg.recipe)
    if tuple(have) < need:
        raise ConfigError(
            "fp8.recipe",
            f"'{fp8_cfg.recipe}' needs compute capability {need[0]}.{need[1]}+, "
            f"this GPU has {have[0]}.{have[1]}",
            "none|delayed|current|blockwise" if have >= (8, 9) else "none",
        )


def build_fp8_recipe(fp8_cfg):
    """The Transformer Engine recipe object for fp8.recipe, or None (also for the linear recipes,
    which convert layers instead: components/float8.py)."""
    if fp8_cfg.recipe == FP8Recipe.none or on_linears(fp8_cfg.recipe):
        return None
    from transformer_engine.common import recipe as te_recipe

    fmt = getattr(te_recipe.Format, str(fp8_cfg.format))
    if fp8_cfg.recipe == "delayed":
        return te_recipe.DelayedScaling(
            fp8_format=fmt,
            amax_history_len=fp8_cfg.amax_history_len,
            amax_compute_algo=fp8_cfg.amax_compute_algo,
            margin=fp8_cfg.margin,
            fp8_dpa=bool(fp8_cfg.attention),
        )
    if fp8_cfg.recipe == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt, fp8_dpa=bool(fp8_cfg.attention))
    if fp8_cfg.recipe == "blockwise":
        return te_recipe.Float8BlockScaling(fp8_format=te_recipe.Format.E4M3)
    if fp8_cfg.recipe == "mxfp8":
        return te_recipe.MXFP8BlockScaling(fp8_format=fmt)
    raise ValueError(f"unknown fp8 recipe {fp8_cfg.recipe}")


def fp8_autocast(recipe):
    """TE's autocast for the forward (a no-op context when FP8 is off)."""
    if recipe is None:
        return nullcontext()
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def quantized_init(recipe):
    """Context in which TE modules are created with FP8 (quantized) parameters."""
    if recipe is None:
        return nullcontext()
    import transformer_engine.pytorch as te

    if hasattr(te, "quantized_model_init"):
        return te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True)
    return te.fp8_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=True)


def apply_fp8_skip(model, patterns) -> list:
    """Run the modules matching fp8.skip globs (e.g. 'lm_head', 'layers.0') in high precision.

    The rule for layers FP8 cannot or should not take (the output head, odd shapes, first/last
    layers): their forward runs inside a nested autocast with FP8 disabled. Returns the matched
    module names; a glob that matches nothing is an error, never a silent no-op.
    """
    import functools

    modules = {name: module for name, module in model.named_modules() if name}
    check_globs_match("fp8.skip", patterns, list(modules), "module")
    matched = matching(modules, patterns)
    for name in matched:
        original = modules[name].forward

        @functools.wraps(original)
        def forward(*args, __original=original, **kwargs):
            with _fp8_disabled():
                return __original(*args, **kwargs)

        modules[name].forward = forward
    return matched


def _fp8_disabled():
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=False)
    return te.fp8_autocast(enabled=False)
