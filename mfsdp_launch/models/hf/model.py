"""`model=hf`: a Hugging Face causal LM from a local directory (`model.path`) or from a config
dict (`model.hf_config`, with `model.hf_class` or a `model_type`), built on the current default
device (meta works) with SDPA attention.

Nothing is downloaded: a `model.path` that is not a local directory is refused in one line.
Encoder and encoder-decoder architectures are refused: only causal LMs train under the next-token
loss. FSDP units come from the model's `_no_split_modules`. Pretrained weights load through
`mfsdp_launch.models.hf_weights` with the model's own key names (`sources=None`). transformers is optional:
without it every entry point is one line naming `pip install 'mfsdp-launch[hf]'`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from ...core.errors import ConfigError
from ..llama.hf_config import CONFIG_FILE
from ...core.names import first_line

if TYPE_CHECKING:
    import torch
    from torch import nn

INSTALL_HINT = "pip install 'mfsdp-launch[hf]'"


def import_transformers(key: str = "model.name"):
    """The transformers module, or a ConfigError naming the extra to install."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(key, f"model=hf needs transformers, which is not installed ({INSTALL_HINT})") from exc
    return transformers


def check_model_path(path: str, key: str = "model.path") -> Path:
    """A local directory holding config.json; anything else is one line (nothing is downloaded)."""
    p = Path(str(path)).expanduser()
    if not p.exists():
        raise ConfigError(key, f"{path!r} is not a local directory, and nothing is downloaded: fetch the model "
                               f"first (e.g. `huggingface-cli download NAME --local-dir DIR`) and give DIR")
    if not p.is_dir():
        raise ConfigError(key, f"{p} is not a directory")
    if not (p / CONFIG_FILE).is_file():
        raise ConfigError(key, f"{p} has no {CONFIG_FILE}")
    return p


@dataclass
class HFModelSource:
    """What `build_hf_model` builds: the HF config, the causal-LM class, the local dir (or None)."""

    config: Any
    cls: type
    path: Optional[Path]

    @property
    def class_name(self) -> str:
        return self.cls.__name__


def _causal_lm_names(transformers) -> Tuple[Dict[str, str], set, set]:
    from transformers.models.auto import modeling_auto as auto

    causal = dict(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return causal, set(causal.values()), set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def check_causal_lm(config, class_name: str, key: str) -> None:
    """Refuse classes that are not causal LMs, encoder-decoders and masked-LM (encoder) families."""
    transformers = import_transformers(key)
    _, causal_classes, masked_types = _causal_lm_names(transformers)
    model_type = getattr(config, "model_type", None)
    if (class_name not in causal_classes or getattr(config, "is_encoder_decoder", False)
            or model_type in masked_types):
        raise ConfigError(key, f"{class_name} (model_type {model_type!r}) is not a causal language model; "
                               "model=hf trains decoder-only causal LMs", "*ForCausalLM")


def _class(transformers, name: str, key: str) -> type:
    cls = getattr(transformers, str(name), None)
    if not isinstance(cls, type):
        raise ConfigError(key, f"transformers has no model class {name!r}", "e.g. LlamaForCausalLM")
    return cls


def resolve_hf_model(path: Optional[str] = None, hf_config: Optional[Mapping[str, Any]] = None,
                     hf_class: Optional[str] = None) -> HFModelSource:
    """Validate and resolve `model.path` / `model.hf_config` / `model.hf_class` (ConfigErrors, one
    line each). Reads config.json only; builds nothing."""
    transformers = import_transformers()
    if (path is None) == (not hf_config):
        raise ConfigError("model.path", "model=hf needs exactly one of model.path (a local HF directory) "
                                        "and model.hf_config")
    local = None
    if path is not None:
        local = check_model_path(path)
        try:
            config = transformers.AutoConfig.from_pretrained(str(local), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - an unknown model_type, remote code, bad JSON
            first = first_line(exc)
            raise ConfigError("model.path", f"{local / CONFIG_FILE}: {type(exc).__name__}: {first}") from exc
    elif hf_class:
        fields = {k: v for k, v in dict(hf_config).items() if k != "model_type"}  # the class decides it
        config = _class(transformers, hf_class, "model.hf_class").config_class(**fields)
    else:
        fields = dict(hf_config)
        if "model_type" not in fields:
            raise ConfigError("model.hf_config", "needs a model_type (or set model.hf_class)")
        try:
            config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        except ValueError as exc:
            raise ConfigError("model.hf_config", first_line(exc)) from exc
    causal, _, _ = _causal_lm_names(transformers)
    archs = list(getattr(config, "architectures", None) or [])
    name = hf_class or (archs[0] if archs else causal.get(getattr(config, "model_type", None)))
    key = "model.hf_class" if hf_class else ("model.path" if path is not None else "model.hf_config")
    if name is None:
        raise ConfigError(key, f"model_type {config.model_type!r} has no causal-LM class in transformers")
    check_causal_lm(config, name, key)
    cls = _class(transformers, name, key)
    if not isinstance(config, cls.config_class):
        raise ConfigError(key, f"{name} takes a {cls.config_class.__name__}, the config is a {type(config).__name__}")
    config.use_cache = False  # training: no KV cache
    return HFModelSource(config=config, cls=cls, path=local)


def build_hf_model(src: HFModelSource, dtype: Optional["torch.dtype"] = None) -> "nn.Module":
    """The model on the current default device (`with torch.device("meta")` works), SDPA attention,
    parameters in `dtype` (default: torch's default dtype, not the config's)."""
    import torch
    import transformers
    from packaging.version import Version

    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    kwargs = {dtype_kw: dtype or torch.get_default_dtype(), "attn_implementation": "sdpa"}
    return src.cls._from_config(src.config, **kwargs)


def use_attention(model: "nn.Module", name: str, function) -> None:
    """Run a built HF model's attention through `function`, registered with transformers'
    `AttentionInterface` as `name` (transformers builds no mask for a name it has no mask function
    for: the function gets None)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def unit_module_classes(model: "nn.Module") -> tuple:
    """The classes named by the model's `_no_split_modules` that occur in it (its decoder layers)."""
    names = list(getattr(model, "_no_split_modules", None) or [])
    found: Dict[str, type] = {}
    for m in model.modules():
        if type(m).__name__ in names:
            found.setdefault(type(m).__name__, type(m))
    if not found:
        raise ConfigError("model.fsdp_unit_modules", f"{type(model).__name__} declares no _no_split_modules "
                                                     "present in it; name the unit classes")
    return tuple(found.values())


def unit_module_names(model: "nn.Module") -> List[str]:
    """Dotted names of `unit_module_classes` (for `model.fsdp_unit_modules` and messages)."""
    return [f"{c.__module__}.{c.__qualname__}" for c in unit_module_classes(model)]


def init_hf_weights(model: "nn.Module") -> None:
    """Re-initialize every parameter in place with the model's own `_init_weights` (works on
    materialized-meta and DTensor parameters) and recompute the RoPE `inv_freq` buffers, which
    `to_empty()` leaves as garbage."""
    import torch

    with torch.no_grad():
        for m in model.modules():  # transformers 5 skips modules and tensors flagged initialized
            if getattr(m, "_is_hf_initialized", False):
                m._is_hf_initialized = False
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                if getattr(t, "_is_hf_initialized", False):
                    t._is_hf_initialized = False
        model.apply(model._init_weights)
        reset_rope_buffers(model)
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
            model.tie_weights()


def _rope_parameters(m, device) -> tuple:
    """(inv_freq, attention_scaling) of a rotary embedding module, computed from its config."""
    fn = getattr(m, "rope_init_fn", None)  # transformers 4.x
    if fn is None:  # 5.x
        rope_type = getattr(m, "rope_type", "default")
        if rope_type == "default":
            fn = m.compute_default_rope_parameters
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            fn = ROPE_INIT_FUNCTIONS[rope_type]
    return fn(m.config, device=device)


def _rope_modules(model: "nn.Module"):
    import torch

    for m in model.modules():
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor) and hasattr(m, "config"):
            yield m


def reset_rope_buffers(model: "nn.Module") -> None:
    """Recompute each rotary embedding's inv_freq (and original_inv_freq) from its config."""
    import torch

    for m in _rope_modules(model):
        inv = m.inv_freq
        if inv.is_meta:
            continue
        fresh, scaling = _rope_parameters(m, inv.device)
        inv.copy_(fresh)
        if isinstance(getattr(m, "original_inv_freq", None), torch.Tensor):
            m.original_inv_freq.copy_(fresh)
        m.attention_scaling = scaling


def support_module_init(model: "nn.Module") -> None:
    """Make a meta-device build initializable module by module, as Megatron-FSDP's meta init does
    it: it materializes each module that owns parameters and calls its `reset_parameters()`,
    which HF norms lack, and never materializes parameter-less modules' buffers. So every such
    module gets a `reset_parameters` running the model's own `_init_weights`, and each RoPE
    module computes its `inv_freq` on the input's device at its first forward if it is still on
    the meta device. (FSDP2's path, `init_hf_weights` on the whole model, does not need this.)"""
    import functools

    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.reset_parameters = functools.partial(_init_one, model, m)
    for m in _rope_modules(model):
        m.register_forward_pre_hook(_materialize_rope)


def _init_one(model: "nn.Module", module: "nn.Module") -> None:
    import torch

    with torch.no_grad():
        module._is_hf_initialized = False
        for t in module.parameters(recurse=False):
            t._is_hf_initialized = False
        model._init_weights(module)


def _materialize_rope(module: "nn.Module", args) -> None:
    import torch

    if not module.inv_freq.is_meta:
        return
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    fresh, scaling = _rope_parameters(module, device)
    module.register_buffer("inv_freq", fresh, persistent=False)
    if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
        module.register_buffer("original_inv_freq", fresh.clone(), persistent=False)
    module.attention_scaling = scaling


def hf_logits(model: "nn.Module", input_ids: "torch.Tensor") -> "torch.Tensor":
    """Logits [B, T, V] of an HF causal LM (no cache; HF's own loss is not used: our labels are
    already shifted)."""
    return model(input_ids=input_ids, use_cache=False).logits


def model_summary(src: HFModelSource) -> Dict[str, Any]:
    """Dims that FLOPs and checks need: dim, n_layers, n_heads, vocab_size (None if absent)."""
    cfg = src.config.get_text_config() if hasattr(src.config, "get_text_config") else src.config
    return {"dim": getattr(cfg, "hidden_size", None), "n_layers": getattr(cfg, "num_hidden_layers", None),
            "n_heads": getattr(cfg, "num_attention_heads", None), "vocab_size": getattr(cfg, "vocab_size", None),
            "tie_embeddings": bool(getattr(cfg, "tie_word_embeddings", False))}
