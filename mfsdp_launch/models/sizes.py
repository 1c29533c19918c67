"""Model sizes, parameter counts, FLOPs and activation estimates, in pure Python.

This module must not import torch: the launcher's dry run uses it to describe a run (parameters,
FLOPs, memory) in milliseconds, before any process is spawned. `model_cfg` is anything with the
attributes of `mfsdp_launch.schema.ModelConfig` (the dataclass or an OmegaConf node).

Counts here are exact for every model name and are checked against the real modules in
tests/test_models.py (TE models are counted analytically from TE 2.x's TransformerLayer layout).

Presets (exact counts from `param_count`, vocab 32000 untied unless noted):

| preset | dim  | layers | heads (kv) | ffn   | vocab  | tied | params        |
|--------|------|--------|------------|-------|--------|------|---------------|
| tiny   | 64   | 2      | 4          | 192   | 256    | no   | 139,584       |
| small  | 384  | 8      | 6          | 1024  | 8192   | no   | 20,453,760    |
| 125m   | 768  | 12     | 12         | 2048  | 32000  | no   | 134,105,856   |
| 350m   | 1024 | 24     | 16         | 2816  | 32000  | no   | 373,867,520   |
| 760m   | 1536 | 24     | 16         | 4096  | 32000  | no   | 777,856,512   |
| 1.4b   | 2048 | 24     | 16         | 5632  | 32000  | no   | 1,364,297,728 |
| 2b     | 4096 | 8      | 32         | 11008 | 32000  | no   | 1,881,214,976 |
| 3b     | 3072 | 28     | 24 (8)     | 8192  | 128256 | yes  | 3,212,749,824 |
| 8b     | 4096 | 32     | 32 (8)     | 14336 | 128256 | no   | 8,030,261,248 |

`3b` is Llama-3.2-3B-like and `8b` Llama-3.1-8B-like (their rope_theta is 500000; ours comes from
`model.rope_theta`, default 10000).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

GPT_MODELS = ("gpt", "te_gpt")
TOY_MODELS = ("toy_cnn", "toy_transformer", "te_toy_transformer")

# Only the fields a preset pins; the rest come from ModelConfig or the derivation rules below.
GPT_PRESETS: Dict[str, Dict[str, Any]] = {
    # Trains in seconds on a CPU: byte-level vocab, two small layers.
    "tiny": dict(dim=64, n_layers=2, n_heads=4, vocab_size=256, tie_embeddings=False),
    "small": dict(dim=384, n_layers=8, n_heads=6, vocab_size=8192, tie_embeddings=False),
    "125m": dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, tie_embeddings=False),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, vocab_size=32000, tie_embeddings=False),
    "760m": dict(dim=1536, n_layers=24, n_heads=16, vocab_size=32000, tie_embeddings=False),
    # The "GPT d=2048, 24 layers" of our benchmarks.
    "1.4b": dict(dim=2048, n_layers=24, n_heads=16, vocab_size=32000, tie_embeddings=False),
    # Wide and shallow: big GEMMs, the TE benchmark shape.
    "2b": dict(dim=4096, n_layers=8, n_heads=32, vocab_size=32000, tie_embeddings=False),
    "3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
               vocab_size=128256, tie_embeddings=True),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               vocab_size=128256, tie_embeddings=False),
}

# Toy models follow the seed test (DIM_SIZE=2, NUM_LAYERS=2, num_heads=2); the TE toy defaults to
# the seed's quantized test (model_dim=64), since FP8 GEMMs need dims divisible by 16.
TOY_DEFAULT_DIM = {"toy_cnn": 2, "toy_transformer": 2, "te_toy_transformer": 64}
TOY_CNN_CHANNELS = 3
TOY_CNN_KERNEL = 3
TORCH_TRANSFORMER_FFN = 2048  # torch.nn.Transformer's default dim_feedforward


@dataclass(frozen=True)
class GPTDims:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool
    norm_eps: float
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class ToyDims:
    dim: int
    n_layers: int
    n_heads: int
    output_dim: int


def llama_ffn_dim(dim: int) -> int:
    """LLaMA's SwiGLU hidden size: 2/3 of 4*dim, rounded up to 256 (64 below dim 1024)."""
    multiple = 256 if dim >= 1024 else 64
    return _round_up(int(8 * dim / 3), multiple)


def _round_up(x: int, multiple: int) -> int:
    return multiple * math.ceil(x / multiple)


def resolve_gpt_dims(model_cfg: Any) -> GPTDims:
    """Preset values overridden by the non-null ModelConfig fields, then validated.

    An explicit preset ffn_dim (3b, 8b) only applies while `dim` is the preset's; otherwise the
    LLaMA rule derives it from the dim in use. n_kv_heads defaults to n_heads (plain MHA).
    """
    preset_name = str(model_cfg.preset)
    if preset_name not in GPT_PRESETS:
        raise ValueError(
            f"model.preset={preset_name!r} is unknown; allowed: {', '.join(GPT_PRESETS)}"
        )
    preset = GPT_PRESETS[preset_name]

    def pick(field: str) -> Any:
        value = getattr(model_cfg, field, None)
        return preset.get(field) if value is None else value

    dim = int(pick("dim"))
    n_heads = int(pick("n_heads"))
    n_kv_heads = getattr(model_cfg, "n_kv_heads", None)
    if n_kv_heads is None:
        n_kv_heads = preset.get("n_kv_heads", n_heads)
        # A preset's kv heads (8) that no longer divide overridden heads fall back to MHA.
        if n_heads % n_kv_heads:
            n_kv_heads = n_heads
    ffn_dim = getattr(model_cfg, "ffn_dim", None)
    if ffn_dim is None:
        ffn_dim = preset["ffn_dim"] if "ffn_dim" in preset and dim == preset["dim"] else llama_ffn_dim(dim)
    dims = GPTDims(
        dim=dim,
        n_layers=int(pick("n_layers")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv_heads),
        ffn_dim=int(ffn_dim),
        vocab_size=int(pick("vocab_size")),
        tie_embeddings=bool(pick("tie_embeddings")),
        norm_eps=float(getattr(model_cfg, "norm_eps", 1e-5)),
        rope_theta=float(getattr(model_cfg, "rope_theta", 10000.0)),
    )
    validate_gpt_dims(dims)
    return dims


def validate_gpt_dims(d: GPTDims) -> None:
    """Raise ValueError naming the offending key first ("model.KEY=..."), for the validator."""
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(d, field) <= 0:
            raise ValueError(f"model.{field}={getattr(d, field)} must be positive")
    if d.dim % d.n_heads:
        raise ValueError(f"model.dim={d.dim} is not divisible by model.n_heads={d.n_heads}")
    if d.n_heads % d.n_kv_heads:
        raise ValueError(
            f"model.n_heads={d.n_heads} is not divisible by model.n_kv_heads={d.n_kv_heads}"
        )
    if d.head_dim % 2:
        raise ValueError(
            f"model.dim={d.dim} gives head_dim={d.head_dim} (dim/n_heads), which must be even for RoPE"
        )


def resolve_toy_dims(model_cfg: Any) -> ToyDims:
    """Toy model dims: the seed's defaults where ModelConfig leaves a field null."""
    name = str(model_cfg.name)
    if name not in TOY_MODELS:
        raise ValueError(f"{name!r} is not a toy model; toy models: {', '.join(TOY_MODELS)}")
    dim = model_cfg.dim if model_cfg.dim is not None else TOY_DEFAULT_DIM[name]
    n_heads = model_cfg.n_heads if model_cfg.n_heads is not None else 2
    dims = ToyDims(
        dim=int(dim),
        n_layers=int(model_cfg.n_layers if model_cfg.n_layers is not None else 2),
        n_heads=int(n_heads),
        output_dim=int(model_cfg.output_dim if model_cfg.output_dim is not None else dim),
    )
    if name != "toy_cnn" and dims.dim % dims.n_heads:
        raise ValueError(f"model.dim={dims.dim} is not divisible by model.n_heads={dims.n_heads}")
    if min(dims.dim, dims.n_layers, dims.n_heads, dims.output_dim) <= 0:
        raise ValueError(f"model dims must be positive, got {dims}")
    return dims


# ---------------------------------------------------------------------------------------------
# Parameter counts


def _gpt_layer_params(d: GPTDims) -> int:
    attn = d.dim * (d.dim + 2 * d.kv_dim) + d.dim * d.dim  # fused qkv + output projection
    mlp = 3 * d.dim * d.ffn_dim  # SwiGLU: gate, up, down
    norms = 2 * d.dim
    return attn + mlp + norms


def _gpt_params(d: GPTDims) -> int:
    embed = d.vocab_size * d.dim
    head = 0 if d.tie_embeddings else d.vocab_size * d.dim
    return embed + d.n_layers * _gpt_layer_params(d) + d.dim + head


def _torch_transformer_params(d: int, n_layers: int) -> int:
    """torch.nn.Transformer(d_model=d, num_encoder_layers=num_decoder_layers=n_layers)."""
    ffn = TORCH_TRANSFORMER_FFN
    mha = 4 * d * d + 4 * d  # in_proj (3d x d + 3d) and out_proj (d x d + d)
    ffn_params = 2 * d * ffn + ffn + d
    encoder_layer = mha + ffn_params + 2 * 2 * d  # two LayerNorms
    decoder_layer = 2 * mha + ffn_params + 3 * 2 * d  # self + cross attention, three LayerNorms
    final_norms = 2 * 2 * d  # encoder.norm and decoder.norm
    return n_layers * (encoder_layer + decoder_layer) + final_norms


def _te_toy_layer_params(d: int) -> int:
    """te.pytorch.TransformerLayer(hidden=d, ffn_hidden=d) with its defaults: LayerNorm, gelu,
    bias=True. qkv: LN(2d) + 3d*d + 3d; proj: d*d + d; mlp: LN(2d) + (d*d + d) + (d*d + d)."""
    return 6 * d * d + 10 * d


def param_count(model_cfg: Any) -> int:
    """Exact parameter count (tied weights counted once)."""
    name = str(model_cfg.name)
    if name in GPT_MODELS:
        # te_gpt's TransformerLayer (RMSNorm, swiglu, bias=False) holds exactly the gpt Block's
        # tensors: qkv LN weight + fused qkv, proj, MLP LN weight, fc1 (2*ffn rows), fc2.
        return _gpt_params(resolve_gpt_dims(model_cfg))
    t = resolve_toy_dims(model_cfg)
    if name == "toy_cnn":
        c, k = TOY_CNN_CHANNELS, TOY_CNN_KERNEL
        return t.n_layers * (c * c * k * k + c) + (c + 1)
    if name == "toy_transformer":
        return _torch_transformer_params(t.dim, t.n_layers) + t.dim * t.output_dim + t.output_dim
    if name == "te_toy_transformer":
        return t.n_layers * _te_toy_layer_params(t.dim) + t.dim * t.output_dim + t.output_dim
    raise ValueError(f"unknown model.name {name!r}")


def largest_unit_params(model_cfg: Any) -> int:
    """Parameters of the largest FSDP unit under the factory's default unit modules, i.e. the
    most that one all-gather materializes. The root counts as a unit holding everything outside
    the units (gpt: embedding, final norm and head, gathered for the whole forward).

    With `model.fsdp_unit_modules` overridden the units are unknown here, so this returns the
    whole model: a conservative upper bound.
    """
    if getattr(model_cfg, "fsdp_unit_modules", None):
        return param_count(model_cfg)
    name = str(model_cfg.name)
    if name in GPT_MODELS:
        d = resolve_gpt_dims(model_cfg)
        embed = d.vocab_size * d.dim
        head = 0 if d.tie_embeddings else d.vocab_size * d.dim
        layer = _gpt_layer_params(d)
        if name == "te_gpt":  # the te.Linear head is a unit of its own
            return max(layer, embed + d.dim, head)
        return max(layer, embed + d.dim + head)
    t = resolve_toy_dims(model_cfg)
    head = t.dim * t.output_dim + t.output_dim
    if name == "toy_cnn":  # units: each Conv2d and the dense Linear
        c, k = TOY_CNN_CHANNELS, TOY_CNN_KERNEL
        return max(c * c * k * k + c, c + 1)
    if name == "toy_transformer":  # units: the nn.Transformer; root: fc_out
        return max(_torch_transformer_params(t.dim, t.n_layers), head)
    return max(_te_toy_layer_params(t.dim), head)  # TransformerLayer, te.Linear fc_out


# ---------------------------------------------------------------------------------------------
# FLOPs


def matmul_params(model_cfg: Any) -> int:
    """Parameters that take part in a matmul per token: every linear weight including the output
    head (also when tied), excluding the input embedding (a lookup), norms and biases."""
    name = str(model_cfg.name)
    if name in GPT_MODELS:
        d = resolve_gpt_dims(model_cfg)
        per_layer = _gpt_layer_params(d) - 2 * d.dim
        return d.n_layers * per_layer + d.vocab_size * d.dim
    t = resolve_toy_dims(model_cfg)
    if name == "toy_cnn":
        c, k = TOY_CNN_CHANNELS, TOY_CNN_KERNEL
        return t.n_layers * c * c * k * k + c
    if name == "toy_transformer":
        d, ffn = t.dim, TORCH_TRANSFORMER_FFN
        enc = 4 * d * d + 2 * d * ffn
        dec = 8 * d * d + 2 * d * ffn
        return t.n_layers * (enc + dec) + d * t.output_dim
    if name == "te_toy_transformer":
        return t.n_layers * 6 * t.dim * t.dim + t.dim * t.output_dim
    raise ValueError(f"unknown model.name {name!r}")


def flops_per_token(model_cfg: Any, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, or per sample for the toy models.

    LMs: 6 * N_matmul + 12 * n_layers * dim * seq_len (the PaLM appendix B / torchtitan
    convention). The attention term counts the full seq_len x seq_len score and value matmuls,
    i.e. it does NOT halve for the causal mask (which a causal flash kernel skips), so MFU is
    comparable with torchtitan and PaLM numbers; an exact causal count would use 6 instead of 12.
    Activation recomputation is not counted.

    Toys (`tokens_per_sample` is 1, so this is per sample): 6 * N_matmul times the number of
    positions each weight is applied to (H*W pixels for the CNN, counting "same"-padded borders as
    full; `dim` token vectors for the nn.Transformer, whose seed input is seq 1 x batch dim). The
    toys' attention terms are left out: seq 1 for nn.Transformer, and for the TE toy the sequence
    is the micro-batch size, unknown here; so the TE toy figure is a lower bound.
    """
    name = str(model_cfg.name)
    n_matmul = matmul_params(model_cfg)
    if name in GPT_MODELS:
        d = resolve_gpt_dims(model_cfg)
        return float(6 * n_matmul + 12 * d.n_layers * d.dim * seq_len)
    t = resolve_toy_dims(model_cfg)
    if name == "toy_cnn":
        return float(6 * n_matmul * t.dim * t.dim)  # height = width = dim
    return float(6 * n_matmul * t.dim)  # dim token vectors per sample


# ---------------------------------------------------------------------------------------------
# Activations


def activation_bytes(
    model_cfg: Any,
    micro_batch_size: int,
    seq_len: int,
    bytes_per_el: int,
    activation_checkpointing: Optional[bool] = None,
) -> int:
    """Rough bytes of activations saved for backward by one rank for one micro-batch.

    LMs, per token and layer, counting the tensors autograd keeps (flash attention, no dropout):
      attention: norm input d, norm output d, q/k/v d + 2*kv_dim, attention output d  -> 4d + 2kv
      SwiGLU MLP: norm input d, norm output d, gate f, up f, silu(gate)*up f          -> 2d + 3f
    plus the embedding output (d), the final norm (2d) and the logits: V elements in the compute
    dtype plus their fp32 copy for the loss (4 bytes). With activation checkpointing of each
    Block only the block inputs (d per layer) stay, plus one block's full set during its recompute.
    Softmax statistics, RoPE tables and allocator slack are ignored: take this as a lower bound.

    Toys: the same idea with their own layer shapes; these are tiny and only need to be sane.
    `activation_checkpointing` defaults to `model_cfg.activation_checkpointing`.
    """
    if activation_checkpointing is None:
        activation_checkpointing = bool(getattr(model_cfg, "activation_checkpointing", False))
    name = str(model_cfg.name)
    if name in GPT_MODELS:
        d = resolve_gpt_dims(model_cfg)
        tokens = micro_batch_size * seq_len
        per_layer = 6 * d.dim + 2 * d.kv_dim + 3 * d.ffn_dim
        if activation_checkpointing:
            layers = d.n_layers * d.dim + per_layer
        else:
            layers = d.n_layers * per_layer
        elements = tokens * (layers + 3 * d.dim)
        logits = tokens * d.vocab_size * (bytes_per_el + 4)
        return int(elements * bytes_per_el + logits)
    t = resolve_toy_dims(model_cfg)
    if name == "toy_cnn":
        # Seed input broadcast to (1, 3, dim, dim): each conv and the dense head keep one map.
        return (t.n_layers + 2) * TOY_CNN_CHANNELS * t.dim * t.dim * bytes_per_el
    if name == "toy_transformer":
        tokens = t.dim  # seq 1 x batch dim
        per_layer = 2 * TORCH_TRANSFORMER_FFN + 12 * t.dim  # FFN hidden (pre/post ReLU) dominates
        return tokens * 3 * t.n_layers * per_layer * bytes_per_el  # encoder + 2x decoder blocks
    # te_toy_transformer: input (micro_batch_size, dim, dim) in [s, b, h]: mbs * dim tokens.
    tokens = micro_batch_size * t.dim
    return tokens * t.n_layers * 16 * t.dim * bytes_per_el


def describe(model_cfg: Any, seq_len: int) -> str:
    """One line for logs and the dry run."""
    name = str(model_cfg.name)
    n = param_count(model_cfg)
    if name in GPT_MODELS:
        d = resolve_gpt_dims(model_cfg)
        shape = (
            f"preset={model_cfg.preset} dim={d.dim} layers={d.n_layers} heads={d.n_heads}"
            f" kv_heads={d.n_kv_heads} ffn={d.ffn_dim} vocab={d.vocab_size}"
            f" tied={d.tie_embeddings}"
        )
    else:
        t = resolve_toy_dims(model_cfg)
        shape = f"dim={t.dim} layers={t.n_layers} heads={t.n_heads} out={t.output_dim}"
    return f"{name} {shape} params={n:,} flops/token={flops_per_token(model_cfg, seq_len):.3e}"
