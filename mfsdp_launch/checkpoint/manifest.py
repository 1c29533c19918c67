"""What a checkpoint records about the run that wrote it, and which config changes may resume it.

A manifest holds the model section (name, config fields and the resolved `shape`), the mesh and
engine sections, the world size, versions, the full config and the list of files. At a resume the
model shape, `model.freeze` and the engine must match (`incompatibilities`), and so must the keys
that decide which samples train (`data_changes`, unless checkpoint.allow_data_change=true); every
other change is allowed and printed (`config_changes`). Pure Python.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import time
from typing import Any, Dict, List, Optional, Tuple

from . import adapters
from .layout import FORMAT

# Model config fields that decide the saved tensors' shapes (compared when dims can't be resolved).
SHAPE_CONFIG_KEYS = ("preset", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                     "tie_embeddings", "output_dim")

# The config keys that decide which samples train: a sample is a function of the seed and its
# global index over the data these describe, so a resume that changes one would not continue the
# same data. {key: the datasets that read it, None: every dataset} (data/check.py refuses a key
# set for a dataset that does not read it; data.max_bytes has a default everywhere).
SAMPLE_KEYS = {
    "data.name": None, "data.path": ("text",), "data.tokenizer": ("text",), "data.max_bytes": ("text",),
    "data.sources": ("tokens",), "data.eos_id": ("tokens",), "data.pack": ("text", "tokens"),
    "data.val_fraction": ("text", "tokens"), "train.seq_len": None, "train.seed": None,
}


def cfg_get(node, key, default=None):
    """`node.key` of a dataclass, OmegaConf node or dict; `default` when absent."""
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(key, default)
    try:
        return getattr(node, key)
    except Exception:
        return default


def plain(value):
    """OmegaConf nodes, dataclasses, enums (by name), tuples -> plain JSON types."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def model_shape(model_cfg) -> Optional[dict]:
    """The resolved dimensions that decide the saved tensors' shapes; None when unresolvable (an
    invalid model is validation's business). The one place that asks the model registry for them."""
    name = str(cfg_get(model_cfg, "name"))
    try:
        from ..models import family

        shape = family(name).shape(model_cfg)
    except Exception:
        return None
    return shape


def model_section(model_cfg) -> dict:
    section: Dict[str, Any] = {k: plain(cfg_get(model_cfg, k)) for k in ("name",) + SHAPE_CONFIG_KEYS}
    section["freeze"] = list(plain(cfg_get(model_cfg, "freeze", [])) or [])
    section["params_dtype"] = plain(cfg_get(model_cfg, "params_dtype"))
    section["shape"] = model_shape(model_cfg)
    section["peft"] = adapters.peft_section(model_cfg)  # LoRA: the adapters and the base they adapt
    return section


def engine_section(cfg) -> dict:
    sh, pc = cfg_get(cfg, "sharding"), cfg_get(cfg, "precision")
    return {
        "name": cfg_get(cfg_get(cfg, "engine"), "name"),
        "zero_dp_strategy": plain(cfg_get(sh, "zero_dp_strategy")),
        "outer_dp_sharding_strategy": plain(cfg_get(sh, "outer_dp_sharding_strategy")),
        "main_params_dtype": plain(cfg_get(pc, "main_params_dtype")),
        "compute_dtype": plain(cfg_get(pc, "compute_dtype")),
    }


def mesh_section(cfg, world_size: int) -> dict:
    mesh = {k: cfg_get(cfg_get(cfg, "mesh"), k) for k in ("dp_outer", "dp_shard", "cp", "tp")}
    mesh["world_size"] = int(world_size)
    return mesh


def collect_versions() -> dict:
    """Installed versions of the stack, from package metadata (does not import torch); the keys are
    the distribution names, None when not installed."""
    from importlib import metadata

    from .. import __version__

    out = {}
    for pkg in ("torch", "megatron-fsdp", "transformer-engine", "mfsdp-launch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    if out["mfsdp-launch"] is None:
        out["mfsdp-launch"] = __version__ + "+src"
    return out


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def manifest_info_from_config(cfg, *, world_size: Optional[int] = None,
                              versions: Optional[dict] = None) -> dict:
    """The `manifest_info` a worker passes to CheckpointManager (and what preflight compares).

    `cfg` is the resolved config (OmegaConf or dataclass).
    """
    config = plain(cfg)
    if world_size is None:
        lc = cfg_get(cfg, "launcher")
        world_size = int(cfg_get(lc, "nnodes", 1)) * int(cfg_get(lc, "nproc_per_node", 1))
    return {
        "config_hash": config_hash(config),
        "model": model_section(cfg_get(cfg, "model")),
        "mesh": mesh_section(cfg, world_size),
        "engine": engine_section(cfg),
        "versions": dict(versions) if versions is not None else collect_versions(),
        "seed": cfg_get(cfg_get(cfg, "train"), "seed", 0),
        "config": config,
    }


def new_manifest(info: dict, *, step: int, world_size: int, versions: dict, files: List[dict],
                 save_seconds: float, is_async: bool, train_state, resumed_from) -> dict:
    """The manifest.json of a step about to be committed."""
    manifest = {
        "format": FORMAT,
        "step": step,
        "config_hash": info.get("config_hash"),
        "model": info.get("model"),
        "mesh": info.get("mesh"),
        "engine": info.get("engine"),
        "world_size": world_size,
        "versions": versions,
        "seed": info.get("seed"),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "saved_at_unix": time.time(),
        "save_seconds": round(save_seconds, 4),
        "async": is_async,
        "train_state": train_state,
        "resumed_from": str(resumed_from) if resumed_from else None,
        "files": files,
    }
    if info.get("config") is not None:
        manifest["config"] = info["config"]
    return manifest


def shape_of(section: dict) -> Optional[dict]:
    """Resolved dims of a manifest's model section: its `shape`, or resolved from its config
    fields (a section written as the raw model config)."""
    if isinstance(section.get("shape"), dict):
        return section["shape"]
    from ..models import section_from

    try:
        return model_shape(section_from(section))
    except Exception:  # noqa: BLE001 - an unknown family: validation's business, as in model_shape
        return None


def incompatibilities(current: dict, manifest: dict, *, weights_only: bool) -> List[Tuple[str, Any, Any]]:
    """(key, value now, value in the checkpoint) for each change that cannot resume."""
    out: List[Tuple[str, Any, Any]] = []
    cur_m, old_m = current.get("model") or {}, manifest.get("model") or {}
    if cur_m and old_m:
        out += _model_changes(cur_m, old_m)
        if not weights_only and "freeze" in cur_m and "freeze" in old_m \
                and plain(cur_m["freeze"] or []) != plain(old_m["freeze"] or []):
            out.append(("model.freeze", cur_m["freeze"], old_m["freeze"]))
    if cur_m and old_m:
        out += adapters.changes(current, manifest, weights_only=weights_only)
    if not weights_only:
        ce, oe = (current.get("engine") or {}).get("name"), (manifest.get("engine") or {}).get("name")
        if ce and oe and ce != oe:
            out.append(("engine", ce, oe))
        co, oo = optimizer_name(current), optimizer_name(manifest)
        if co and oo and co != oo:
            out.append(("optim.name", co, oo))
    return out


def optimizer_name(info: dict) -> Optional[str]:
    """optim.name of a manifest (or manifest info) with a recorded config; adamw before the key existed."""
    config = info.get("config")
    if not isinstance(config, dict):
        return None
    return str((config.get("optim") or {}).get("name", "adamw"))


def _model_changes(cur_m: dict, old_m: dict) -> List[Tuple[str, Any, Any]]:
    if "name" in cur_m and "name" in old_m and cur_m["name"] != old_m["name"]:
        return [("model.name", cur_m["name"], old_m["name"])]
    cs, os_ = shape_of(cur_m), shape_of(old_m)
    if isinstance(cs, dict) and isinstance(os_, dict):
        return [(f"model.{k}", cs.get(k), os_.get(k)) for k in sorted(set(cs) | set(os_)) if cs.get(k) != os_.get(k)]
    # Unresolvable on one side: compare the config fields.
    return [(f"model.{k}", cur_m[k], old_m[k]) for k in SHAPE_CONFIG_KEYS
            if k in cur_m and k in old_m and cur_m[k] != old_m[k]]


def _dig(config: dict, dotted: str, default=None):
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def data_changes(current: dict, manifest: dict) -> List[Tuple[str, Any, Any]]:
    """(key, value now, value in the checkpoint) for each SAMPLE_KEYS change; [] when either side
    has no full config (checkpoints written before configs were recorded)."""
    cur, old = current.get("config"), manifest.get("config")
    if not isinstance(cur, dict) or not isinstance(old, dict):
        return []
    dataset = str(_dig(cur, "data.name", "synthetic"))
    missing = object()
    out = []
    for key, datasets in SAMPLE_KEYS.items():
        if datasets is not None and dataset not in datasets:
            continue
        a, b = _dig(old, key, missing), _dig(cur, key, missing)
        if a is not missing and b is not missing and plain(a) != plain(b):
            out.append((key, b, a))
    return out


def _flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def config_changes(current: dict, manifest: dict, *, limit: int = 12) -> List[str]:
    """Human-readable allowed differences (config keys, world size, versions) vs a manifest."""
    changes = []
    cur_cfg, old_cfg = current.get("config"), manifest.get("config")
    if isinstance(cur_cfg, dict) and isinstance(old_cfg, dict):
        a, b = _flatten(old_cfg), _flatten(cur_cfg)
        for k in sorted(set(a) | set(b)):
            if plain(a.get(k)) != plain(b.get(k)):
                changes.append(f"{k} {a.get(k)!r} -> {b.get(k)!r}")
    else:
        # No full configs recorded: the mesh and engine sections still show what changed.
        for section in ("mesh", "engine"):
            a = {k: v for k, v in (manifest.get(section) or {}).items() if k != "world_size"}
            b = {k: v for k, v in (current.get(section) or {}).items() if k != "world_size"}
            for k in sorted(set(a) & set(b)):
                if plain(a[k]) != plain(b[k]):
                    changes.append(f"{section}.{k} {a[k]!r} -> {b[k]!r}")
    old_ws = manifest.get("world_size", (manifest.get("mesh") or {}).get("world_size"))
    new_ws = (current.get("mesh") or {}).get("world_size")
    if old_ws is not None and new_ws is not None and old_ws != new_ws:
        changes.append(f"world size {old_ws} -> {new_ws} (DCP reshards model and optimizer)")
    ov, nv = manifest.get("versions") or {}, current.get("versions") or {}
    for k in sorted(set(ov) & set(nv)):
        if ov[k] != nv[k]:
            changes.append(f"{k} {ov[k]} -> {nv[k]}")
    if len(changes) > limit:
        changes = changes[:limit] + [f"... and {len(changes) - limit} more"]
    return changes
