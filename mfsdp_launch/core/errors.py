"""The one exception type users see for bad input: it names the key, the problem and what is allowed."""

from __future__ import annotations

from typing import Iterable, Optional


class ConfigError(ValueError):
    """A config value that cannot run. Printed as one line, exit code 2."""

    def __init__(self, key: str, problem: str, allowed: Optional[str | Iterable] = None):
        self.key = key
        self.problem = problem
        if allowed is not None and not isinstance(allowed, str):
            allowed = "|".join(str(a) for a in allowed)
        self.allowed = allowed
        super().__init__(str(self))

    def __str__(self) -> str:
        msg = f"{self.key}: {self.problem}"
        if self.allowed:
            msg += f" (allowed: {self.allowed})"
        return msg


def check_at_least(section, prefix: str, keys: Iterable[str], minimum: int) -> None:
    """Refuse the first of `section`'s `keys` below `minimum`, named `prefix.key`."""
    for key in keys:
        value = getattr(section, key)
        if value < minimum:
            raise ConfigError(f"{prefix}.{key}", f"must be >= {minimum}, got {value}")
