"""LlamaConfig (`config.json`) <-> GPTDims, without torch or transformers.

One table, `DIMS_TO_LLAMA`, names each GPTDims field's LlamaConfig key; writing a config, reading
one and reporting a mismatch all go through it. Reading refuses what `gpt`/`te_gpt` cannot
reproduce (biases, another activation, RoPE scaled other than Llama-3's, a head_dim other than
hidden/heads) in one line naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from ...core.errors import ConfigError
from .dims import GPTDims, RopeScaling, check_gpt_dims, resolve_rope_scaling

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
CONFIG_FILE = "config.json"

# GPTDims field -> LlamaConfig key.
DIMS_TO_LLAMA = (
    ("dim", "hidden_size"),
    ("ffn_dim", "intermediate_size"),
    ("n_layers", "num_hidden_layers"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("vocab_size", "vocab_size"),
    ("norm_eps", "rms_norm_eps"),
    ("rope_theta", "rope_theta"),
    ("tie_embeddings", "tie_word_embeddings"),
    ("rope_scaling", "rope_scaling"),  # a RopeScaling <-> HF's mapping; written only when set
)

# Config dtype names (components/precision.py's) -> the names HF writes in config.json.
HF_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


def llama_config(dims: GPTDims, *, dtype: str = "float32",
                 max_position_embeddings: int = 4096) -> Dict[str, Any]:
    """The config.json dict of a LlamaForCausalLM with `dims`.

    `dtype` is an HF name ("bfloat16") or a config name ("bf16"). It is written as both
    `torch_dtype` (transformers 4.x) and `dtype` (5.x); `rope_theta` stays top-level and Llama-3
    scaling goes to `rope_scaling`, which 5.x reads into `rope_parameters`. max_position_embeddings
    does not change the RoPE (`max_positions` raises it for a scaled one).
    """
    dtype = HF_DTYPE_NAMES.get(dtype, dtype)
    cfg: Dict[str, Any] = {
        "architectures": [LLAMA_ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": dims.head_dim,
        "max_position_embeddings": max_positions(dims, max_position_embeddings),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    for field, key in DIMS_TO_LLAMA:
        if field != "rope_scaling":
            cfg[key] = getattr(dims, field)
    cfg.update(rope_scaling_entry(dims))
    return cfg


def rope_scaling_entry(dims: GPTDims) -> Dict[str, Any]:
    """{"rope_scaling": HF's mapping} for a scaled RoPE, {} for plain RoPE (configs stay as they were)."""
    return {} if dims.rope_scaling is None else {"rope_scaling": dims.rope_scaling.to_config()}


def max_positions(dims: GPTDims, requested: int) -> int:
    """config.json's max_position_embeddings: `requested`, unless a Llama-3 scaling needs more:
    transformers warns when it is not above original_max_position_embeddings, and then the
    context the factor reaches (factor x original) is written. The RoPE does not read it."""
    s = dims.rope_scaling
    if s is None or int(requested) > s.original_max_position_embeddings:
        return int(requested)
    return int(s.factor * s.original_max_position_embeddings)


def base_max_positions(init_from: Optional[str]) -> Optional[int]:
    """The max_position_embeddings of a run's `model.init_from` directory, when it is still
    readable here: an export of a fine-tuned Llama-3.2 then says 131072, as Meta's config does."""
    if not init_from:
        return None
    try:
        value = read_config_json(init_from, key="model.init_from").get("max_position_embeddings")
    except ConfigError:  # gone, or not a config any more: the export's own default
        return None
    return value if isinstance(value, int) and value > 0 else None


def read_config_json(hf_dir: str | Path, *, key: str) -> Dict[str, Any]:
    """`hf_dir/config.json` as a dict; a ConfigError under `key` when it is missing or not JSON."""
    path = Path(hf_dir).expanduser()
    if not path.is_dir():
        raise ConfigError(key, f"{path} is not a directory")
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ConfigError(key, f"{path} has no {CONFIG_FILE}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{cfg_path} is not readable JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(key, f"{cfg_path} does not hold a JSON object")
    return cfg


def rope_mapping(cfg: Dict[str, Any]) -> tuple[str, Dict[str, Any]]:
    """(its key, the RoPE mapping) of a config: 4.x `rope_scaling` or 5.x `rope_parameters`
    (transformers 5 takes rope_scaling first too)."""
    for name in ("rope_scaling", "rope_parameters"):
        if cfg.get(name):
            return name, cfg[name]
    return "rope_parameters", {}


def rope_theta_of(cfg: Dict[str, Any]) -> Optional[float]:
    """rope_theta from a 4.x (top-level) or 5.x (inside `rope_parameters`) config; None if unset."""
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    return None if theta is None else float(theta)


def rope_scaling_of(cfg: Dict[str, Any], *, key: str, source: str) -> Optional[RopeScaling]:
    """The config's Llama-3 RoPE scaling, None for plain RoPE; a ConfigError under `key` for any
    other rope type or a malformed one (dims.resolve_rope_scaling's rule, as for model.rope_scaling)."""
    name, rope = rope_mapping(cfg)
    # rope_theta is read beside it; transformers falls back to max_position_embeddings for the old
    # context and reads a mapping that names no type as plain RoPE.
    scaling = resolve_rope_scaling(rope or None, key=key, label=f"{source}: {name}: ",
                                   ignored=("rope_theta", "partial_rotary_factor"),
                                   original_default=cfg.get("max_position_embeddings"), untyped_is_default=True)
    if scaling is not None and rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(key, f"{source}: {name}.partial_rotary_factor={rope['partial_rotary_factor']}: "
                               "gpt/te_gpt rotate the whole head", "1.0")
    return scaling


def dims_from_llama_config(cfg: Dict[str, Any], *, key: str, source: str = CONFIG_FILE) -> GPTDims:
    """GPTDims of a Llama-layout config dict; a ConfigError under `key` naming the HF key that
    `gpt`/`te_gpt` cannot represent."""
    archs = cfg.get("architectures") or []
    if cfg.get("model_type") != "llama" and LLAMA_ARCHITECTURE not in archs:
        raise ConfigError(key, f"{source}: model_type={cfg.get('model_type')!r} architectures={archs} "
                               "is not a Llama layout", LLAMA_ARCHITECTURE)
    for hf_key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf_key in cfg and cfg[hf_key] != allowed:
            raise ConfigError(key, f"{source}: {hf_key}={cfg[hf_key]!r} is not supported by gpt/te_gpt",
                              json.dumps(allowed))
    theta = rope_theta_of(cfg)
    values: Dict[str, Any] = {}
    for field, hf_key in DIMS_TO_LLAMA:
        if hf_key == "rope_theta":
            values[field] = 10000.0 if theta is None else theta  # LlamaConfig's default
        elif hf_key == "rope_scaling":
            values[field] = rope_scaling_of(cfg, key=key, source=source)
        elif hf_key == "num_key_value_heads":
            values[field] = int(cfg.get(hf_key) or cfg.get("num_attention_heads", 0))
        elif hf_key == "tie_word_embeddings":
            values[field] = bool(cfg.get(hf_key, False))
        elif hf_key == "rms_norm_eps":
            values[field] = float(cfg.get(hf_key, 1e-6))  # LlamaConfig's default
        elif hf_key not in cfg:
            raise ConfigError(key, f"{source} has no {hf_key}")
        else:
            values[field] = int(cfg[hf_key])
    dims = GPTDims(**values)
    try:
        check_gpt_dims(dims)
    except ConfigError as exc:
        raise ConfigError(key, f"{source}: {exc}") from exc
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) != dims.head_dim:
        raise ConfigError(key, f"{source}: head_dim={head_dim} differs from hidden_size/num_attention_heads="
                               f"{dims.head_dim}, which gpt/te_gpt require")
    return dims


def _shown(value: Any) -> Any:
    return "null" if value is None else value.describe() if isinstance(value, RopeScaling) else value


def check_dims_match(dims: GPTDims, hf_dims: GPTDims, *, source: str, prefix: str = "model.") -> None:
    """ConfigError under `model.<field>` for the first field where the run's dims differ from
    an HF config's (`source` names the file in the message)."""
    for field, hf_key in DIMS_TO_LLAMA:
        ours, theirs = getattr(dims, field), getattr(hf_dims, field)
        if ours != theirs:
            raise ConfigError(f"{prefix}{field}", f"{_shown(ours)} but {source} has {hf_key}={_shown(theirs)}")


def read_llama_dims(hf_dir: str | Path, *, key: str) -> GPTDims:
    """GPTDims of `hf_dir/config.json` (for `model.init_from`)."""
    cfg = read_config_json(hf_dir, key=key)
    return dims_from_llama_config(cfg, key=key, source=str(Path(hf_dir).expanduser() / CONFIG_FILE))
