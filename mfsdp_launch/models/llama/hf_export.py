"""Write a Hugging Face model directory: `config.json` plus `model.safetensors`, or above a shard
size `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`.

`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads the result. Each file is
written atomically (tmp, fsync, rename) with mode 0644; tensors are built one shard at a time, so
the peak memory is the source state plus one shard. Files of an earlier export into the same
directory that this one did not write (`model*.safetensors`, the index) are removed afterwards,
so the directory never mixes two exports.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence

from ...core.atomic_io import atomic_write, atomic_write_text
from ...core.errors import ConfigError
from .dims import GPTDims
from . import hf_keys as llama_keys
from .hf_config import CONFIG_FILE, base_max_positions, llama_config

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FILE_MODE = 0o644
_OUR_FILES = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def shard_file_name(index: int, count: int) -> str:
    """transformers' shard naming, 1-based."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(nbytes: Mapping[str, int], max_shard_bytes: int) -> List[List[str]]:
    """Tensors in order, packed greedily into shards of at most `max_shard_bytes` (a tensor
    larger than that gets a shard of its own)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, n in nbytes.items():
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def hf_dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).replace("torch.", "")


def write_hf_dir(out_dir: str | os.PathLike, nbytes: Mapping[str, int], make: Callable[[str], "torch.Tensor"],
                 config: Mapping[str, Any], *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 metadata: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Write the tensors named in `nbytes` (in that order; `make(name)` builds each) and `config`.

    Returns {"path", "files", "tensors", "params", "bytes", "sharded"}.
    """
    from safetensors.torch import save_file

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError("OUT_DIR", f"{out} exists and is not a directory")
    if not out.parent.is_dir():
        raise ConfigError("OUT_DIR", f"{out.parent} does not exist")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out.mkdir(exist_ok=True)
    shards = plan_shards(nbytes, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [shard_file_name(i + 1, len(shards)) for i in range(len(shards))]
    meta = {"format": "pt", **(metadata or {})}  # transformers refuses files without format=pt
    weight_map: Dict[str, str] = {}
    params = 0
    for file_name, shard in zip(names, shards):
        tensors = {}
        for name in shard:
            t = make(name).contiguous()
            params += t.numel()
            tensors[name] = t
            weight_map[name] = file_name
        # safetensors writes by path only: into the open tmp file's name; the fsync on that handle
        # covers it (fsync syncs the file, not just what this handle wrote).
        atomic_write(out / file_name, lambda f, t=tensors: save_file(t, f.name, metadata=meta), mode=FILE_MODE)
        del tensors
    written = set(names)
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(nbytes.values()))}, "weight_map": weight_map}
        atomic_write_text(out / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n", mode=FILE_MODE)
        written.add(INDEX_FILE)
    atomic_write_text(out / CONFIG_FILE, json.dumps(dict(config), indent=2, sort_keys=True) + "\n", mode=FILE_MODE)
    for p in out.iterdir():  # an earlier export's files: never mix two exports
        if p.name not in written and (p.name == INDEX_FILE or _OUR_FILES.match(p.name)):
            p.unlink()
    _fsync_dir(out)
    return {"path": str(out), "files": names, "tensors": len(weight_map), "params": params,
            "bytes": int(sum(nbytes.values())), "sharded": len(shards) > 1}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cast(t: "torch.Tensor", dtype: Optional["torch.dtype"]) -> "torch.Tensor":
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _float_dtype(tensors) -> "torch.dtype":
    import torch

    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def export_gpt_state(state: Mapping[str, "torch.Tensor"], out_dir: str | os.PathLike, *, dims: GPTDims,
                     model: str = "gpt", dtype: Optional["torch.dtype"] = None,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, max_position_embeddings: int = 4096,
                     metadata: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """A full (unsharded, unwrapped) `gpt`/`te_gpt` state dict -> a Llama HF directory.

    `dtype` casts floating tensors (None: as in `state`). TE `_extra_state` entries are skipped.
    """
    import torch

    table = llama_keys.sources(dims, model)
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not llama_keys.is_ignored(k)}
    extra = llama_keys.unknown_keys(state, table)
    missing = [k for k in table if k not in state]
    if extra or missing:
        raise ConfigError("CKPT_DIR", f"the weights are not a {model} of the configured dims: unknown "
                                      f"{extra[:3]}, missing {missing[:3]}")
    for name, t in state.items():
        rows = sum(s.rows for s in table[name])
        if t.shape[0] != rows:
            raise ConfigError("CKPT_DIR", f"{name} has {t.shape[0]} rows, the configured dims give {rows}")
    out_dtype = dtype or _float_dtype(state.values())
    shapes = llama_keys.hf_shapes(dims)
    nbytes = {name: out_dtype.itemsize * _numel(shape) for name, shape in shapes.items()}
    placed = llama_keys.inverse(table)

    def make(name):
        return _cast(llama_keys.hf_tensor(name, shapes[name], state, placed[name]), out_dtype)

    config = llama_config(dims, dtype=hf_dtype_name(out_dtype), max_position_embeddings=max_position_embeddings)
    return write_hf_dir(out_dir, nbytes, make, config, max_shard_bytes=max_shard_bytes, metadata=metadata)


def export_variant_state(state: Mapping[str, "torch.Tensor"], out_dir: str | os.PathLike, *, dims: GPTDims,
                         dtype: Optional["torch.dtype"] = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                         max_position_embeddings: int = 4096,
                         metadata: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """A full MoE / qk_norm `gpt` state dict -> a Qwen3-MoE, Qwen3 or Mixtral directory
    (models/llama/hf_moe.py says which and how)."""
    from . import hf_moe

    out_dtype = dtype or _float_dtype(v for v in state.values() if hasattr(v, "is_floating_point"))
    nbytes, make = hf_moe.variant_tensors(state, dims, out_dtype)
    config = hf_moe.hf_config(dims, dtype=hf_dtype_name(out_dtype), max_position_embeddings=max_position_embeddings)
    return write_hf_dir(out_dir, nbytes, make, config, max_shard_bytes=max_shard_bytes, metadata=metadata)


def export_hf_state(state: Mapping[str, "torch.Tensor"], out_dir: str | os.PathLike, *,
                    hf_config: Mapping[str, Any], dtype: Optional["torch.dtype"] = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    metadata: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """A `model=hf` state dict (already HF's own names) -> an HF directory with `hf_config`
    (a `config.to_dict()`), whose dtype entries are set to the written dtype. A tied
    `lm_head.weight` is left out, as `save_pretrained` does."""
    import torch

    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not llama_keys.is_ignored(k)}
    if hf_config.get("tie_word_embeddings") and llama_keys.HF_EMBED in tensors:
        tensors.pop(llama_keys.HF_HEAD, None)
    out_dtype = dtype or _float_dtype(tensors.values())
    nbytes = {k: _numel(v.shape) * (out_dtype if v.is_floating_point() else v.dtype).itemsize
              for k, v in tensors.items()}
    config = dict(hf_config)
    config["torch_dtype"] = config["dtype"] = hf_dtype_name(out_dtype)
    return write_hf_dir(out_dir, nbytes, lambda k: _cast(tensors[k], out_dtype), config,
                        max_shard_bytes=max_shard_bytes, metadata=metadata)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ------------------------------------------------------------------- mfsdp-export --format hf

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export_checkpoint(ckpt: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: Optional[str] = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Dict[str, Any]:
    """`mfsdp-export CKPT OUT_DIR --format hf`: a committed `gpt`/`te_gpt` checkpoint as a Llama
    directory, or a `model=hf` one with its own keys and config. The dims come from the run's
    config in the checkpoint manifest. `dtype`: fp32|bf16|fp16, None keeps the saved dtype.

    Returns write_hf_dir's dict plus "step", "source", "format", "tensors", "params", "bytes".
    """
    import torch

    from ...checkpoint.weights import read_model_state

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError("OUT", f"{out} exists and is not a directory; --format hf writes a directory")
    state, found = read_model_state(ckpt)
    model_cfg = _run_model_config(found)
    name = str(model_cfg.name)
    from ...checkpoint.adapters import of

    if of(found.manifest):
        raise ConfigError("--format", f"hf: {found.path} holds LoRA adapters only (model.peft), not a model",
                          f"--format hf --merge (merged into their base, {of(found.manifest)['base']['path']}), "
                          "or --format peft")
    torch_dtype = getattr(torch, TORCH_DTYPES[dtype]) if dtype else None
    meta = {"step": str(found.step), "source": str(found.path)}
    if name in llama_keys.MODELS:
        from .dims import resolve_gpt_dims
        from .hf_moe import uses_variant

        seq_len = int((found.manifest.get("config") or {}).get("train", {}).get("seq_len", 0))
        dims = resolve_gpt_dims(model_cfg)
        # Mixtures of experts and Qwen3-style attention: a Qwen3-MoE / Qwen3 / Mixtral directory.
        writer = export_variant_state if uses_variant(dims) else functools.partial(export_gpt_state, model=name)
        info = writer(state, out, dims=dims, dtype=torch_dtype, max_shard_bytes=max_shard_bytes, metadata=meta,
                      max_position_embeddings=base_max_positions(model_cfg.init_from) or max(4096, seq_len))
    elif name == "hf":
        info = export_hf_state(state, out, hf_config=_hf_config_dict(model_cfg), dtype=torch_dtype,
                               max_shard_bytes=max_shard_bytes, metadata=meta)
        if model_cfg.path:
            info["copied"] = copy_side_files(model_cfg.path, out)
    else:
        raise ConfigError("--format", f"hf needs a checkpoint of model=gpt, te_gpt or hf; {found.path} is "
                          f"model={name}", "safetensors|torch")
    return dict(info, step=found.step, source=str(found.path), format="hf")


# Files of an HF directory that are not weights or config.json, copied with a model=hf export so
# that the result loads with its tokenizer (AutoTokenizer) and generation defaults.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")


def copy_side_files(src_dir: str | os.PathLike, out: Path) -> List[str]:
    src = Path(src_dir).expanduser()
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            data = (src / name).read_bytes()
            atomic_write(out / name, lambda f, d=data: f.write(d), mode=FILE_MODE)
            copied.append(name)
    return copied


def _run_model_config(found):
    """The run's `model` section from the checkpoint manifest, as a ModelConfig."""
    from .. import section_from

    section = (found.manifest.get("config") or {}).get("model")
    if not isinstance(section, dict):
        raise ConfigError("CKPT_DIR", f"{found.path}'s manifest has no run config; --format hf needs the dims")
    return section_from(section)


def _hf_config_dict(m) -> Dict[str, Any]:
    from ..hf.model import resolve_hf_model

    src = resolve_hf_model(path=m.path, hf_config=m.hf_config or None, hf_class=m.hf_class)
    config = src.config.to_dict()
    config["architectures"] = [src.class_name]
    config["use_cache"] = True  # the run turned the KV cache off for training; inference wants it
    return config
