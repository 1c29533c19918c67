"""Name globs (model.freeze, fp8.skip): a glob that matches nothing is an error, never a no-op."""

from __future__ import annotations

import fnmatch
from typing import Iterable, List, Sequence

from .errors import ConfigError


def check_globs_match(key: str, patterns: Iterable[str], names: Sequence[str], what: str) -> None:
    for pattern in patterns:
        if not pattern:
            raise ConfigError(key, "empty pattern", f"{what}-name globs")
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(key, f"{pattern!r} matches no {what}",
                              ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""))


def matching(names: Iterable[str], patterns: Sequence[str]) -> List[str]:
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
