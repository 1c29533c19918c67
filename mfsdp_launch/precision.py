"""Mixed precision and FP8: dtype names, the engine's precision policy inputs, TE recipes."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


def torch_dtype(name: Optional[str]):
    """Map a config dtype name ('bf16', or torch's 'bfloat16') to a torch dtype; None stays None."""
    if name is None:
        return None
    import torch

    key = str(name).lower()
    key = _TORCH_NAMES.get(key, key)
    if key not in _TORCH_NAMES.values():
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(_TORCH_NAMES)}")
    return getattr(torch, key)


def fp8_min_capability(recipe: str):
    """Compute capability a recipe needs on the GPU."""
    return (10, 0) if recipe == "mxfp8" else (8, 9)


def check_fp8_hardware(fp8_cfg) -> None:
    """Refuse FP8 on GPUs that cannot run the recipe; never fall back silently."""
    if fp8_cfg.recipe == "none":
        return
    from .errors import ConfigError
    from .hardware import gpu_compute_capability

    have = gpu_compute_capability()
    need = fp8_min_capability(fp8_cfg.recipe)
    if tuple(have) < need:
        raise ConfigError(
            "fp8.recipe",
            f"'{fp8_cfg.recipe}' needs compute capability {need[0]}.{need[1]}+, "
            f"this GPU has {have[0]}.{have[1]}",
            "none|delayed|current|blockwise" if have >= (8, 9) else "none",
        )


def build_fp8_recipe(fp8_cfg):
    """The Transformer Engine recipe object for fp8.recipe, or None."""
    if fp8_cfg.recipe == "none":
        return None
    from transformer_engine.common import recipe as te_recipe

    fmt = getattr(te_recipe.Format, fp8_cfg.format)
    if fp8_cfg.recipe == "delayed":
        return te_recipe.DelayedScaling(
            fp8_format=fmt,
            amax_history_len=fp8_cfg.amax_history_len,
            amax_compute_algo=fp8_cfg.amax_compute_algo,
            margin=fp8_cfg.margin,
        )
    if fp8_cfg.recipe == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
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
    import fnmatch
    import functools

    from .validate import check_globs_match

    named = [(name, module) for name, module in model.named_modules() if name]
    check_globs_match("fp8.skip", patterns, [name for name, _ in named], "module")
    matched = []
    for name, module in named:
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            original = module.forward

            @functools.wraps(original)
            def forward(*args, __original=original, **kwargs):
                with _fp8_disabled():
                    return __original(*args, **kwargs)

            module.forward = forward
            matched.append(name)
    return matched


def _fp8_disabled():
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=False)
    return te.fp8_autocast(enabled=False)
