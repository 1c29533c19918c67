"""Base classes for config enums: printed as the word a user types (`bf16`, `optim_grads_params`)."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A named value; `str` mixin, so `cfg.precision.compute_dtype == "bf16"` holds."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class NumberedChoice(Enum):
    """A named value that users may also give by number (`zero_dp_strategy=3`)."""

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)
