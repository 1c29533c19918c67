"""The LLaMA-style architecture shared by `gpt` and `te_gpt`: presets, dimensions, exact parameter
counts, FLOPs and activation bytes, in pure Python (the dry run and validation use it without
torch). Counts are checked against the real modules in tests/unit/models/test_models.py.

Presets (exact counts from `param_count`, vocab 32000 untied unless noted):

| preset | dim  | layers | heads (kv) | ffn   | vocab  | tied | params        |
|--------|------|--------|------------|-------|--------|------|---------------|
| tiny   | 64   | 2      | 4          | 192   | 256    | no   | 139,584       |
| small  | 384  | 8      | 6          | 1024  | 8192   | no   | 20,453,760    |
| 125m   | 768  | 12     | 12         | 2048  | 32000  | no   | 134,105,856   |
| 350m   | 1024 | 24     | 16         | 2816  | 32000  | no   | 373,867,520   |
| 760m   | 1536 | 24     | 16         | 4096  | 32000  | no   | 777,856,512   |
| 1.2b   | 2048 | 16     | 32 (8)     | 8192  | 128256 | yes  | 1,235,814,400 |
| 1.4b   | 2048 | 24     | 16         | 5632  | 32000  | no   | 1,364,297,728 |
| 2b     | 4096 | 8      | 32         | 11008 | 32000  | no   | 1,881,214,976 |
| 3b     | 3072 | 28     | 24 (8)     | 8192  | 128256 | yes  | 3,212,749,824 |
| 8b     | 4096 | 32     | 32 (8)     | 14336 | 128256 | no   | 8,030,261,248 |

`1.2b` has Llama-3.2-1B's tensors, `3b` is Llama-3.2-3B-like and `8b` Llama-3.1-8B-like (their rope_theta is 500000; ours comes from
`model.rope_theta`, default 10000; their Llama-3 RoPE scaling from `model.rope_scaling`, default none).

Mixture-of-experts presets (models/llama/moe_dims.py; "active" counts the router, top_k experts and
the shared expert of each MoE layer, as FLOPs/token and MFU do):

| preset           | dim  | layers | heads (kv), head_dim | experts, top_k, shared | expert ffn | vocab  | params (active)        |
|------------------|------|--------|----------------------|------------------------|------------|--------|------------------------|
| tiny_moe         | 64   | 2      | 4                    | 4, 2, 0                | 96         | 256    | 213,824 (140,096)      |
| qwen3-30b-a3b    | 2048 | 48     | 32 (4), 128, qk-norm | 128, 8, 0              | 768        | 151936 | 30,532,122,624 (3.35B) |
| deepseek-v2-lite | 2048 | 27     | 16 (16)              | 64, 6, 2               | 1408       | 102400 | 16,291,706,880 (2.74B) |

`qwen3-30b-a3b` has Qwen3-30B-A3B's tensors exactly (its rope_theta 1e6 and norm eps 1e-6 are
model.rope_theta / model.norm_eps). `deepseek-v2-lite` takes DeepSeek-V2-Lite's sizes with our
grouped-query attention instead of its multi-head latent attention, and its first layer is MoE
too; slices that fit one GPU override model.n_layers.
"""


from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ...core.errors import ConfigError
from .moe_dims import MoEDims, resolve_moe

# Only the fields a preset pins; the rest come from ModelConfig or the derivation rules below.
GPT_PRESETS: Dict[str, Dict[str, Any]] = {
    # Trains in seconds on a CPU: byte-level vocab, two small layers.
    "tiny": dict(dim=64, n_layers=2, n_heads=4, vocab_size=256, tie_embeddings=False),
    "small": dict(dim=384, n_layers=8, n_heads=6, vocab_size=8192, tie_embeddings=False),
    "125m": dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, tie_embeddings=False),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, vocab_size=32000, tie_embeddings=False),
    "760m": dict(dim=1536, n_layers=24, n_heads=16, vocab_size=32000, tie_embeddings=False),
    # Llama-3.2-1B's tensors (the packed-SFT benchmark's model, bench/matrix.yaml sft_packed).
    "1.2b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                 vocab_size=128256, tie_embeddings=True),
    # The "GPT d=2048, 24 layers" of our benchmarks.
    "1.4b": dict(dim=2048, n_layers=24, n_heads=16, vocab_size=32000, tie_embeddings=False),
    # Wide and shallow: big GEMMs, the TE benchmark shape.
    "2b": dict(dim=4096, n_layers=8, n_heads=32, vocab_size=32000, tie_embeddings=False),
    "3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192,
               vocab_size=128256, tie_embeddings=True),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               vocab_size=128256, tie_embeddings=False),
    # Mixtures of experts (model.moe.* overrides the `moe` entry).
    "tiny_moe": dict(dim=64, n_layers=2, n_heads=4, vocab_size=256, tie_embeddings=False,
                     moe=dict(experts=4, top_k=2, ffn_dim=96)),
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, qk_norm=True,
                          ffn_dim=6144, vocab_size=151936, tie_embeddings=False,
                          moe=dict(experts=128, top_k=8, ffn_dim=768)),
    "deepseek-v2-lite": dict(dim=2048, n_layers=27, n_heads=16, ffn_dim=10944, vocab_size=102400,
                             tie_embeddings=False, moe=dict(experts=64, top_k=6, shared_experts=2, ffn_dim=1408)),
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3's frequency-dependent RoPE scaling (HF rope_type "llama3"; Llama-3.1/3.2): past
    `original_max_position_embeddings`, long wavelengths are slowed by `factor`, short ones kept,
    the band between blended (gpt_modules.rope_inv_freq has the rule). Shapes do not change."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    rope_type = "llama3"  # (a class attribute: the one type there is)

    def to_config(self) -> Dict[str, Any]:
        """As `model.rope_scaling` and HF's `rope_scaling` write it."""
        return {"rope_type": self.rope_type, **{k: getattr(self, k) for k in ROPE_SCALING_FIELDS}}

    def describe(self) -> str:
        return f"{self.rope_type}(" + ", ".join(f"{k}={getattr(self, k)}" for k in ROPE_SCALING_FIELDS) + ")"


ROPE_TYPES = ("default", "llama3")
ROPE_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_SCALING_SHAPE = "null, or {rope_type: llama3, " + ", ".join(ROPE_SCALING_FIELDS) + "}"


def resolve_rope_scaling(value: Any, *, key: str = "model.rope_scaling", label: str = "",
                         ignored: tuple = (), original_default: Optional[int] = None,
                         untyped_is_default: bool = False) -> Optional[RopeScaling]:
    """RopeScaling of a `model.rope_scaling` mapping (or HF's: `label` names it in the message,
    `ignored` its keys read elsewhere, `original_default` transformers' fallback for the old
    context, `untyped_is_default` its reading of a mapping without a type); None for null /
    rope_type default. Anything else is a ConfigError under `key`, the one rope-type rule."""
    if value is None:
        return None
    if not hasattr(value, "keys"):
        raise ConfigError(key, f"{label}must be a mapping, got {value!r}", ROPE_SCALING_SHAPE)
    raw = {str(k): value[k] for k in value.keys()}
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type == "default" or (rope_type is None and untyped_is_default):
        return None
    if rope_type != "llama3":
        what = "has no rope_type" if rope_type is None else f"rope type {rope_type!r} is not supported by gpt/te_gpt"
        raise ConfigError(key, label + what, ", ".join(ROPE_TYPES))
    unknown = sorted(set(raw) - {"rope_type", "type", *ROPE_SCALING_FIELDS, *ignored})
    if unknown:
        raise ConfigError(key, f"{label}unknown key(s) {', '.join(unknown)} for rope type 'llama3'", ROPE_SCALING_SHAPE)
    if raw.get("original_max_position_embeddings") is None and original_default is not None:
        raw["original_max_position_embeddings"] = original_default
    missing = [f for f in ROPE_SCALING_FIELDS if raw.get(f) is None]
    if missing:
        raise ConfigError(key, f"{label}rope type 'llama3' needs {', '.join(missing)}", ROPE_SCALING_SHAPE)
    numbers = {f: _number(raw[f], key, label + f) for f in ROPE_SCALING_FIELDS}
    for f in ("factor", "low_freq_factor", "original_max_position_embeddings"):
        if numbers[f] <= 0:  # divisors of the rule (old context / low_freq_factor, inv_freq / factor)
            raise ConfigError(key, f"{label}{f} must be > 0, got {raw[f]}", "a number > 0")
    if numbers["high_freq_factor"] <= numbers["low_freq_factor"]:  # the blend divides by their difference
        raise ConfigError(key, f"{label}high_freq_factor={raw['high_freq_factor']} must exceed low_freq_factor="
                          f"{raw['low_freq_factor']}", f"a number > {raw['low_freq_factor']}")
    old = numbers["original_max_position_embeddings"]
    if old != int(old):
        raise ConfigError(key, f"{label}original_max_position_embeddings must be a whole number, got {old}",
                          "an integer > 0")
    return RopeScaling(factor=numbers["factor"], low_freq_factor=numbers["low_freq_factor"],
                       high_freq_factor=numbers["high_freq_factor"], original_max_position_embeddings=int(old))


def _number(value: Any, key: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(key, f"{what} must be a finite number, got {value!r}", "a number")
    return float(value)


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
    head_size: int = 0  # model.head_dim; 0: dim // n_heads
    qk_norm: bool = False  # RMSNorm over each q and k head (Qwen3)
    moe: Optional[MoEDims] = None  # mixture-of-experts MLPs (models/llama/moe_dims.py); None: dense
    # Llama-3 RoPE scaling; None: plain RoPE. Not in shape(): the tensors are the same either way.
    rope_scaling: Optional[RopeScaling] = None

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(i)

    def shape(self) -> dict:
        """The fields that decide the saved tensors' shapes (recorded in checkpoint manifests);
        the MoE and attention variants only when in use, so dense manifests stay as they were."""
        out = {k: getattr(self, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                             "vocab_size", "tie_embeddings")}
        if self.head_size and self.head_size != self.dim // self.n_heads:
            out["head_dim"] = self.head_size
        if self.qk_norm:
            out["qk_norm"] = True
        if self.moe is not None:
            out["moe"] = self.moe.shape()
        return out


def llama_ffn_dim(dim: int) -> int:
    """LLaMA's SwiGLU hidden size: 2/3 of 4*dim, rounded up to 256 (64 below dim 1024)."""
    multiple = 256 if dim >= 1024 else 64
    return multiple * math.ceil(int(8 * dim / 3) / multiple)


def resolve_gpt_dims(model_cfg: Any) -> GPTDims:
    """Preset values overridden by the non-null ModelConfig fields, then checked (ConfigError).

    An explicit preset ffn_dim (3b, 8b) only applies while `dim` is the preset's; otherwise the
    LLaMA rule derives it from the dim in use. n_kv_heads defaults to n_heads (plain MHA).
    """
    preset_name = str(model_cfg.preset)
    if preset_name not in GPT_PRESETS:
        raise ConfigError("model.preset", f"unknown preset {preset_name!r}", list(GPT_PRESETS))
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
    # A preset's head_dim belongs to its dim and heads, as its ffn_dim does.
    head_dim = getattr(model_cfg, "head_dim", None)
    if head_dim is None and "head_dim" in preset and (dim, n_heads) == (preset["dim"], preset["n_heads"]):
        head_dim = preset["head_dim"]
    dims = GPTDims(
        dim=dim, n_layers=int(pick("n_layers")), n_heads=n_heads, n_kv_heads=int(n_kv_heads),
        ffn_dim=int(ffn_dim), vocab_size=int(pick("vocab_size")), tie_embeddings=bool(pick("tie_embeddings")),
        norm_eps=float(getattr(model_cfg, "norm_eps", 1e-5)),
        rope_theta=float(getattr(model_cfg, "rope_theta", 10000.0)),
        head_size=int(head_dim or 0), qk_norm=bool(pick("qk_norm") or False),
        moe=resolve_moe(getattr(model_cfg, "moe", None), preset, int(ffn_dim)),
        rope_scaling=resolve_rope_scaling(getattr(model_cfg, "rope_scaling", None)),
    )
    check_gpt_dims(dims)
    return dims


def check_gpt_dims(d: GPTDims) -> None:
    for field in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        if getattr(d, field) <= 0:
            raise ConfigError(f"model.{field}", f"must be positive, got {getattr(d, field)}")
    if d.head_size < 0:
        raise ConfigError("model.head_dim", f"must be positive, got {d.head_size}")
    if d.dim % d.n_heads and not d.head_size:
        raise ConfigError("model.dim", f"{d.dim} is not divisible by n_heads={d.n_heads}",
                          "a multiple of model.n_heads, or set model.head_dim")
    if d.n_heads % d.n_kv_heads:
        raise ConfigError("model.n_kv_heads", f"{d.n_kv_heads} does not divide n_heads={d.n_heads}")
    if d.head_dim % 2:
        key = "model.head_dim" if d.head_size else "model.dim"
        raise ConfigError(key, f"gives head_dim={d.head_dim}, which must be even for RoPE")


def attention_params(d: GPTDims) -> int:
    """Fused qkv + output projection (+ the q/k norms of qk_norm)."""
    return d.dim * (d.q_dim + 2 * d.kv_dim) + d.q_dim * d.dim + (2 * d.head_dim if d.qk_norm else 0)


def layer_params(d: GPTDims, i: int = 0) -> int:
    """Block i's parameters (a dense block's unless block i is MoE)."""
    mlp = d.moe.layer_mlp_params(d.dim) if d.is_moe_layer(i) else 3 * d.dim * d.ffn_dim  # SwiGLU: gate, up, down
    norms = 2 * d.dim
    return attention_params(d) + mlp + norms


def muon_matrix_params(d: GPTDims) -> int:
    """The 2-D weights Muon updates (components/muon.py): qkv and output projections, the dense
    SwiGLU, a MoE layer's router and shared expert; not the embedding, head, norms, or the routed
    experts (3-D grouped weights, which AdamW updates)."""
    attn = d.dim * (d.q_dim + 2 * d.kv_dim) + d.q_dim * d.dim
    moe_mlp = d.dim * d.moe.experts + 3 * d.dim * d.moe.shared_ffn_dim if d.moe is not None else 0
    mlp = sum(moe_mlp if d.is_moe_layer(i) else 3 * d.dim * d.ffn_dim for i in range(d.n_layers))
    return d.n_layers * attn + mlp


def param_count(d: GPTDims) -> int:
    """Exact; te_gpt's TransformerLayer (RMSNorm, swiglu, no bias) holds exactly gpt Block's tensors."""
    embed = d.vocab_size * d.dim
    head = 0 if d.tie_embeddings else d.vocab_size * d.dim
    return embed + sum(layer_params(d, i) for i in range(d.n_layers)) + d.dim + head


def expert_params(d: GPTDims) -> int:
    """The routed experts' weights over all layers (what mesh.ep splits); 0 for a dense model."""
    return 0 if d.moe is None else d.moe.moe_layers(d.n_layers) * d.moe.expert_params(d.dim)


def matmul_params(d: GPTDims) -> int:
    """Weights in a matmul per token: every linear incl. the head (also when tied), not the
    embedding lookup, norms or biases. In a MoE layer only the active ones: the router, top_k
    experts and the shared expert."""
    attn = d.dim * (d.q_dim + 2 * d.kv_dim) + d.q_dim * d.dim
    mlp = sum(d.moe.active_mlp_params(d.dim) if d.is_moe_layer(i) else 3 * d.dim * d.ffn_dim
              for i in range(d.n_layers))
    return d.n_layers * attn + mlp + d.vocab_size * d.dim


def active_params(d: GPTDims) -> int:
    """Parameters one token uses: all but the routed experts it does not go to."""
    if d.moe is None:
        return param_count(d)
    unused = (d.moe.experts - d.moe.top_k) * 3 * d.dim * d.moe.ffn_dim
    return param_count(d) - d.moe.moe_layers(d.n_layers) * unused


def lm_flops_per_token(n_matmul: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder LM: 6 * N_matmul + 12 * n_layers * dim * seq_len (PaLM
    appendix B / torchtitan: the attention term is not halved for the causal mask, so MFU compares
    with theirs). Activation recomputation is not counted."""
    return float(6 * n_matmul + 12 * n_layers * dim * seq_len)


def flops_per_token(d: GPTDims, seq_len: int) -> float:
    """Counted from the active weights (matmul_params) and the attention's q width (n_heads x head_dim)."""
    return lm_flops_per_token(matmul_params(d), d.n_layers, d.q_dim, seq_len)


# Bytes per logit alive when the loss's backward starts (lm_loss: cross-entropy in fp32): the
# log-softmax output it saved, the gradient arriving at it and the gradient it returns, each fp32.
LOSS_BYTES_PER_LOGIT = 12
# model.loss_kernel=te_fused: the bf16 logits, and their bf16 gradient (TE >= 2.20 writes it over
# the logits; older TE allocates it, so this bounds both).
FUSED_LOSS_BYTES_PER_LOGIT = 4
# train.compile (models/losses.py compiles the cross-entropy): Inductor keeps the bf16 logits and
# makes no fp32 copy of them; measured 5.4 bytes per logit at vocab 128,256 and seq 8192 on one H200
# (38.3 GiB reserved against 36.9 with te_fused, bench/results.json's sft_llama1b_s8192 rows).
COMPILED_LOSS_BYTES_PER_LOGIT = 6


def loss_bytes_per_logit(loss_kernel, compiled: bool = False) -> int:
    if str(loss_kernel) == "te_fused":
        return FUSED_LOSS_BYTES_PER_LOGIT
    return COMPILED_LOSS_BYTES_PER_LOGIT if compiled else LOSS_BYTES_PER_LOGIT


def checkpointed_count(n_layers: int, activation_checkpointing: str = "none", ac_every: int = 1) -> int:
    """How many blocks recompute (models/activation_checkpoint.py's rule, counted without torch)."""
    mode = str(activation_checkpointing)
    if mode == "full":
        return n_layers
    if mode == "selective":
        return len(range(0, n_layers, max(ac_every, 1)))
    return 0


def activation_parts(d: GPTDims, micro_batch_size: int, seq_len: int, bytes_per_el: int,
                     activation_checkpointing: str = "none", ac_every: int = 1, tp: int = 1,
                     te_layers: bool = False, loss_kernel: str = "torch", compiled: bool = False) -> dict:
    """Bytes one rank holds for backward at the start of the backward pass, one micro-batch:
    {"activations": the blocks and embedding, "logits": the loss's buffers}.

    Per token and block, counted from what autograd saves (calibrated against the measured peaks
    in bench/memory_reference.json):
      * torch `gpt`: 7d + 3kv + 4f elements: both norms' input and output (4d), the fused qkv
        output (d + 2kv; v is a view that keeps it alive), RoPE'd q and k (d + kv), the attention
        output (d), the fused gate|up output (2f), silu(gate) and its product with up (2f).
        Under DTensor TP (models/llama/tensor_parallel.py, no sequence parallelism) everything but the
        norms (4d) splits over tp, and each block keeps its local rows of the two fused weights
        for backward (a weight-sized copy).
      * TE `te_gpt` TransformerLayer: 6d + 2kv + 3f (its fused kernels save less); with tp its
        sequence parallelism splits all of it.
    A checkpointed block keeps only its input, plus one block's full set while it recomputes.
    Logits: `loss_bytes_per_logit` per token and vocab entry (the head is whole on every tp rank;
    `compiled`: train.compile, which compiles the cross-entropy).
    A MoE layer saves, per token, for each of its top_k experts the dispatched input and output
    copies (2d, plus d each way through the all-to-all under mesh.ep) and the expert's 4 * its ffn,
    the shared expert's 4 * its ffn, and the router's fp32 logits and probabilities (4 elements per
    expert at fp32 over bf16: counted as 4); an estimate, not yet calibrated on a GPU.
    """
    tokens = micro_batch_size * seq_len
    if d.moe is not None and not te_layers:
        m = d.moe
        moe_mlp = m.top_k * (4 * d.dim + 4 * m.ffn_dim) + 4 * m.shared_ffn_dim + 4 * m.experts
        n_moe = m.moe_layers(d.n_layers)
        mlp = (n_moe * moe_mlp + (d.n_layers - n_moe) * 4 * d.ffn_dim) / d.n_layers  # the mean over blocks
        d_mlp = mlp / 4  # in units of the dense rule's 4 * ffn_dim below
    else:
        d_mlp = d.ffn_dim
    if te_layers:
        per_layer, ckpt_in, weights = (6 * d.dim + 2 * d.kv_dim + 3 * d.ffn_dim) / tp, d.dim / tp, 0.0
    else:
        per_layer = 4 * d.dim + (3 * d.dim + 3 * d.kv_dim + 4 * d_mlp) / tp
        ckpt_in = d.dim
        # The local fused weights torch.cat'ed per forward (tp > 1 only), per token of this micro-batch.
        weights = (d.dim * (d.dim + 2 * d.kv_dim) + 2 * d.dim * d.ffn_dim) / tp / tokens if tp > 1 else 0.0
    n_ckpt = checkpointed_count(d.n_layers, activation_checkpointing, ac_every)
    layers = n_ckpt * ckpt_in + live_blocks(d, activation_checkpointing, ac_every) * (per_layer + weights)
    return {"activations": int(tokens * (layers + 3 * d.dim) * bytes_per_el),
            "logits": int(tokens * d.vocab_size * loss_bytes_per_logit(loss_kernel, compiled))}


def live_blocks(d: GPTDims, activation_checkpointing: str = "none", ac_every: int = 1) -> int:
    """Blocks whose forward state is alive at the start of backward (one recomputing, if any)."""
    n_ckpt = checkpointed_count(d.n_layers, activation_checkpointing, ac_every)
    return d.n_layers - n_ckpt + (1 if n_ckpt else 0)


def activation_bytes(d: GPTDims, micro_batch_size: int, seq_len: int, bytes_per_el: int,
                     activation_checkpointing: str = "none", ac_every: int = 1, tp: int = 1,
                     te_layers: bool = False) -> int:
    """`activation_parts`, summed."""
    return sum(activation_parts(d, micro_batch_size, seq_len, bytes_per_el, activation_checkpointing, ac_every,
                                tp, te_layers).values())


def describe(d: GPTDims, preset: str) -> str:
    head = f" head_dim={d.head_dim}" if d.head_size else ""
    qk = " qk_norm" if d.qk_norm else ""
    moe = f" {d.moe.describe()}" if d.moe is not None else ""
    s = d.rope_scaling
    rope = (f" rope=llama3(factor={s.factor:g}, freq_factors={s.low_freq_factor:g}-{s.high_freq_factor:g}, "
            f"original_ctx={s.original_max_position_embeddings})" if s is not None else "")
    return (f"preset={preset} dim={d.dim} layers={d.n_layers} heads={d.n_heads} kv_heads={d.n_kv_heads}{head}{qk} "
            f"ffn={d.ffn_dim} vocab={d.vocab_size} tied={d.tie_embeddings}{moe}{rope}")
