"""The run-time checkpoint error, and each failure of a save or load told in one line."""

from __future__ import annotations
from ..core.names import first_line

from typing import Dict, List, Tuple


class CheckpointError(RuntimeError):
    """A save or load that failed at run time (the config was fine)."""


def dcp_failures() -> Tuple[type, ...]:
    """What a DCP save or load raises. DCP's CheckpointException derives from BaseException, so an
    `except Exception` alone lets it through (and a rank dies with a traceback and SIGABRT)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def describe(exc: BaseException) -> str:
    """`Type: first line` of the cause; for DCP's CheckpointException each failing rank's own cause,
    ranks with the same cause together (its str() is every rank's whole traceback)."""
    failures = getattr(exc, "failures", None)
    if not (isinstance(failures, dict) and failures):
        return _one_line(_root_cause(exc))
    by_cause: Dict[str, List[int]] = {}
    for rank, wrapped in sorted(failures.items()):
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        by_cause.setdefault(_one_line(_root_cause(inner)), []).append(rank)
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {cause}"
                     for cause, ranks in by_cause.items())


def _root_cause(exc: BaseException) -> BaseException:
    """The OSError behind a wrapper, when the chain still has it (torch's zip writer reports a full
    disk as "unexpected pos 704 vs 598"), else `exc`."""
    seen, c = set(), exc
    while c is not None and id(c) not in seen:
        if isinstance(c, OSError) and c.errno:
            return c
        seen.add(id(c))
        c = c.__cause__ or c.__context__
    return exc


def _one_line(exc: BaseException) -> str:
    first = first_line(exc)
    if len(first) > 160 and ". " in first:  # a paragraph (torch.load's advice): its first sentence
        first = first[:first.index(". ") + 1]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
