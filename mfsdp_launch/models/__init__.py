"""The model registry: `model.name` -> its family (models/family.py). Adding a model is one family
file plus one YAML in configs/model/. Torch-free: torch is imported when a family builds a spec."""

from __future__ import annotations

from typing import Dict, Tuple

from ..core.errors import ConfigError
from .custom import family as custom
from .llama import gpt, te_gpt
from .hf import family as hf
from .toys import family as toys
from .family import ModelContext, ModelFamily, ModelSpec

FAMILIES: Dict[str, ModelFamily] = {f.name: f for f in (gpt.FAMILY, te_gpt.FAMILY, *toys.FAMILIES,
                                                        custom.FAMILY, hf.FAMILY)}


def names() -> Tuple[str, ...]:
    return tuple(FAMILIES)


def te_names() -> Tuple[str, ...]:
    """The models built on Transformer Engine layers (the ones TE's FP8 recipes and TE-only keys act on)."""
    return tuple(name for name, fam in FAMILIES.items() if fam.has_te_layers)


def family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ConfigError("model", f"unknown model {name!r}", names())
    return FAMILIES[name]


def section_of(name: str) -> type:
    """The `model` config section (a dataclass) of `model.name`."""
    return family(name).section


def section_from(values) -> object:
    """A family's typed section from a plain mapping (a checkpoint manifest's `model` section);
    keys the family does not read are dropped."""
    import dataclasses

    section = section_of(str(values.get("name", "gpt")))()
    for key, value in values.items():
        if hasattr(section, key):
            current = getattr(section, key)
            if dataclasses.is_dataclass(current) and isinstance(value, dict):  # a nested section (model.peft)
                names = {f.name for f in dataclasses.fields(current)}
                value = type(current)(**{k: v for k, v in value.items() if k in names})
            setattr(section, key, value)
    return section


def sections() -> Dict[str, type]:
    """Every family's section by class name: the `model` group's schemas (configs/model/*.yaml
    name theirs in `defaults`)."""
    return {f.section.__name__: f.section for f in FAMILIES.values()}


def build_model_spec(model_cfg, seq_len: int, tp: int = 1) -> ModelSpec:
    """The family's ModelSpec, with `model.fsdp_unit_modules` overriding its unit modules. `tp`
    reaches the families that build tensor-parallel layers (TE's)."""
    from .family import resolve_unit_modules

    fam = family(str(model_cfg.name))
    spec = fam.spec_for(model_cfg, seq_len, tp=tp)
    if model_cfg.fsdp_unit_modules:
        spec.unit_modules = resolve_unit_modules(model_cfg.fsdp_unit_modules)
    return spec


__all__ = ["FAMILIES", "ModelContext", "ModelFamily", "ModelSpec", "build_model_spec", "family", "names",
           "section_from", "section_of", "sections"]
