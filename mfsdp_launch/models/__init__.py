"""Model factory: `build_model_spec(model_cfg, seq_len)` returns a `ModelSpec`, everything the
engines and the training loop need to know about a model, with nothing distributed applied.

This package's import stays torch-free (torch is imported inside `build_model_spec`), because
importing `mfsdp_launch.models.sizes` runs this file first and the dry run must not pay for torch.
Transformer Engine is imported only when a te_* model is requested.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .sizes import (
    GPT_PRESETS,
    GPTDims,
    flops_per_token,
    param_count,
    resolve_gpt_dims,
    resolve_toy_dims,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

MODEL_NAMES = ("gpt", "toy_cnn", "toy_transformer", "te_toy_transformer", "te_gpt")

__all__ = [
    "GPT_PRESETS",
    "GPTDims",
    "MODEL_NAMES",
    "ModelSpec",
    "build_model_spec",
    "parse_dtype",
    "resolve_gpt_dims",
    "resolve_unit_modules",
]


@dataclass
class ModelSpec:
    name: str
    # Constructs the model on the CURRENT default device: callers wrap it in
    # `with torch.device("meta")` for meta init, or `torch.device("cuda")`.
    build: Callable[[], "nn.Module"]
    # FSDP unit module classes (model_cfg.fsdp_unit_modules overrides them).
    unit_modules: tuple
    # Runs forward on a batch dict and returns the scalar loss.
    loss: Callable[["nn.Module", dict], "torch.Tensor"]
    # Re-inits the params of a (possibly wrapped/sharded, DTensor) model in place; used after
    # meta-device init + to_empty(). Call it before building the optimizer (TE FP8 params are
    # re-created, not written in place).
    init_weights: Callable[["nn.Module"], None]
    # True: batches are {"input_ids": Long[B, T], "labels": Long[B, T]} (labels = next tokens).
    uses_tokens: bool
    # Toys: (generator, micro_batch_size, device) -> {"x": ..., "y": ...}; None for LMs.
    synthetic_batch: Optional[Callable[["torch.Generator", int, "torch.device"], dict]]
    tokens_per_sample: int  # seq_len for LMs, 1 for toys
    num_params: int  # sizes.param_count
    flops_per_token: float  # sizes.flops_per_token (per sample for toys)
    needs_te: bool
    # False for gpt/te_gpt for now; True for toys (seed semantics: the mesh dims are built and
    # every rank of a TP/CP group sees the same batch).
    supports_tp_cp: bool
    dtype_input: Optional["torch.dtype"] = None  # toys' input dtype (TE toy: params dtype)


def parse_dtype(name: Optional[str]) -> Optional["torch.dtype"]:
    """Config dtype name -> torch dtype (one mapping, in precision.py); None stays None."""
    from ..precision import torch_dtype

    return torch_dtype(name)


def resolve_unit_modules(names: Sequence[str]) -> tuple:
    """Dotted class names ("torch.nn.Linear", "transformer_engine.pytorch.TransformerLayer")
    -> classes. The longest importable module prefix is imported and the rest read as attributes.
    Raises ValueError naming the bad entry."""
    import torch.nn as nn

    classes = []
    for name in names:
        name = str(name)
        parts = name.split(".")
        obj: Any = None
        error = "no importable module prefix"
        for cut in range(len(parts) - 1, 0, -1):
            module_name = ".".join(parts[:cut])
            try:
                obj = importlib.import_module(module_name)
            except ImportError:
                continue
            except Exception as exc:  # noqa: BLE001 - a broken package (e.g. half-installed TE)
                error = f"importing {module_name} failed: {type(exc).__name__}: {exc}"
                obj = None
                break
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                error = f"{module_name} has no attribute {'.'.join(parts[cut:])!r}"
                obj = None
            break
        if obj is None:
            raise ValueError(f"model.fsdp_unit_modules: cannot resolve {name!r} ({error})")
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            raise ValueError(f"model.fsdp_unit_modules: {name!r} is not an nn.Module class")
        classes.append(obj)
    return tuple(classes)


def _find(model: "nn.Module", cls: type) -> "nn.Module":
    """The `cls` instance inside a possibly wrapped model (FSDP, Megatron-FSDP, torch.compile)."""
    for module in model.modules():
        if isinstance(module, cls):
            return module
    raise TypeError(f"no {cls.__name__} inside {type(model).__name__}")


def build_model_spec(model_cfg: Any, seq_len: int) -> ModelSpec:
    """Dispatch on model_cfg.name: gpt | toy_cnn | toy_transformer | te_toy_transformer | te_gpt."""
    name = str(model_cfg.name)
    if name in ("gpt", "te_gpt"):
        spec = _lm_spec(model_cfg, seq_len)
    elif name in ("toy_cnn", "toy_transformer"):
        spec = _toy_spec(model_cfg)
    elif name == "te_toy_transformer":
        spec = _te_toy_spec(model_cfg)
    else:
        raise ValueError(f"unknown model.name {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    if model_cfg.fsdp_unit_modules:
        spec.unit_modules = resolve_unit_modules(model_cfg.fsdp_unit_modules)
    return spec


def _lm_loss(model: "nn.Module", batch: dict) -> "torch.Tensor":
    """Mean next-token cross-entropy over all tokens, computed in fp32."""
    import torch.nn.functional as F

    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())


def _lm_spec(model_cfg: Any, seq_len: int) -> ModelSpec:
    name = str(model_cfg.name)
    dims = resolve_gpt_dims(model_cfg)
    dtype = parse_dtype(model_cfg.params_dtype)
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    common = dict(
        name=name,
        loss=_lm_loss,
        uses_tokens=True,
        synthetic_batch=None,
        tokens_per_sample=seq_len,
        num_params=param_count(model_cfg),
        flops_per_token=flops_per_token(model_cfg, seq_len),
        supports_tp_cp=False,
    )
    if name == "gpt":
        from .gpt import GPT, Block

        return ModelSpec(
            build=lambda: GPT(dims, dtype=dtype),
            unit_modules=(Block,),
            init_weights=lambda model: _find(model, GPT).init_weights(),
            needs_te=False,
            **common,
        )
    from . import te_models

    te = te_models._te(name)
    return ModelSpec(
        build=lambda: te_models.TEGPT(dims, params_dtype=dtype),
        # The head (te.Linear) is its own unit, as in the seed's TE test; nested te.Linear
        # layers inside a TransformerLayer belong to that layer's unit.
        unit_modules=(te.TransformerLayer, te.Linear),
        init_weights=lambda model: _find(model, te_models.TEGPT).init_weights(),
        needs_te=True,
        **common,
    )


def _toy_spec(model_cfg: Any) -> ModelSpec:
    from . import toy

    name = str(model_cfg.name)
    dims = resolve_toy_dims(model_cfg)
    dtype = parse_dtype(model_cfg.params_dtype)
    cls = toy.ToyCNN if name == "toy_cnn" else toy.ToyTransformer

    def build():
        model = toy.build_toy(name, dims)
        return model.to(dtype) if dtype is not None else model

    return ModelSpec(
        name=name,
        build=build,
        unit_modules=toy.TOY_UNIT_MODULES[name],
        loss=toy.toy_loss(two_inputs=name == "toy_transformer"),
        init_weights=lambda model: toy.reset_module_parameters(_find(model, cls)),
        uses_tokens=False,
        # The seed's shape is fixed at (1, dim, dim): micro_batch_size is ignored (the CNN
        # broadcasts its input to batch 1; nn.Transformer reads it as seq 1 x batch dim).
        synthetic_batch=lambda gen, mbs, device: toy.toy_batch(gen, (1, dims.dim, dims.dim), device, dtype),
        tokens_per_sample=1,
        num_params=param_count(model_cfg),
        flops_per_token=flops_per_token(model_cfg, 1),
        needs_te=False,
        supports_tp_cp=True,
        dtype_input=dtype,
    )


def _te_toy_spec(model_cfg: Any) -> ModelSpec:
    import torch

    from . import te_models, toy

    name = str(model_cfg.name)
    te = te_models._te(name)
    dims = resolve_toy_dims(model_cfg)
    dtype = parse_dtype(model_cfg.params_dtype) or torch.float32  # the seed's default

    def build():
        return te_models.ToyTETransformer(
            model_dim=dims.dim,
            num_heads=dims.n_heads,
            num_layers=dims.n_layers,
            output_dim=dims.output_dim,
            fuse_qkv_params=bool(model_cfg.fuse_qkv),
            params_dtype=dtype,
            device=te_models.te_device(),
        )

    return ModelSpec(
        name=name,
        build=build,
        unit_modules=(te.TransformerLayer, te.Linear),  # as in the seed's quantized TE test
        loss=toy.toy_loss(two_inputs=False),
        # TE's default init (N(0, 0.023), norms ones, biases zeros), as the constructor does.
        init_weights=lambda model: te_models.init_te_model(
            _find(model, te_models.ToyTETransformer),
            std=te_models.TE_DEFAULT_INIT_STD,
            out_std=te_models.TE_DEFAULT_INIT_STD,
        ),
        uses_tokens=False,
        # Seed: randn(16, 64, 64) in params dtype, [s, b, h] with s = micro_batch_size.
        synthetic_batch=lambda gen, mbs, device: toy.toy_batch(gen, (mbs, dims.dim, dims.dim), device, dtype),
        tokens_per_sample=1,
        num_params=param_count(model_cfg),
        flops_per_token=flops_per_token(model_cfg, 1),
        needs_te=True,
        supports_tp_cp=True,
        dtype_input=dtype,
    )
