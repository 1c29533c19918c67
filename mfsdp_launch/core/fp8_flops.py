"""Which share of a token's training FLOPs runs in FP8 GEMMs (torch-free): what
`mfu_at_precision` weighs the FP8 peak by (core/mfu.py).

A family lists its matmuls (ModelFamily.matmuls): the module each runs in, its FLOPs per token
(they sum to the family's FLOPs per token) and what can put it in FP8:
  * TE_LAYER: a Transformer Engine linear (te_gpt's fused QKV, projection, MLP and te.Linear head)
    runs in FP8 under any TE recipe;
  * TE_ATTENTION: TE's attention core (QK^T and PV) runs in FP8 only with fp8.attention=true;
  * LINEAR: a plain nn.Linear that the linear recipes convert (torchao_*, fused_rowwise) when
    both its dimensions are multiples of FP8_GEMM_MULTIPLE (components/float8.py);
  * GROUPED: a mixture of experts' grouped GEMMs, in torchao's FP8 grouped GEMM under the same
    recipes and the same rule on (dim, ffn) (models/llama/moe_fp8.py);
  * HIGH: never in FP8 (SDPA's attention, a tied head's F.linear on the embedding, a router's matmul).
Under either kind of recipe a matmul stays in high precision when an fp8.skip glob names its module
or a module holding it, as components/precision.py (TE) and components/float8.py (the linear recipes) apply it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .fp8 import FP8_GEMM_MULTIPLE, FP8Recipe, on_linears

TE_LAYER, TE_ATTENTION, LINEAR, GROUPED, HIGH = "te", "te_attention", "linear", "grouped", "high"


@dataclass(frozen=True)
class Matmul:
    module: str  # the module it runs in ("layers.0.attn.wqkv"); fp8.skip globs name it or a parent
    flops: float  # training FLOPs per token (forward and backward)
    fp8_by: str  # TE_LAYER | TE_ATTENTION | LINEAR | HIGH
    shape: Tuple[int, int] = (0, 0)  # a LINEAR's (in_features, out_features); GROUPED's (dim, ffn)


def fp8_shape(in_features: int, out_features: int) -> bool:
    """FP8 GEMMs need both dimensions divisible by FP8_GEMM_MULTIPLE."""
    return in_features % FP8_GEMM_MULTIPLE == 0 and out_features % FP8_GEMM_MULTIPLE == 0


def skipped(module: str, skip: Sequence[str]) -> bool:
    """Whether an fp8.skip glob matches `module` or a module holding it."""
    parts = module.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))] if module else []
    return any(fnmatch.fnmatchcase(n, str(p)) for n in names for p in skip)


def in_fp8(mm: Matmul, fp8) -> bool:
    """Whether matmul `mm` runs in FP8 under the `fp8` config section."""
    recipe = str(fp8.recipe)
    if recipe == FP8Recipe.none.value or skipped(mm.module, list(fp8.skip or ())):
        return False
    if on_linears(recipe):
        return mm.fp8_by in (LINEAR, GROUPED) and fp8_shape(*mm.shape)
    return mm.fp8_by == TE_LAYER or (mm.fp8_by == TE_ATTENTION and bool(fp8.attention))


def fp8_share(matmuls: Optional[Sequence[Matmul]], fp8) -> Optional[float]:
    """The FP8 GEMMs' share of a token's training FLOPs: 0.0 without an FP8 recipe, None when the
    family cannot list its matmuls (yet: measured families list them once the model is built)."""
    if str(fp8.recipe) == FP8Recipe.none.value:
        return 0.0
    if matmuls is None:
        return None
    total = sum(mm.flops for mm in matmuls)
    return sum(mm.flops for mm in matmuls if in_fp8(mm, fp8)) / total if total else 0.0
