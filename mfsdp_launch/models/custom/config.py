"""`model=custom`: the user's own module's config section (docs/models.md, "Your own model")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ...core.schema import ModelConfig, ModelLoss


@dataclass
class CustomModelConfig(ModelConfig):
    # `pkg.module:function` building the nn.Module, its keyword arguments, an optional
    # `pkg.module:fn(model)` initializing it, and the batch contract.
    target: Optional[str] = None
    # A mapping (checked by the family): a typed Dict field would be struct-locked by Hydra,
    # refusing `model.kwargs={dim: 512}` as unknown keys.
    kwargs: Any = None
    init_fn: Optional[str] = None
    loss: ModelLoss = ModelLoss.auto
    vocab_size: Optional[int] = None  # null: measured from the model's embedding
