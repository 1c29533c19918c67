"""`model=toy_cnn|toy_transformer|te_toy_transformer`: the seed's toys' config section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...core.schema import ModelConfig


@dataclass
class ToyModelConfig(ModelConfig):
    # Null: the family's own default (the seed's DIM_SIZE=2; 64 for the TE toy, whose FP8 GEMMs
    # need dims divisible by 16).
    dim: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    output_dim: Optional[int] = None
    fuse_qkv: bool = False  # te_toy_transformer: TE's fused QKV parameter, as in the seed
