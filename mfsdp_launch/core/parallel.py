"""The ways a model family can use a mesh dimension (tp or cp) above 1: a family declares one
(models/family.py), an engine takes some (engines/__init__.py), validation pairs them."""

from __future__ import annotations


class Parallel:
    """How a family uses one mesh dimension (tp or cp) when its degree is above 1."""

    NONE = "none"  # it cannot: refused
    REPLICATE = "replicate"  # every rank of the group computes the same (the seed's toys, engine's own mesh)
    DTENSOR = "dtensor"  # tp: a DTensor plan on torch layers (models/llama/tensor_parallel.py)
    ALLGATHER = "allgather"  # cp: attention all-gathers K/V over cp (models/llama/context_parallel.py)
    TE = "te"  # inside Transformer Engine layers, on the engine's tp/cp groups (models/llama/te_parallel.py)

    SPLITTING = frozenset({DTENSOR, ALLGATHER, TE})  # the group's ranks hold different parts
