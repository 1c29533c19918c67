"""scripts/bench.py's benchmark matrix, read from bench/matrix.yaml (groups of named entries; the
file's header lists the fields). Each entry becomes the flat dict scripts/bench.py runs and stores
in bench/results.json: its base's fields, then its own, with name, group, kind, engine and
fp8_params always set. Needs PyYAML (a dependency of omegaconf), no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import yaml

PATH = Path(__file__).resolve().parent.parent / "bench" / "matrix.yaml"
FIELDS = {"name", "base", "about", "kind", "engine", "fp8_params", "model", "preset", "seq", "mbs", "precision",
          "zero", "outer", "ac", "ac_every", "tp", "cp", "n_layers", "ga", "grads", "steps", "log_interval", "timeout",
          "force", "profile", "extra", "env", "peft", "sft", "recipe"}
REQUIRED = ("model", "preset", "seq", "mbs", "precision")
GROUP_FIELDS = {"about", "base", "memory", "entries"}


def entry(name, group, kind="launcher", engine="megatron_fsdp", fp8_params=False, **kw) -> dict:
    """One runnable entry (also the shape of bench/memory_reference.json's points)."""
    return dict(name=name, group=group, kind=kind, engine=engine, fp8_params=fp8_params, **kw)


def _fields(where: str, d: dict, bases: dict, seen: Tuple[str, ...] = ()) -> dict:
    unknown = set(d) - FIELDS
    if unknown:
        raise ValueError(f"{PATH.name}: {where}: unknown field(s) {sorted(unknown)} (allowed: {sorted(FIELDS)})")
    base = d.get("base")
    out = {}
    if base is not None:
        if base not in bases or base in seen:
            raise ValueError(f"{PATH.name}: {where}: base {base!r} is not under bases: (or names itself)")
        out = _fields(f"bases.{base}", bases[base], bases, seen + (base,))
    out.update({k: v for k, v in d.items() if k not in ("base", "about")})
    return out


def load(path: Path = PATH) -> Tuple[List[dict], Dict[str, dict], Dict[str, str]]:
    """(the entries in file order, the groups' {about, memory, names}, each entry's `about`)."""
    data = yaml.safe_load(path.read_text())
    bases, entries, groups, about = data.get("bases") or {}, [], {}, {}
    for group, spec in data["groups"].items():
        unknown = set(spec) - GROUP_FIELDS
        if unknown:
            raise ValueError(f"{path.name}: group {group}: unknown field(s) {sorted(unknown)}")
        names = []
        for raw in spec["entries"]:
            where = f"group {group}, entry {raw.get('name', '?')}"
            got = _fields(where, {"base": spec["base"], **raw} if "base" in spec else dict(raw), bases)
            missing = [k for k in ("name", *REQUIRED) if k not in got]
            if missing:
                raise ValueError(f"{path.name}: {where}: missing {missing}")
            name = got.pop("name")
            entries.append(entry(name, group, **got))
            names.append(name)
            if raw.get("about"):
                about[name] = raw["about"]
        groups[group] = dict(about=spec.get("about", ""), memory=bool(spec.get("memory")), names=names)
    return entries, groups, about


MATRIX, GROUPS, ABOUT = load()
# The groups whose runs bench/memory.md shows, and the reference points (bench/memory_reference.json).
MEMORY_GROUPS = tuple(g for g, spec in GROUPS.items() if spec["memory"]) + ("memory_reference",)
