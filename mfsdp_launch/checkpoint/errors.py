"""The run-time checkpoint error, and each failure of a save or load told in one line."""

from __future__ import annotations

from typing import Tuple


class CheckpointError(RuntimeError):
    """A save or load that failed at run time (the config was fine)."""


def dcp_failures() -> Tuple[type, ...]:
    """What a DCP save or load raises. DCP's CheckpointException derives from BaseException, so an
    `except Exception` alone lets it through (and a rank dies with a traceback and SIGABRT)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def describe(exc: BaseException) -> str:
    """`Type: first line`; for DCP's CheckpointException each failing rank's own cause (its str()
    is every rank's whole traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, wrapped in sorted(failures.items()):
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            parts.append(f"DCP rank {rank}: {_one_line(inner)}")
        return "; ".join(parts)
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
