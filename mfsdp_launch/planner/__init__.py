"""The torch-free config layer, read as a pipeline:

    schema.py   typed sections with enums (dtypes.py, sharding.py, fp8.py own their value sets)
    compose.py  Hydra groups + recipes + overrides -> one typed config; freeze / load
    resolve.py  every derived value, filled once
    validate.py checks only, calling the rules where they live (mesh, sharding, engines, models, data);
                model_checks.py (the family's support answer) and train_checks.py (loop, optimizer)
                are its two larger parts
    machine.py  what this machine has: installed packages, GPUs

This file imports nothing at import time (the enums' modules are imported by engines/ and models/,
which validation imports in turn).
"""

from __future__ import annotations

from typing import Iterable


def prepare(overrides: Iterable[str], *, check_hardware: bool = True):
    """compose -> resolve -> validate: (cfg, warnings); raises ConfigError."""
    from .compose import compose
    from .resolve import resolve
    from .validate import validate

    cfg = compose(overrides)
    return cfg, validate(cfg, resolve(cfg), check_hardware=check_hardware)
