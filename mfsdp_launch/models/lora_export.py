"""A LoRA run's checkpoint (adapters only, checkpoint/adapters.py) out to Hugging Face:

* `--format peft`: an adapter directory (`adapter_config.json`, `adapter_model.safetensors`)
  that `peft.PeftModel.from_pretrained(base, DIR)` loads over the base's HF model.
* `--format hf --merge`: the base directory with each adapted weight replaced by
  W + (alpha / r) * B @ A (computed in fp32), which `transformers` loads as a plain model.

Both speak the base's HF names. `model=hf` adapters already have them; a `gpt` adapter on a
fused weight (wqkv = [q; k; v], w_gate_up = [gate; up]) becomes one adapter per HF layer, each
with the same A and its rows of B, which is the same update (`hf_adapters`). The base is the
directory recorded in the checkpoint's manifest (or `--base DIR`), and its files must still have
the checksum recorded there: adapters merged into another base would be a different model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from ..core.errors import ConfigError
from . import lora

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # peft's saved key prefix: PeftModel -> LoraModel -> the HF model
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64",
                      "I32": "int32", "U8": "uint8", "BOOL": "bool"}


def run_section(found) -> Tuple[Any, Optional[dict]]:
    """(the run's model config, its manifest's `model.peft` section or None) of a checkpoint."""
    from . import section_from
    from ..checkpoint.adapters import of

    model = (found.manifest.get("config") or {}).get("model")
    if not isinstance(model, dict):
        raise ConfigError("CKPT_DIR", f"{found.path}'s manifest has no run config")
    return section_from(model), of(found.manifest)


def hf_adapters(state: Mapping[str, "torch.Tensor"], model_cfg) -> Dict[str, Tuple["torch.Tensor", "torch.Tensor"]]:
    """{HF module name: (A, B)} of a checkpoint's adapter tensors, in the base's HF layout."""
    pairs = lora.adapter_pairs(state)
    name = str(model_cfg.name)
    if name == "hf":
        return dict(pairs)
    if name != "gpt":
        raise ConfigError("CKPT_DIR", f"model={name} has no LoRA export")
    from .llama import hf_keys
    from .llama.dims import resolve_gpt_dims

    dims = resolve_gpt_dims(model_cfg)
    table, shapes = hf_keys.sources(dims, name), hf_keys.hf_shapes(dims)
    out: Dict[str, Tuple["torch.Tensor", "torch.Tensor"]] = {}
    for module, (a, b) in pairs.items():
        row = 0
        for seg in table[module + ".weight"]:
            if seg.hf_row != 0 or seg.rows != shapes[seg.hf_name][0]:  # (never for gpt's layout)
                raise ConfigError("CKPT_DIR", f"{module} covers part of {seg.hf_name}: no HF adapter for it")
            out[seg.hf_name[:-len(".weight")]] = (a, b[row:row + seg.rows])
            row += seg.rows
    return out


def checked_base(section: dict, base: Optional[str], key: str) -> Path:
    """The base directory to merge into or name: `--base`, else the manifest's; its checksum must
    match the one recorded when the adapters were saved."""
    from ..checkpoint.adapters import base_checksum

    recorded = section["base"]
    path = Path(base).expanduser().absolute() if base else Path(str(recorded.get("path")))
    if not path.is_dir():
        raise ConfigError(key, f"the LoRA base {path} ({'given' if base else 'recorded in the checkpoint'}) is not "
                          "a directory", "--base DIR: the directory of the base the adapters were trained over")
    got = base_checksum(path, key)
    if recorded.get("checksum") and got != recorded["checksum"]:
        raise ConfigError(key, f"the files of {path} ({got}) are not the base the adapters were trained over "
                          f"({recorded['checksum']}, {recorded.get('path')})", "--base DIR: that base's directory")
    return path


def write_peft_dir(adapters: Mapping[str, Tuple["torch.Tensor", "torch.Tensor"]], section: dict, out_dir,
                   base_path: Path, *, dtype: Optional["torch.dtype"] = None, metadata=None) -> Dict[str, Any]:
    """adapter_config.json + adapter_model.safetensors for `PeftModel.from_pretrained`."""
    from safetensors.torch import save_file

    from ..core.atomic_io import atomic_write, atomic_write_text

    out = _out_dir(out_dir)
    tensors = {}
    for module, (a, b) in adapters.items():
        for part, t in (("lora_A", a), ("lora_B", b)):
            t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            tensors[f"{PEFT_PREFIX}{module}.{part}.weight"] = t.contiguous().clone()  # A is shared: own copies
    config = lora.import_peft("--format").LoraConfig(
        r=section["r"], lora_alpha=section["alpha"], lora_dropout=section["dropout"], bias="none",
        target_modules=sorted({m.rsplit(".", 1)[-1] for m in adapters}), task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_path)).to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}  # JSON: no sets
    atomic_write(out / ADAPTER_WEIGHTS, lambda f: save_file(tensors, f.name, metadata={"format": "pt", **(metadata or {})}),
                 mode=0o644)
    atomic_write_text(out / ADAPTER_CONFIG, json.dumps(config, indent=2, sort_keys=True, default=str) + "\n", mode=0o644)
    params = sum(t.numel() for t in tensors.values())
    return {"path": str(out), "tensors": len(tensors), "params": params,
            "bytes": (out / ADAPTER_WEIGHTS).stat().st_size}


def write_merged_dir(adapters: Mapping[str, Tuple["torch.Tensor", "torch.Tensor"]], section: dict, out_dir,
                     base_path: Path, *, dtype: Optional["torch.dtype"] = None, metadata=None) -> Dict[str, Any]:
    """The base's HF directory with the adapters merged into its weights (base dtype unless `dtype`)."""
    import torch
    from safetensors import safe_open

    from .hf_weights import weight_files
    from .llama.hf_export import copy_side_files, write_hf_dir

    out = _out_dir(out_dir)
    files = weight_files(base_path, key="--base")
    scale = float(section["alpha"]) / int(section["r"])
    deltas = {m + ".weight": (a, b) for m, (a, b) in adapters.items()}
    missing = [n for n in deltas if n not in files]
    if missing:
        raise ConfigError("--base", f"{base_path} has no {missing[0]}, which the adapters adapt")
    nbytes: Dict[str, int] = {}
    dtypes: Dict[str, "torch.dtype"] = {}
    for path in sorted(set(files.values())):  # shapes and dtypes from the headers
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                saved = getattr(torch, SAFETENSORS_DTYPES.get(piece.get_dtype(), ""), None) or f.get_tensor(name).dtype
                dtypes[name] = dtype if dtype is not None and saved.is_floating_point else saved
                numel = 1
                for s in piece.get_shape():
                    numel *= int(s)
                nbytes[name] = numel * dtypes[name].itemsize

    def read(name: str) -> "torch.Tensor":
        with safe_open(str(files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def make(name: str) -> "torch.Tensor":
        t = read(name)
        if name in deltas:
            a, b = deltas[name]
            t = t.float() + scale * (b.float() @ a.float())
        return t.to(dtypes[name])

    config = json.loads((base_path / "config.json").read_text())
    info = write_hf_dir(out, nbytes, make, config, metadata=metadata)
    info["copied"] = copy_side_files(base_path, out)
    return info


def _out_dir(out_dir) -> Path:
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError("OUT", f"{out} exists and is not a directory")
    if not out.parent.is_dir():
        raise ConfigError("OUT", f"{out.parent} does not exist")
    out.mkdir(exist_ok=True)
    return out


def export_adapters(ckpt, out_dir, *, merge: bool, base: Optional[str] = None,
                    dtype: Optional["torch.dtype"] = None) -> Dict[str, Any]:
    """`mfsdp-export CKPT OUT --format peft` (merge=False) or `--format hf --merge` (merge=True)."""
    from ..checkpoint.weights import read_model_state

    state, found = read_model_state(ckpt)
    model_cfg, section = run_section(found)
    if section is None:
        raise ConfigError("--merge" if merge else "--format", f"{found.path} holds a whole model, not LoRA "
                          "adapters (its run had model.peft.kind=none)",
                          "--format hf without --merge" if merge else "safetensors|torch|hf")
    base_path = checked_base(section, base, "--base")
    adapters = hf_adapters(state, model_cfg)
    meta = {"step": str(found.step), "source": str(found.path), "base": str(base_path)}
    write = write_merged_dir if merge else write_peft_dir
    info = write(adapters, section, out_dir, base_path, dtype=dtype, metadata=meta)
    return dict(info, step=found.step, source=str(found.path), format="hf" if merge else "peft",
                base=str(base_path))
