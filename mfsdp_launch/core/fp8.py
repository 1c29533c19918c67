"""FP8 recipes and their rules (torch-free). Two kinds: Transformer Engine's recipes act on TE
layers (components/precision.py builds them); the linear recipes (torchao's float8 training, and
fused_rowwise, our own casts) convert plain `nn.Linear`s (components/float8.py), with no TE at all."""

from __future__ import annotations

from .choice import Choice


class FP8Recipe(Choice):
    none = "none"
    delayed = "delayed"
    current = "current"
    blockwise = "blockwise"
    mxfp8 = "mxfp8"
    # torchao float8 training (components/float8.py): dynamic scaling per tensor (FP8 all-gather
    # of weights under FSDP2) or per row (more accurate, high-precision all-gather).
    torchao_tensorwise = "torchao_tensorwise"
    torchao_rowwise = "torchao_rowwise"
    # torchao's rowwise numerics with the launcher's own fused casts (components/fp8_linear.py):
    # no TE, no torchao (but for a mixture of experts' grouped GEMMs).
    fused_rowwise = "fused_rowwise"


TE_RECIPES = frozenset({FP8Recipe.delayed, FP8Recipe.current, FP8Recipe.blockwise, FP8Recipe.mxfp8})
TORCHAO_RECIPES = frozenset({FP8Recipe.torchao_tensorwise, FP8Recipe.torchao_rowwise})
# The recipes that put a model's plain nn.Linear layers in FP8 (components/float8.py).
LINEAR_RECIPES = TORCHAO_RECIPES | {FP8Recipe.fused_rowwise}


def _among(recipe, recipes) -> bool:
    """Whether `recipe` (an FP8Recipe, or its name as a config gives it) is one of `recipes`."""
    return str(recipe) in {r.value for r in recipes}


def is_torchao(recipe) -> bool:
    return _among(recipe, TORCHAO_RECIPES)


def on_linears(recipe) -> bool:
    """Whether `recipe` runs a model's plain nn.Linear layers in FP8 (no TE layers involved)."""
    return _among(recipe, LINEAR_RECIPES)


class FP8Format(Choice):
    HYBRID = "HYBRID"
    E4M3 = "E4M3"


# Compute capability each recipe needs (mxfp8: Blackwell).
MIN_CAPABILITY = {FP8Recipe.mxfp8: (10, 0)}
DEFAULT_MIN_CAPABILITY = (8, 9)

# FP8 GEMMs need every dimension divisible by this.
FP8_GEMM_MULTIPLE = 16


def min_capability(recipe: FP8Recipe):
    return MIN_CAPABILITY.get(FP8Recipe(recipe), DEFAULT_MIN_CAPABILITY)


def fixed_format(recipe: FP8Recipe):
    """The only format a recipe has, if it has one (Float8BlockScaling: E4M3 tensors only)."""
    return FP8Format.E4M3 if recipe is FP8Recipe.blockwise else None
