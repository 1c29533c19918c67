"""Sharding engines behind one interface. Each engine module imports its backend lazily."""

from __future__ import annotations

from .base import Engine


def get_engine(name: str, **kwargs) -> Engine:
    if name == "fsdp2":
        from .fsdp2 import FSDP2Engine

        return FSDP2Engine(**kwargs)
    if name == "megatron_fsdp":
        from .megatron import MegatronFSDPEngine

        return MegatronFSDPEngine(**kwargs)
    raise ValueError(f"unknown engine {name!r}")


__all__ = ["Engine", "get_engine"]
