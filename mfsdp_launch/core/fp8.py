"""FP8 recipes and their rules (torch-free); the TE objects are built in components/precision.py."""

from __future__ import annotations

from .choice import Choice


class FP8Recipe(Choice):
    none = "none"
    delayed = "delayed"
    current = "current"
    blockwise = "blockwise"
    mxfp8 = "mxfp8"


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
