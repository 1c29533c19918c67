"""A LoRA run's checkpoints (model.peft.kind=lora, models/lora.py): the adapters' tensors and
their optimizer state only, and in the manifest's model section a reference to the frozen base
they adapt: the key that names it, its directory, and one checksum over its files
(`config.json` and the safetensors). A resume reloads the base from its directory (the family's
load_weights, before the checkpoint) and the adapters from the checkpoint; a base whose files
changed since the checkpoint is refused (manifest.incompatibilities). The checksum reads every
byte of the base once per process, and only when a manifest is written or compared.

Pure Python, except `trainable_state`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from ..core.errors import ConfigError

BASE_CONFIG = "config.json"
BASE_WEIGHTS = ("*.safetensors", "model.safetensors.index.json")


def peft_section(model_cfg) -> Optional[dict]:
    """The manifest's `model.peft`: the adapters' config and the base's reference (no checksum
    yet: `complete_base_reference`); None when the run trains no adapters."""
    from ..models import family, lora

    if not lora.enabled(model_cfg):
        return None
    p, fam = model_cfg.peft, family(str(model_cfg.name))
    base = fam.base_dir(model_cfg)
    return {"kind": str(p.kind), "r": int(p.r), "alpha": float(p.alpha), "dropout": float(p.dropout),
            "targets": [str(t) for t in p.targets],
            "base": {"key": fam.base_key, "path": str(Path(base).expanduser().absolute()) if base else None,
                     "checksum": None}}


def of(info_or_manifest: dict) -> Optional[dict]:
    """The `model.peft` section of manifest info or of a manifest; None without adapters (also for
    a manifest whose model section is the raw model config, whose peft has no base)."""
    from ..models.lora import KINDS

    section = ((info_or_manifest or {}).get("model") or {}).get("peft")
    return section if isinstance(section, dict) and section.get("kind") in KINDS and "base" in section else None


def base_files(base_dir: Path) -> List[str]:
    """The files the base's checksum covers, relative to its directory, sorted."""
    found = {BASE_CONFIG} if (base_dir / BASE_CONFIG).is_file() else set()
    for pattern in BASE_WEIGHTS:
        found.update(p.name for p in base_dir.glob(pattern) if p.is_file())
    return sorted(found)


def base_checksum(base_dir: str | Path, key: str = "model.peft") -> str:
    """One xxh3-64 over the names and checksums of the base's files."""
    import xxhash

    from .integrity import CHECKSUM, checksum_files

    root = Path(base_dir).expanduser()
    files = base_files(root) if root.is_dir() else []
    if not any(f.endswith(".safetensors") for f in files):
        raise ConfigError(key, f"the LoRA base {root} is not a directory holding safetensors weights")
    sums = checksum_files(root, files)
    h = xxhash.xxh3_64()
    for name in files:
        h.update(f"{name}\0{sums[name][1]}\n".encode())
    return f"{CHECKSUM}:{h.hexdigest()}"


def complete_base_reference(info: dict) -> None:
    """Fill the base's checksum into manifest info that has a `model.peft` section (once)."""
    section = of(info)
    if not section or section["base"].get("checksum") or not section["base"].get("path"):
        return
    section["base"]["checksum"] = base_checksum(section["base"]["path"], section["base"].get("key") or "model.peft")


def changes(current: dict, manifest: dict, *, weights_only: bool) -> List[tuple]:
    """(key, now, in the checkpoint) for each adapter change that cannot load: another kind, rank
    or set of targets (other tensors); at a full resume also a base whose files changed."""
    cur, old = of(current), of(manifest)  # (a manifest from before model.peft: a full model)
    if (cur is None) != (old is None):
        return [("model.peft.kind", cur["kind"] if cur else "none", old["kind"] if old else "none")]
    if cur is None:
        return []
    out = [(f"model.peft.{k}", cur[k], old[k]) for k in ("r", "targets") if cur[k] != old[k]]
    if not weights_only and not out:
        complete_base_reference(current)
        a, b = cur["base"], old["base"]
        if a.get("checksum") and b.get("checksum") and a["checksum"] != b["checksum"]:
            out.append((a.get("key") or "model.peft", f"{a['path']} ({a['checksum']})",
                        f"{b['path']} ({b['checksum']})"))
    return out


def trainable_state(model, msd: Dict[str, Any]) -> Dict[str, Any]:
    """The entries of a model state dict whose parameters train (the adapters)."""
    from ..engines.base import strip_prefixes

    trained = {strip_prefixes(n) for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in msd.items() if strip_prefixes(k) in trained}


def checkpoint_state(engine, model, optimizer, adapters_only: bool) -> Dict[str, Any]:
    """What a checkpoint saves and loads: the engine's state, its model part cut to the adapters
    for a LoRA run. A collective (the engine's state_dict is one)."""
    state = engine.state_dict(model, optimizer)
    if adapters_only:
        state["model"] = trainable_state(model, state["model"])
    return state
