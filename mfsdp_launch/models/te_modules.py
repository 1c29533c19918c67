"""Models built from Transformer Engine (TE 2.x) modules: the seed's ToyTETransformer and TEGPT.

Import-safe without TE: TE is imported by `te_module()` inside constructors and functions, only when a
te_* model is actually built. TE modules need CUDA; under `with torch.device("meta")` they are
built on the meta device (TE takes an explicit `device` argument, so we pass it on).

Layout: TEGPT runs its TransformerLayers batch-first (`attn_input_format="bshd"`), like `gpt`.
ToyTETransformer keeps the seed's TE default, seq-first `[s, b, h]`.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt_modules import Embedding, RMSNorm
from .llama_dims import GPTDims

INIT_STD = 0.02
TE_DEFAULT_INIT_STD = 0.023  # TE's get_default_init_method()


def te_import_error(model_name: str, exc: BaseException) -> RuntimeError:
    lines = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return RuntimeError(
        f"Transformer Engine is required for model={model_name} but could not be imported: {reason}"
    )


def te_module(model_name: str = "te_gpt"):
    """`transformer_engine.pytorch`, or a RuntimeError with a one-line reason.

    A half-installed TE (python package present, core library missing) raises RuntimeError or
    OSError rather than ImportError, so every exception is caught.
    """
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # noqa: BLE001 - see docstring
        raise te_import_error(model_name, exc) from exc
    return te


def te_device() -> str:
    """Device argument for TE modules: "meta" inside `with torch.device("meta")` (TE compares
    against the string), else "cuda" (TE's current CUDA device)."""
    return "meta" if torch.get_default_device().type == "meta" else "cuda"


class ToyTETransformer(torch.nn.Module):
    """Toy Transformer model for testing Megatron-FSDP with Transformer Engine."""

    def __init__(
        self,
        model_dim,
        num_heads,
        num_layers,
        output_dim,
        fuse_qkv_params=False,
        params_dtype=torch.float32,
        device="cuda",
    ):
        super().__init__()
        te = te_module("te_toy_transformer")
        self.layers = torch.nn.ModuleList(
            [
                te.TransformerLayer(
                    hidden_size=model_dim,
                    ffn_hidden_size=model_dim,
                    num_attention_heads=num_heads,
                    fuse_qkv_params=fuse_qkv_params,
                    params_dtype=params_dtype,
                    device=device,
                )
                for _ in range(num_layers)
            ]
        )
        self.fc_out = te.Linear(model_dim, output_dim, params_dtype=params_dtype, device=device)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        x = self.fc_out(x)
        return x


@functools.lru_cache(maxsize=None)
def rope_transformer_layer_class():
    """A te.pytorch.TransformerLayer subclass that builds its own RoPE table at forward.

    The table holds fp32 angles. Were the parent to pass it in as `rotary_pos_emb`, FSDP2's
    `cast_forward_inputs` would cast it to bf16 at the layer's boundary, wrecking positions past
    a few hundred. Built lazily (TE is optional); isinstance checks against TransformerLayer, the
    FSDP unit class, still match.
    """
    te = te_module()

    class RopeTransformerLayer(te.TransformerLayer):
        def __init__(self, *args, rope_dim: int, rope_theta: float, **kwargs):
            super().__init__(*args, **kwargs)
            self.rope_dim, self.rope_theta = rope_dim, rope_theta
            # A plain dict, not a submodule: the RoPE module's inv_freq buffer would otherwise
            # land in state dicts and be wiped by to_empty() after meta-device init.
            self._rope = {}

        def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
            rope = self._rope.get("module")
            if rope is None:
                rope = te.RotaryPositionEmbedding(self.rope_dim, rotary_base=self.rope_theta)
                self._rope["module"] = rope
            freqs = rope(hidden_states.shape[1])  # [s, 1, 1, head_dim] fp32; input is bshd
            return super().forward(hidden_states, rotary_pos_emb=freqs, **kwargs)

    return RopeTransformerLayer


class TEGPT(nn.Module):
    """The `gpt` architecture on TE modules: input_ids [B, T] -> logits [B, T, vocab].

    Each layer is a TE TransformerLayer with fused QKV, RMSNorm, SwiGLU, causal attention, GQA,
    RoPE and no biases or dropout, so it holds the same tensors as gpt's Block. The output head is
    a te.pytorch.Linear, or the embedding weight itself when tied. The final norm is gpt's torch
    RMSNorm (same parameter).
    """

    def __init__(self, dims: GPTDims, params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        te = te_module()
        self.dims = dims
        dtype = params_dtype or torch.get_default_dtype()
        device = te_device()
        init = functools.partial(nn.init.normal_, mean=0.0, std=INIT_STD)
        out_init = functools.partial(
            nn.init.normal_, mean=0.0, std=INIT_STD / math.sqrt(2 * dims.n_layers)
        )
        layer_cls = rope_transformer_layer_class()
        # N(0, 0.02) on construction and in reset_parameters (Megatron-FSDP's meta-device init).
        self.tok_emb = Embedding(dims.vocab_size, dims.dim, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            layer_cls(
                hidden_size=dims.dim,
                ffn_hidden_size=dims.ffn_dim,
                num_attention_heads=dims.n_heads,
                num_gqa_groups=dims.n_kv_heads,
                kv_channels=dims.head_dim,
                layernorm_epsilon=dims.norm_eps,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                init_method=init,
                output_layer_init_method=out_init,
                layer_number=i + 1,
                self_attn_mask_type="causal",
                fuse_qkv_params=True,
                bias=False,
                activation="swiglu",
                normalization="RMSNorm",
                attn_input_format="bshd",
                params_dtype=dtype,
                device=device,
                rope_dim=dims.head_dim,
                rope_theta=dims.rope_theta,
            )
            for i in range(dims.n_layers)
        )
        # The final norm is the plain torch RMSNorm (one fused kernel): TE's op-based RMSNorm
        # replaces its Parameter in reset_parameters(), which Megatron-FSDP's meta init and
        # parameter swapping do not need to deal with for a module outside every FSDP unit.
        self.norm = RMSNorm(dims.dim, dims.norm_eps, dtype=dtype, device=device)
        self.lm_head = None
        if not dims.tie_embeddings:
            self.lm_head = te.Linear(
                dims.dim, dims.vocab_size, bias=False, init_method=init,
                params_dtype=dtype, device=device,
            )
        # TE modules initialized themselves from init_method/output_layer_init_method above.

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.tok_emb.weight)

    def init_weights(self) -> None:
        init_te_model(self, std=INIT_STD, out_std=INIT_STD / math.sqrt(2 * self.dims.n_layers))


@torch.no_grad()
def init_te_model(model: nn.Module, std: float, out_std: float) -> None:
    """Re-initialize a TE model's parameters in place, module by module in a fixed order.

    1-D tensors: biases zeros, norm gains ones. Matrices: N(0, out_std) for the residual output
    projections (attention `proj.weight`, MLP `fc2_weight`), N(0, std) otherwise. In-place ops
    work on real, materialized-meta and DTensor parameters. FP8 primary weights (TE
    QuantizedTensor, from quantized_model_init) cannot be written in place; their module's own
    `reset_parameters()` re-quantizes them from its init_method. That replaces the Parameter
    objects, so call this before the optimizer is built.
    """
    te = te_module()
    for module_name, module in model.named_modules():
        quantized = False
        for name, param in module.named_parameters(recurse=False):
            local = getattr(param, "_local_tensor", param)  # DTensor -> local shard
            if isinstance(local, te.QuantizedTensor):
                quantized = True
            elif param.ndim == 1:
                (nn.init.zeros_ if "bias" in name else nn.init.ones_)(param)
            elif name == "fc2_weight" or (module_name.endswith("proj") and name == "weight"):
                nn.init.normal_(param, mean=0.0, std=out_std)
            else:
                nn.init.normal_(param, mean=0.0, std=std)
        if quantized:
            module.reset_parameters()
